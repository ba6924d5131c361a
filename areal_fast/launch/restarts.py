"""Restarting a run after a trainer fault: a dead or failed trainer rank starts the job again
from its last complete checkpoint, at most ``recovery.max_trainer_restarts`` times; any other
failure ends the run with ``FAILED`` in the run directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from areal_fast.launch.run_context import RunContext
from areal_fast.launch.run_dir import mark_failed
from areal_fast.wire.handles import WorkerError

log = logging.getLogger("areal_fast.launch")


@dataclass(frozen=True)
class Attempt:
    """One try at running the job.

    Attributes
    ----------
    resume : bool
        Start from the last complete checkpoint (``resume=true``, or a restart).
    restarts : int
        Trainer restarts before this attempt.
    """

    resume: bool
    restarts: int = 0


def trainer_fault(exc: WorkerError) -> bool:
    """Whether a trainer rank died or failed (a restart from a checkpoint may help)."""
    return bool(exc.worker) and exc.worker.startswith("trainer")


def with_trainer_restarts(run: RunContext, attempt: Callable[[Attempt], dict]) -> dict:
    """Call ``attempt`` until it returns, again (resuming) after each trainer fault.

    Parameters
    ----------
    run : RunContext
        Its ``run_dir`` (prepared) receives ``FAILED`` on a failure that ends the run.
    attempt : callable (Attempt) -> dict
        Runs the job once; returns the summary.

    Raises
    ------
    WorkerError
        A fault of a rollout worker, or of the trainer with no restart left.
    BaseException
        Whatever else ``attempt`` raised (a ``KeyboardInterrupt`` writes no ``FAILED``).
    """
    current = Attempt(resume=run.cfg.resume)
    while True:
        try:
            return attempt(current)
        except WorkerError as exc:
            current = _next_attempt(run, current, exc)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            mark_failed(run.run_dir, exc)
            raise


def _next_attempt(run: RunContext, failed: Attempt, exc: WorkerError) -> Attempt:
    """The attempt after ``failed`` ended with ``exc``; writes ``FAILED`` and raises when no
    restart may follow."""
    most = run.cfg.recovery.max_trainer_restarts
    if not trainer_fault(exc):
        mark_failed(run.run_dir, exc)
        raise exc
    if failed.restarts >= most:
        failure = WorkerError(
            f"{str(exc).splitlines()[0]} (no trainer restart left: "
            f"recovery.max_trainer_restarts = {most})",
            exc.worker,
            exc.died,
        )
        mark_failed(run.run_dir, failure)
        raise failure from exc
    log.warning(
        "%s; restarting the job from its last checkpoint, if any (trainer "
        "restart %d of at most %d, recovery.max_trainer_restarts)",
        exc,
        failed.restarts + 1,
        most,
    )
    return Attempt(resume=True, restarts=failed.restarts + 1)
