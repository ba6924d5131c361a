"""How new weights reach each rollout worker (``sync.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_fast._checks import at_least, positive_finite

TRANSPORTS = ("auto", "shm", "cuda_ipc", "broadcast", "disk")
CUDA_IPC_SETTINGS = ("auto", "cuda_ipc")  # the settings under which a worker maps CUDA slots


@dataclass
class SyncConfig:
    """How each rollout worker gets new weights from trainer rank 0.

    ``auto`` picks per worker from node and GPU identity: a worker whose engine runs on trainer
    rank 0's GPU maps the trainer's CUDA slots (``cuda_ipc``), any other worker on rank 0's
    node maps its shared-memory slots (``shm``), a worker on any other node receives each
    version over a gloo pair group of its own (``broadcast``). ``shm``, ``cuda_ipc``,
    ``broadcast`` and ``disk`` force one path for every worker.
    """

    # auto | shm (map the trainer's host slots) | cuda_ipc (map its slots on the same GPU) |
    # broadcast (gloo over the network) | disk
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


def cuda_slots_usable(setting: str, worker_gpu: str, trainer_gpu: str) -> bool:
    """Whether a worker maps the trainer's CUDA slots: ``setting`` is ``auto`` or ``cuda_ipc``
    and its engine reports the GPU (UUID) on which the trainer keeps them ("" for none)."""
    return setting in CUDA_IPC_SETTINGS and bool(worker_gpu) and worker_gpu == trainer_gpu


def choose_transport(
    setting: str, worker_node: str, trainer_node: str, worker_gpu: str = "", trainer_gpu: str = ""
) -> str:
    """The weight path of one rollout worker.

    ``auto``: ``cuda_ipc`` when the worker runs on trainer rank 0's node and its engine on the
    GPU of the trainer's CUDA slots, else ``shm`` on that node, else ``broadcast``. Any
    other setting is returned as it is, ``cuda_ipc`` only where it can work.

    Parameters
    ----------
    setting : str
        ``sync.transport``.
    worker_node, trainer_node : str
        The node ids the workers report (the Ray node id; ``local`` for local processes).
    worker_gpu, trainer_gpu : str
        The GPU UUID of the worker's in-process engine and of the trainer's CUDA slots (""
        when there is none).

    Raises
    ------
    ValueError
        ``cuda_ipc`` forced where it cannot work (the one-line message says why).
    """
    same_gpu = worker_node == trainer_node and cuda_slots_usable(setting, worker_gpu, trainer_gpu)
    if setting == "cuda_ipc" and not same_gpu:
        raise ValueError(
            "sync.transport = 'cuda_ipc' needs the engine on the trainer's GPU, but "
            + _gpu_mismatch(worker_node, trainer_node, worker_gpu, trainer_gpu)
        )
    if setting != "auto":
        return setting
    if worker_node != trainer_node:
        return "broadcast"
    return "cuda_ipc" if same_gpu else "shm"


def _gpu_mismatch(worker_node: str, trainer_node: str, worker_gpu: str, trainer_gpu: str) -> str:
    if worker_node != trainer_node:
        return f"the worker runs on node {worker_node}, the trainer on node {trainer_node}"
    if not trainer_gpu:
        return "the trainer keeps no CUDA slots (its parameters are not on a CUDA device)"
    if not worker_gpu:
        return "the worker's engine is not an in-process engine on a CUDA device"
    return f"the worker's engine is on GPU {worker_gpu}, the trainer on GPU {trainer_gpu}"
