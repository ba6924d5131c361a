"""Sampling during training and how far rollout may run ahead (``rollout.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_fast._checks import at_least, positive_finite


@dataclass
class RolloutConfig:
    """Sampling during training (the inference engines) and how far it may run ahead.

    Rollouts are counted in prompt groups (one prompt sampled group_size times).
    """

    group_size: int = 4  # samples per prompt (GRPO group)
    # sampling temperature of training rollouts; the trainer takes its log-probs at it too
    temperature: float = 0.7
    top_p: float = 1.0  # nucleus sampling: smallest token set of this probability (1: off)
    max_new_tokens: int = 32  # tokens each sampled completion may have at most
    max_batch_size: int = 64  # sequences an engine generates together
    # η: a rollout may start only while accepted + running < (η + version + 1) · batch_size;
    # 0 is synchronous RL (AReaL §4.1)
    max_head_offpolicyness: int = 2
    # prompt groups in flight at most over all engines; None: (η + 1) · batch_size
    max_concurrent_rollouts: Optional[int] = None
    dynamic_filter: bool = False  # DAPO: drop groups whose rewards are all equal, resample
    # drop groups that would be trained more than η versions after they started (keeps every
    # token's staleness ≤ η; slow groups are long ones, so it shortens trained completions)
    drop_stale: bool = True
    num_workers: int = 1  # rollout worker processes (one engine each)

    def __post_init__(self):
        at_least("group_size", self.group_size, 2, "(GRPO compares samples of a prompt)")
        positive_finite("temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        at_least("max_new_tokens", self.max_new_tokens, 1)
        at_least("max_batch_size", self.max_batch_size, 1)
        at_least("max_head_offpolicyness", self.max_head_offpolicyness, 0)
        if self.max_concurrent_rollouts is not None:
            at_least("max_concurrent_rollouts", self.max_concurrent_rollouts, 1)
        at_least("num_workers", self.num_workers, 1)
