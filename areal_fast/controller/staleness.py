"""Staleness control: how many new rollouts may start now (AReaL, Fu et al. 2025, §4.1)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessCounts:
    """Rollout counters, in prompt groups (one rollout = one prompt sampled group_size times).

    Attributes
    ----------
    running : int
        Submitted and not yet finished.
    accepted : int
        Finished and kept for training (cumulative over the run, trained or not yet).
    rejected : int
        Finished and dropped (dynamic filter, errors); they free their slot.
    """

    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    """Bounds how far generation may run ahead of training.

    With η = ``max_head_offpolicyness``, B = ``batch_size`` prompt groups consumed per
    training step and v the current policy version, a new rollout may start only while
    ``accepted + running < (η + v + 1) · B`` and ``running < max_concurrent_rollouts``
    (AReaL, Fu et al. 2025, §4.1). When batches are consumed in acceptance order, a rollout
    started at version v is trained by a step at version ≤ v + η, so the staleness of every
    token (trainer version − version that generated it) is at most η.
    η = 0 gives synchronous RL: each step's B rollouts start only after the previous step.

    All counts are prompt groups (one rollout = one prompt with its group_size samples).

    Parameters
    ----------
    batch_size : int
        B, prompt groups per training step (>= 1).
    max_head_offpolicyness : int
        η (>= 0).
    max_concurrent_rollouts : int
        Most rollouts in flight at once (>= 1).

    Raises
    ------
    ValueError
        A parameter out of range (named in the message).
    """

    def __init__(self, batch_size: int, max_head_offpolicyness: int,
                 max_concurrent_rollouts: int):
        for name, value, low in (("batch_size", batch_size, 1),
                                 ("max_head_offpolicyness", max_head_offpolicyness, 0),
                                 ("max_concurrent_rollouts", max_concurrent_rollouts, 1)):
            if int(value) != value or value < low:
                raise ValueError(f"{name} = {value} must be an integer >= {low}")
        self.batch_size = int(batch_size)
        self.eta = int(max_head_offpolicyness)
        self.max_concurrent = int(max_concurrent_rollouts)
        self.counts = StalenessCounts()

    def capacity(self, version: int) -> int:
        """How many rollouts may start now at policy ``version`` (never negative)."""
        c = self.counts
        by_staleness = (self.eta + version + 1) * self.batch_size - (c.accepted + c.running)
        return max(0, min(self.max_concurrent - c.running, by_staleness))

    def on_submit(self, n: int = 1) -> None:
        """``n`` rollouts started."""
        self.counts.running += n

    def on_finish(self, accepted: bool) -> None:
        """One rollout finished; ``accepted`` says whether it is kept for training.

        Raises
        ------
        RuntimeError
            If no rollout is running (an internal bookkeeping error).
        """
        if self.counts.running <= 0:
            raise RuntimeError("staleness: a rollout finished but none was running")
        self.counts.running -= 1
        if accepted:
            self.counts.accepted += 1
        else:
            self.counts.rejected += 1
