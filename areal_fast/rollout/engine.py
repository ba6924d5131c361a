"""The inference-engine interface that rollout drives (embedded HF, vLLM and SGLang clients)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

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

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        """``params.n`` trajectories per prompt (token-id lists), prompt-major order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Atomically install a complete set of named weights carrying ``version``."""
        ...
