"""The run's rollout accounting: every submitted prompt group trained once or dropped once
with a reason (``summary.json``'s counts and a checkpoint's ``controller.json``). The
:class:`~areal_fast.controller.ledger.Ledger` folds each finished record into it."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RunCounts:
    """Where every submitted rollout went: trained exactly once, or dropped with a reason."""

    submitted: int = 0
    trained: int = 0
    dropped: dict = field(default_factory=lambda: collections.Counter())
    interruptions: int = 0
    stale_dropped_tokens: int = 0  # completion tokens of the groups dropped as stale
    resubmitted: int = 0  # running groups of a dead rollout worker started again elsewhere
    rollout_restarts: int = 0
    # per restart: seconds from noticing the death to the new worker serving current weights
    recovery_seconds: list = field(default_factory=list)
    # per acknowledged weight update: a rollout worker's pause → new weights installed →
    # resumed, s (the trainer's part is each step's publish_seconds)
    update_seconds: list = field(default_factory=list)

    def as_dict(self) -> dict:
        """The counts as plain JSON-able values (for summary.json)."""
        return {
            "rollouts_submitted": self.submitted,
            "rollouts_trained": self.trained,
            "rollouts_dropped": dict(self.dropped),
            "sample_interruptions": self.interruptions,
            "stale_dropped_completion_tokens": self.stale_dropped_tokens,
            "rollouts_resubmitted": self.resubmitted,
            "rollout_worker_restarts": self.rollout_restarts,
            "rollout_recovery_seconds": list(self.recovery_seconds),
            "weight_update_seconds": [round(x, 4) for x in self.update_seconds],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "RunCounts":
        """Inverse of :meth:`as_dict` (a resumed run continues the counts)."""
        return cls(
            data["rollouts_submitted"],
            data["rollouts_trained"],
            collections.Counter(data["rollouts_dropped"]),
            data["sample_interruptions"],
            data["stale_dropped_completion_tokens"],
            data.get("rollouts_resubmitted", 0),
            data.get("rollout_worker_restarts", 0),
            list(data.get("rollout_recovery_seconds", [])),
            list(data.get("weight_update_seconds", [])),
        )
