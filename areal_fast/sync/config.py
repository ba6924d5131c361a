"""How new weights reach each rollout worker (``sync.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_fast._checks import at_least, positive_finite

TRANSPORTS = ("auto", "shm", "broadcast", "disk")


@dataclass
class SyncConfig:
    """How each rollout worker gets new weights from trainer rank 0.

    ``auto`` picks per worker from node identity: a worker on trainer rank 0's node maps the
    trainer's shared-memory slots, a worker on any other node receives each version over a
    gloo pair group of its own (``broadcast``). ``shm``, ``broadcast`` and ``disk`` force one
    path for every worker.
    """

    # auto | shm (map the trainer's slots) | broadcast (gloo over the network) | disk
    transport: str = "auto"
    bucket_mb: int = 64  # MiB per bucket of a network or disk update (two in memory per end)
    timeout: float = 300.0  # seconds each step of an update (connect, header, bucket) may take
    # shared folder of the disk transport (None: <run dir>/weights; must be on every node)
    disk_dir: Optional[str] = None
    # CRC-32 of the weights after every update, trainer and workers (summary.json); costs a
    # read of the whole slot per version on each side (the trainer's before it reports)
    checksum: bool = False

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport = {self.transport!r}: expected one of {', '.join(TRANSPORTS)}"
            )
        at_least("bucket_mb", self.bucket_mb, 1)
        positive_finite("timeout", self.timeout)

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes."""
        return self.bucket_mb << 20


def choose_transport(setting: str, worker_node: str, trainer_node: str) -> str:
    """The weight path of one rollout worker: ``setting`` unless it is ``auto``; then
    ``shm`` when the worker runs on trainer rank 0's node, else ``broadcast``.

    Nodes are the ids the workers report (the Ray node id; ``local`` for local processes).
    """
    if setting != "auto":
        return setting
    return "shm" if worker_node == trainer_node else "broadcast"
