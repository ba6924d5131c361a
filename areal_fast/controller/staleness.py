"""Staleness control: how many new rollouts may start now (AReaL, Fu et al. 2025, §4.1)."""

from __future__ import annotations

import numbers
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
    (AReaL, Fu et al. 2025, §4.1). This bounds how much generation runs ahead; it does not by
    itself bound the staleness of one slow rollout, which keeps its slot while later ones
    are accepted and trained. The controller therefore also drops (and counts) any accepted
    rollout that would be trained more than η versions after it started
    (:meth:`on_discard`), which keeps every token's staleness ≤ η.
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

    def __init__(self, batch_size: int, max_head_offpolicyness: int, max_concurrent_rollouts: int):
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("max_head_offpolicyness", max_head_offpolicyness, 0),
            ("max_concurrent_rollouts", max_concurrent_rollouts, 1),
        ):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} = {value!r} must be an integer >= {low}")
        self.batch_size = int(batch_size)
        self.eta = int(max_head_offpolicyness)
        self.max_concurrent = int(max_concurrent_rollouts)
        self.counts = StalenessCounts()

    def capacity(self, version: int) -> int:
        """How many rollouts may start now at policy ``version`` (never negative), by this
        manager's own :attr:`counts`."""
        return self.capacity_for(version, self.counts.accepted, self.counts.running)

    def capacity_for(self, version: int, accepted: int, running: int) -> int:
        """How many rollouts may start at policy ``version`` with ``accepted`` and
        ``running`` prompt groups counted elsewhere (the controller's ledger): never
        negative."""
        by_staleness = (self.eta + version + 1) * self.batch_size - (accepted + running)
        return max(0, min(self.max_concurrent - running, by_staleness))

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

    def on_discard(self) -> None:
        """An accepted rollout is dropped before training (too stale); its place frees up.

        Raises
        ------
        RuntimeError
            If no rollout is accepted (an internal bookkeeping error).
        """
        if self.counts.accepted <= 0:
            raise RuntimeError("staleness: discarding an accepted rollout but none is")
        self.counts.accepted -= 1
        self.counts.rejected += 1
