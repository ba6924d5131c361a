"""Engine bridge: ``await generate(...)`` for agent sessions over a request-level engine.

:class:`EngineBridge` turns each awaited model call into a
:class:`~areal_fast.rollout.engine.GenRequest` for an
:class:`~areal_fast.rollout.engine.AsyncInferenceEngine`, and resolves the caller's future when
the engine's output comes back (routed by the rollout worker, or by :meth:`EngineBridge.pump`).
When a weight update aborts a request, the bridge resubmits the prompt plus the partial output
with the remaining budget and the completion offset, so the sample continues its random stream
and a model call can span two policy versions token by token.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Optional

from areal_fast.agent.client import GenerateFn, GenResult
from areal_fast.rollout.engine import GenOutput, GenRequest


class EngineBridge:
    """``await generate(...)`` over a request-level engine (see the module docstring).

    Parameters
    ----------
    engine : AsyncInferenceEngine
    loop : asyncio.AbstractEventLoop
        The loop whose coroutines await :meth:`generate`.
    rids : iterator of int
        Request ids shared with other users of the engine (unique per engine).

    Attributes
    ----------
    resumed : int
        Requests resubmitted after an abort so far (a model call interrupted by a weight
        update, counted once per interruption).
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, rids=None):
        self.engine, self.loop = engine, loop
        self.rids = rids if rids is not None else itertools.count()
        self.pending: dict[int, tuple[asyncio.Future, GenRequest, GenResult]] = {}
        self.lock = threading.Lock()
        self.resumed = 0

    async def generate(
        self, input_ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> GenResult:
        """Sample one completion of ``input_ids`` (see :data:`~areal_fast.agent.client.
        GenerateFn`); cancelling the awaiting task forgets the request."""
        future = self.loop.create_future()
        request = GenRequest(
            next(self.rids), list(input_ids), max_new_tokens, temperature, top_p, seed, 0
        )
        with self.lock:
            self.pending[request.rid] = (future, request, GenResult([], [], [], ""))
        self.engine.submit([request])
        try:
            return await future
        finally:
            with self.lock:
                for rid in [r for r, entry in self.pending.items() if entry[0] is future]:
                    del self.pending[rid]

    def owns(self, rid: int) -> bool:
        """Whether request ``rid`` is one of this bridge's (still awaited)."""
        with self.lock:
            return rid in self.pending

    def on_output(self, out: GenOutput) -> Optional[GenRequest]:
        """Take one engine output (any thread). Returns the resubmission of an aborted
        request with budget left (the caller submits it at the front), else None."""
        with self.lock:
            entry = self.pending.pop(out.rid, None)
            if entry is None:
                return None
            future, request, acc = entry
            acc.output_ids += out.output_ids
            acc.logprobs += out.logprobs
            acc.versions += out.versions
            done = len(acc.output_ids)
            if out.stop_reason == "abort" and done < request.max_new_tokens:
                again = GenRequest(
                    next(self.rids),
                    request.input_ids + acc.output_ids,
                    request.max_new_tokens - done,
                    request.temperature,
                    request.top_p,
                    request.seed,
                    done,
                )
                self.pending[again.rid] = (future, request, acc)
                self.resumed += 1
                return again
        acc.stop_reason = "length" if out.stop_reason == "abort" else out.stop_reason
        self.loop.call_soon_threadsafe(_resolve, future, acc)
        return None

    def pump(self, timeout: float = 0.5) -> None:
        """Route one batch of the engine's outputs (for callers without a rollout worker)."""
        again = [r for r in map(self.on_output, self.engine.get_outputs(timeout)) if r]
        if again:
            self.engine.submit(again, front=True)


def _resolve(future: asyncio.Future, result: GenResult) -> None:
    if not future.done():
        future.set_result(result)


def completion_engine_generate(engine) -> GenerateFn:
    """``generate`` for agent sessions over an engine with the call shape of
    ``vllm.LLM.generate`` wrapped to take token ids (one request per call, run in
    a worker thread; the engine serialises them).

    Parameters
    ----------
    engine : object
        E.g. the demo's ``OfflineVLLMEngine`` (``benches/_vllm_offline.py``).
        ``generate(prompts_token_ids, n, temperature, max_tokens, logprobs, top_p, seed)``
        returning ``[[Completion]]`` with ``token_ids``, ``logprobs``, ``finish_reason``,
        ``version``.

    Returns
    -------
    GenerateFn
        The behaviour log-probs are the engine's (vLLM's default ``raw_logprobs`` are taken
        before temperature and top-p: equal to the sampling distribution's only at
        temperature 1 and top_p 1).
    """

    async def generate(
        input_ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> GenResult:
        [[c]] = await asyncio.to_thread(
            engine.generate,
            [input_ids],
            1,
            temperature,
            max_new_tokens,
            True,
            top_p,
            seed % VLLM_SEED_RANGE,
        )
        return GenResult(
            list(c.token_ids),
            list(c.logprobs),
            [c.version] * len(c.token_ids),
            c.finish_reason or "length",
        )

    return generate


VLLM_SEED_RANGE = 2**31  # seeds are folded into a 31-bit range, which every engine accepts
