"""A run's checkpoints as the launcher uses them: where an attempt resumes from, and the final
model it saves (``checkpoint/``)."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_fast.controller.checkpoint_manager import Checkpoint, CheckpointManager
from areal_fast.launch.cluster import Cluster
from areal_fast.launch.config import ExperimentConfig
from areal_fast.launch.restarts import Attempt, trainer_fault
from areal_fast.launch.run_context import RunContext
from areal_fast.wire.handles import WorkerError, wait_messages
from areal_fast.wire.messages import SaveCheckpoint, Saved

log = logging.getLogger("areal_fast.launch")


def run_checkpoints(cfg: ExperimentConfig, run_dir: Path) -> CheckpointManager:
    """The recoverable checkpoints of the run in ``run_dir`` (``checkpoints/step-<v>``)."""
    return CheckpointManager(
        run_dir / "checkpoints", cfg.checkpoint.every_steps, cfg.checkpoint.keep, cfg.total_steps
    )


@dataclass
class ResumePoint:
    """Where one attempt starts.

    Attributes
    ----------
    checkpoints : CheckpointManager
        The run's recoverable checkpoints.
    latest : Checkpoint or None
        The checkpoint the attempt resumes from (None: step 0).
    attempt : Attempt
        Whether it resumes, and after how many trainer restarts.
    """

    checkpoints: CheckpointManager
    latest: Optional[Checkpoint]
    attempt: Attempt

    @property
    def version(self) -> int:
        """Steps trained before the attempt (the checkpoint's version, or 0)."""
        return self.latest.version if self.latest else 0

    @property
    def controller_state(self) -> Optional[dict]:
        """The checkpoint's ``controller.json`` (None: no checkpoint)."""
        return self.latest.controller if self.latest else None

    @property
    def elapsed_seconds(self) -> float:
        """Training seconds before the checkpoint (0 without one)."""
        return float(self.latest.controller.get("elapsed_seconds", 0.0)) if self.latest else 0.0

    def mark_damaged_by(self, exc: WorkerError) -> None:
        """A trainer that failed to start from the checkpoint (e.g. a file damaged in place)
        marks it damaged, so the next attempt resumes from an earlier one."""
        if self.latest is not None and trainer_fault(exc):
            self.checkpoints.mark_damaged(self.latest.path, str(exc).splitlines()[0])


def resume_point(cfg: ExperimentConfig, run_dir: Path, attempt: Attempt) -> ResumePoint:
    """Find where ``attempt`` starts: the last complete checkpoint when it resumes (its
    uncommitted ones are deleted); the pending groups of an earlier attempt are deleted."""
    checkpoints = run_checkpoints(cfg, run_dir)
    latest = None
    if attempt.resume:
        latest = checkpoints.latest()
        checkpoints.remove_temporaries()
        if latest is None:
            log.warning(
                "no complete checkpoint in %s: the run starts again from step 0", checkpoints.root
            )
    shutil.rmtree(run_dir / "shards", ignore_errors=True)  # pending groups are not resumed
    if latest is not None and latest.version >= cfg.total_steps:
        log.warning(
            "the checkpoint is of version %d, total_steps = %d: nothing to train",
            latest.version,
            cfg.total_steps,
        )
    return ResumePoint(checkpoints, latest, attempt)


def save_checkpoint(cluster: Cluster, path: str, timeout: float) -> None:
    """Ask the trainer (every rank) to write a HF checkpoint directory at ``path`` and wait
    for rank 0's answer.

    Raises
    ------
    WorkerError
        The trainer did not answer within ``timeout`` seconds, died or failed.
    """
    for rank in cluster.trainer_ranks:
        rank.send(SaveCheckpoint(path))
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerError(
                f"trainer {cluster.trainer.name!r} did not save {path} within "
                f"launcher.timeouts.train_step = {timeout:g} s"
            )
        for _rank, message in wait_messages(cluster.trainer_ranks, left, "while saving"):
            if isinstance(message, Saved):
                return


def save_final_model(run: RunContext, cluster: Cluster, tokenizer) -> None:
    """Save the trained model and ``tokenizer`` to ``<run_dir>/checkpoint`` (unless
    ``checkpoint.final_model`` is false)."""
    if run.cfg.checkpoint.final_model:
        run.phase = "saving the final model"
        path = str(run.run_dir / "checkpoint")
        save_checkpoint(cluster, path, run.cfg.launcher.timeouts.train_step)
        tokenizer.save_pretrained(path)
    run.phase = "writing the summary"
