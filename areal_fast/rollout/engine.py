"""The inference-engine interface that rollout drives (embedded HF, vLLM and SGLang clients)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import torch

from areal_fast.rl.batch import Trajectory


@dataclass
class SamplingParams:
    """How to sample completions.

    Attributes
    ----------
    n : int
        Samples per prompt (the GRPO group size).
    temperature : float
        Sampling temperature; 0 means greedy decoding.
    top_p : float
        Nucleus-sampling mass in (0, 1].
    max_new_tokens : int
        Generation budget per sample, in tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n = {self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} must be >= 1")


class InferenceEngine(Protocol):
    """What the controller needs from an inference engine; nothing more.

    ``generate`` returns, for each prompt, ``params.n`` trajectories (prompt-major order:
    all samples of prompt 0, then prompt 1, ...) with per-token behaviour log-probs and the
    policy version that produced each token. ``update_weights`` installs a complete new set
    of weights and the version they carry; generation afterwards uses only those weights.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights being served."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> list[Trajectory]:
        """``params.n`` trajectories per prompt (token-id lists), prompt-major order.

        With ``seeds`` (one per prompt), sample i of prompt g is drawn with
        ``sample_seed(seeds[g], i)`` (see :class:`GenRequest`), so its tokens do not depend on
        batching or on interruptions.
        """
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Atomically install a complete set of named weights carrying ``version``."""
        ...


@dataclass
class GenRequest:
    """One sequence to continue, as a rollout worker hands it to a request-level engine.

    Attributes
    ----------
    rid : int
        Request id, unique within the engine; echoed in the :class:`GenOutput`.
    input_ids : list[int]
        Prompt plus the completion generated so far (non-empty); token ids, never text.
    max_new_tokens : int
        Remaining generation budget (>= 1).
    temperature, top_p : float
        As in :class:`SamplingParams`; temperature 0 is greedy.
    seed : int
        Sampling seed of the whole completion (``sample_seed(group_seed, i)``).
    offset : int
        Completion tokens generated before this request (0 for a fresh sample; the partial
        length when resuming after an abort). The token at completion position ``offset + j``
        is drawn with the uniform number ``seeded_uniform(seed, offset + j)``, so a resumed
        sample continues the same random stream.
    """

    rid: int
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    offset: int = 0


@dataclass
class GenOutput:
    """What a request-level engine returns for one :class:`GenRequest`.

    Attributes
    ----------
    rid : int
    output_ids : list[int]
        Newly generated tokens (may be empty when aborted before the first token).
    logprobs : list[float]
        Behaviour log-prob of each new token (fp32 nats, at the request's temperature).
    versions : list[int]
        Policy version that produced each new token.
    stop_reason : str
        "stop" (end-of-sequence token, included in output_ids), "length" (budget used up)
        or "abort" (interrupted by :meth:`AsyncInferenceEngine.pause`; resubmit
        input_ids + output_ids with the remaining budget to continue).
    first_token_time : float or None
        ``time.monotonic()`` when the engine sampled the first new token (engines that
        record it: the embedded engine's continuous batches); None otherwise.
    """

    rid: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    first_token_time: Optional[float] = None


def check_requests(requests: list[GenRequest]) -> None:
    """Raise ``ValueError`` naming the first malformed request (empty ``input_ids``, a budget
    below 1, a negative temperature or offset, ``top_p`` outside (0, 1])."""
    for i, r in enumerate(requests):
        if not r.input_ids:
            raise ValueError(f"requests[{i}].input_ids is empty")
        if r.max_new_tokens < 1:
            raise ValueError(f"requests[{i}].max_new_tokens = {r.max_new_tokens} must be >= 1")
        if r.temperature < 0:
            raise ValueError(f"requests[{i}].temperature = {r.temperature} must be >= 0")
        if not 0 < r.top_p <= 1:
            raise ValueError(f"requests[{i}].top_p = {r.top_p} must be in (0, 1]")
        if r.offset < 0:
            raise ValueError(f"requests[{i}].offset = {r.offset} must be >= 0")


class AsyncInferenceEngine(Protocol):
    """Request-level engine interface that rollout workers drive (mirrors SGLang's
    ``/generate``, ``/pause_generation``, ``/update_weights_*``, ``/continue_generation``).

    Requests run in the engine's own thread; finished or aborted ones come back through
    :meth:`get_outputs`. :meth:`pause` aborts every running request (each returns with
    stop_reason "abort" and its partial tokens) and keeps queued ones queued; weights change
    only while paused; :meth:`resume` starts generating again.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights being served."""
        ...

    def start(self) -> None:
        """Start the engine thread."""
        ...

    def submit(self, requests: list[GenRequest], front: bool = False) -> None:
        """Queue requests; they run when capacity allows. ``front`` puts them ahead of every
        queued request (resumed samples)."""
        ...

    def get_outputs(self, timeout: float) -> list[GenOutput]:
        """Finished or aborted requests, waiting up to ``timeout`` seconds for the first."""
        ...

    def pause(self, timeout: float, keep: Optional[bool] = None) -> None:
        """Stop starting requests and abort running ones; returns once the engine is idle.
        ``keep=True`` (engines with an in-place pause; ``None``: the engine's own mode)
        freezes running requests inside the engine instead, to continue after
        :meth:`resume`.

        Raises TimeoutError if it is not idle within ``timeout`` seconds."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Install a complete set of named weights carrying ``version`` (only while paused)."""
        ...

    def resume(self) -> None:
        """Start generating queued requests again."""
        ...

    # Optional: ``update_weights_from_buffer(spec: WeightBufferSpec, version: int)``, for
    # engines that map a trainer's shared-memory slot themselves (the rollout worker then
    # passes only the slot's layout); see :mod:`areal_fast.rollout.loop_engine`.

    def drop_queued(self) -> int:
        """Forget queued (not yet running) requests; returns how many."""
        ...

    def close(self) -> None:
        """Stop the engine thread (pending requests are dropped)."""
        ...


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea & Flood 2014): a 64-bit integer mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(group_seed: int, index: int) -> int:
    """Seed of sample ``index`` of a group whose seed is ``group_seed`` (64-bit)."""
    return _splitmix64(_splitmix64(group_seed & _MASK64) ^ (index & _MASK64))


def seeded_uniform(seed: int, position: int) -> float:
    """Uniform number in [0, 1) for completion position ``position`` of a sample with
    ``seed``: counter-based, so it depends on nothing else (53-bit resolution)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0**-53
