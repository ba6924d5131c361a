"""Local launcher processes: rollout workers and one trainer on this machine.

:class:`LocalCluster` spawns the worker processes, waits for each to report ready (within a
timeout, naming any that fails) and always stops them on exit. A Ray launcher places the same
worker entry points (:func:`rollout_worker_main`, :func:`trainer_worker_main`) elsewhere.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from dataclasses import dataclass

from areal_fast.controller import messages as msg
from areal_fast.controller.rollout_worker import RolloutWorkerSpec, rollout_worker_main
from areal_fast.controller.trainer_worker import TrainerWorkerSpec, trainer_worker_main
from areal_fast.controller.workers import WorkerError, WorkerHandle, spawn_worker, wait_messages
from areal_fast.sync.shared_memory import remove_orphaned_buffers


@dataclass
class ClusterSpec:
    """Which workers to start: ``num_rollout_workers`` copies of ``rollout`` and one trainer."""

    rollout: RolloutWorkerSpec
    trainer: TrainerWorkerSpec
    num_rollout_workers: int = 1
    startup_timeout: float = 600.0

    def __post_init__(self):
        if self.num_rollout_workers < 1:
            raise ValueError(f"num_rollout_workers = {self.num_rollout_workers} must be >= 1")


class LocalCluster:
    """Context manager: start every worker, hand out their handles, stop them on exit.

    Attributes (after ``__enter__``)
    --------------------------------
    rollout_workers : list[WorkerHandle]
    trainer : WorkerHandle
    weight_buffers : tuple[WeightBufferSpec, WeightBufferSpec]
    authkey : bytes
        Random secret of this job; shard servers accept only peers that know it.

    Raises
    ------
    WorkerError
        A worker failed or did not report ready within ``startup_timeout`` (named).
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.authkey = secrets.token_bytes(32)
        self.rollout_workers: list[WorkerHandle] = []
        self.trainer: WorkerHandle | None = None
        self.weight_buffers: tuple = ()

    def __enter__(self) -> "LocalCluster":
        remove_orphaned_buffers()
        try:
            self.trainer = spawn_worker("trainer", trainer_worker_main, self.spec.trainer,
                                        self.authkey)
            self.rollout_workers = [
                spawn_worker(f"rollout-{i}", rollout_worker_main, self.spec.rollout,
                             self.authkey) for i in range(self.spec.num_rollout_workers)]
            self._wait_ready([self.trainer, *self.rollout_workers])
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, handles: list[WorkerHandle]) -> None:
        waiting = {h.name for h in handles}
        deadline = time.monotonic() + self.spec.startup_timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"worker {sorted(waiting)[0]!r} did not start within "
                                  f"startup_timeout = {self.spec.startup_timeout:g} s")
            for handle, message in wait_messages(handles, left, "while starting up"):
                if not isinstance(message, msg.WorkerReady):
                    raise WorkerError(f"worker {handle.name!r} sent "
                                      f"{type(message).__name__} before it was ready")
                waiting.discard(handle.name)
                if handle is self.trainer:
                    self.weight_buffers = message.weight_buffers

    def __exit__(self, exc_type, exc, tb) -> None:
        # after a failure, do not wait long for a busy worker to finish its current step
        self.close(grace_seconds=10.0 if exc_type is None else 2.0)

    def close(self, grace_seconds: float = 2.0) -> None:
        """Stop every worker (Shutdown, then terminate after ``grace_seconds``) and delete the
        trainer's shared-memory weight files, which a killed trainer cannot delete itself."""
        for handle in [*self.rollout_workers, *([self.trainer] if self.trainer else [])]:
            handle.stop(grace_seconds)
        for spec in self.weight_buffers:
            Path(spec.path).unlink(missing_ok=True)
