"""The plan of a reproducible run (``rollout.reproducible``): which prompt groups form each
batch, under which policy version each group is generated and on which rollout worker.

Batch k (trained by step k + 1, which makes version k + 1) is the groups
``k·B … k·B + B − 1`` in data order, generated wholly under version ``max(0, k − η)``: so the
generation of batches k + 1 … k + η still overlaps the training of batch k, and every trained
token's staleness is exactly ``min(k, η)``. Group g runs on the worker ``g mod W`` of the
fleet's fixed order, together with the other groups of its worker and version (one
submission: the engine's batches are then the same on every run).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedSchedule:
    """Batches, versions and workers of a reproducible run (see the module docstring).

    Parameters
    ----------
    batch_size : int
        B, prompt groups per batch (>= 1).
    eta : int
        η = ``rollout.max_head_offpolicyness`` (>= 0).
    num_workers : int
        W, rollout workers (>= 1).
    total_steps : int
        Batches of the run; no group of a later batch is planned.

    Raises
    ------
    ValueError
        A parameter below its minimum.
    """

    batch_size: int
    eta: int
    num_workers: int
    total_steps: int

    def __post_init__(self):
        for name, low in (("batch_size", 1), ("eta", 0), ("num_workers", 1), ("total_steps", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"FixedSchedule: {name} = {getattr(self, name)} must be >= {low}")

    def batch_ids(self, k: int) -> list[int]:
        """Group ids of batch ``k`` (trained by step k + 1), in order."""
        return list(range(k * self.batch_size, (k + 1) * self.batch_size))

    def batch_of(self, group_id: int) -> int:
        """The batch group ``group_id`` belongs to."""
        return group_id // self.batch_size

    def version_of(self, k: int) -> int:
        """The policy version batch ``k`` is generated under: ``max(0, k − η)``."""
        return max(0, k - self.eta)

    def batches_under(self, version: int) -> range:
        """The batches generated under ``version`` (0: batches 0 … η; v > 0: batch v + η),
        those past ``total_steps`` left out."""
        first = 0 if version == 0 else version + self.eta
        return range(first, min(version + self.eta + 1, self.total_steps))

    def worker_of(self, group_id: int) -> int:
        """Index (in the fleet's order) of the rollout worker that generates ``group_id``."""
        return group_id % self.num_workers

    def due(self, version: int, worker: int) -> list[int]:
        """Group ids ``worker`` generates under ``version``, in order."""
        return [
            g
            for k in self.batches_under(version)
            for g in self.batch_ids(k)
            if self.worker_of(g) == worker
        ]

    def last_version(self) -> int:
        """The last version any batch is generated under (later versions only train)."""
        return self.version_of(self.total_steps - 1)
