"""A stand-in inference engine with a fixed decode speed, for controller benchmarks and tests.

Every running sequence decodes at ``1 / token_seconds`` tokens per second regardless of load
(at most ``max_running`` at once; the rest queue). A sample's completion length is drawn from
a lognormal seeded by the request's sample seed, so it does not depend on batching or on
interruptions; a paused sequence returns the tokens it had decoded so far. No model runs:
tokens are deterministic ids, log-probs a constant.
"""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from areal_fast.rollout.engine import GenOutput, GenRequest

SIM_LOGPROB = -1.0


@dataclass
class SimulatedEngineConfig:
    """Decode speed and completion-length distribution of :class:`SimulatedEngine`.

    Attributes
    ----------
    token_seconds : float
        Seconds per decoded token of one sequence (1e-3 = 1 token per ms).
    max_running : int
        Sequences decoded at once; more requests wait in a queue.
    median_length, sigma, max_length : float, float, int
        Completion length ~ min(round(lognormal(ln median, sigma)), max_length), >= 1.
    vocab_size : int
        Token ids are drawn from [1, vocab_size); id 0 is the end-of-sequence token.
    """

    token_seconds: float = 1e-3
    max_running: int = 32
    median_length: float = 512.0
    sigma: float = 0.8
    max_length: int = 4096
    vocab_size: int = 32000

    def __post_init__(self):
        if not (
            self.token_seconds > 0
            and self.max_running >= 1
            and self.median_length > 0
            and self.sigma >= 0
            and self.max_length >= 1
            and self.vocab_size >= 2
        ):
            raise ValueError(f"SimulatedEngineConfig out of range: {self}")

    def length(self, seed: int) -> int:
        """Completion length of the sample with ``seed`` (deterministic)."""
        draw = random.Random(seed).lognormvariate(math.log(self.median_length), self.sigma)
        return max(1, min(self.max_length, round(draw)))


@dataclass
class _Running:
    request: GenRequest
    start: float
    num_new: int  # tokens this request will produce if not aborted
    stops: bool  # whether its last token ends the sample (eos)


class SimulatedEngine:
    """:class:`~areal_fast.rollout.engine.AsyncInferenceEngine` with simulated decoding."""

    eos_token_id = 0

    def __init__(self, config: SimulatedEngineConfig):
        self.config = config
        self._version = 0
        self._cond = threading.Condition()
        self._queue: deque[GenRequest] = deque()
        self._heap: list[tuple[float, int, _Running]] = []
        self._outputs: list[GenOutput] = []
        self._out_cond = threading.Condition()
        self._paused = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sim-engine")

    @property
    def version(self) -> int:
        """Policy version of the served (stand-in) weights."""
        return self._version

    def start(self) -> None:
        """Start the decode thread."""
        self._thread.start()

    def submit(self, requests: list[GenRequest], front: bool = False) -> None:
        """Queue requests (``front``: ahead of the queue); they start when fewer than
        max_running decode."""
        with self._cond:
            if front:
                self._queue.extendleft(reversed(requests))
            else:
                self._queue.extend(requests)
            self._cond.notify()

    def get_outputs(self, timeout: float) -> list[GenOutput]:
        """Finished or aborted requests, waiting up to ``timeout`` s for one."""
        with self._out_cond:
            if not self._outputs:
                self._out_cond.wait(timeout)
            out, self._outputs = self._outputs, []
        return out

    def pause(self, timeout: float, keep: Optional[bool] = None) -> None:
        """Abort every running request (partial tokens returned); keep the queue (``keep``
        is ignored: the simulated engine always aborts)."""
        now = time.monotonic()
        with self._cond:
            self._paused = True
            aborted = [self._partial(run, now) for _, _, run in self._heap]
            self._heap.clear()
        self._emit(aborted)

    def update_weights(self, named_tensors: Iterable, version: int) -> None:
        """Take ``version`` (only while paused; the tensors are ignored)."""
        if not self._paused:
            raise RuntimeError("simulated engine: update_weights needs pause() first")
        for _ in named_tensors:
            pass
        self._version = int(version)

    def resume(self) -> None:
        """Start decoding queued requests again."""
        with self._cond:
            self._paused = False
            self._cond.notify()

    def drop_queued(self) -> int:
        """Forget queued (not running) requests; returns how many."""
        with self._cond:
            n = len(self._queue)
            self._queue.clear()
            return n

    def close(self) -> None:
        """Stop the decode thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _tokens(self, request: GenRequest, count: int, stops: bool) -> list[int]:
        base = request.seed % (self.config.vocab_size - 1)
        ids = [1 + (base + request.offset + j) % (self.config.vocab_size - 1) for j in range(count)]
        if stops and ids:
            ids[-1] = self.eos_token_id
        return ids

    def _output(self, run: _Running, count: int, reason: str, version: int) -> GenOutput:
        return GenOutput(
            run.request.rid,
            self._tokens(run.request, count, reason == "stop"),
            [SIM_LOGPROB] * count,
            [version] * count,
            reason,
        )

    def _partial(self, run: _Running, now: float) -> GenOutput:
        done = int((now - run.start) / self.config.token_seconds)
        return self._output(run, min(done, run.num_new - 1), "abort", self._version)

    def _admit(self, now: float) -> None:
        while self._queue and len(self._heap) < self.config.max_running:
            request = self._queue.popleft()
            left = self.config.length(request.seed) - request.offset
            num_new = max(1, min(left, request.max_new_tokens))
            run = _Running(request, now, num_new, stops=left <= request.max_new_tokens)
            finish = now + num_new * self.config.token_seconds
            heapq.heappush(self._heap, (finish, request.rid, run))

    def _loop(self) -> None:
        while True:
            finished = []
            with self._cond:
                version = self._version  # weights change only while paused (heap empty)
                if self._closed:
                    return
                now = time.monotonic()
                if not self._paused:
                    self._admit(now)
                while self._heap and self._heap[0][0] <= now:
                    finished.append(heapq.heappop(self._heap)[2])
                if not finished:
                    wait = self._heap[0][0] - now if self._heap else None
                    self._cond.wait(wait)
                    continue
            self._emit(
                [
                    self._output(r, r.num_new, "stop" if r.stops else "length", version)
                    for r in finished
                ]
            )

    def _emit(self, outputs: list[GenOutput]) -> None:
        if outputs:
            with self._out_cond:
                self._outputs.extend(outputs)
                self._out_cond.notify()


@dataclass
class SimulatedEngineFactory:
    """Picklable builder of a :class:`SimulatedEngine` and its decode function."""

    config: SimulatedEngineConfig

    def __call__(self):
        return SimulatedEngine(self.config), sim_decode


def sim_decode(token_ids: list[int]) -> str:
    """Text of a simulated completion: the sum of its first three token ids."""
    return str(sum(token_ids[:3]))


def sim_reward(completion_text: str, answer: str) -> float:
    """Reward of a simulated completion: 1.0 for odd ``sim_decode`` sums, else 0.0."""
    return float(int(completion_text or 0) % 2)
