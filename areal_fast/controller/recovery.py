"""Faults of a running controller: dead rollout workers and missed deadlines.

A rollout worker that dies is replaced (``restart_rollout``, at most
``recovery.max_rollout_restarts`` times). Its running groups wait in the ledger for a worker
(:meth:`Ledger.requeue`; the controller submits them again), its finished groups without a
spool file are dropped (:meth:`Ledger.lose_unspooled`); spooled ones stay and the trainer
reads them from disk. The new worker takes rollouts once it serves the weights current at
its restart (its warm-up); the seconds from the death to then are recorded. Group state
changes only through ledger transitions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from areal_fast.controller.checkpoint_manager import PendingSaves
from areal_fast.controller.config import RecoveryConfig, Timeouts
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger
from areal_fast.controller.step_evals import StepEvals
from areal_fast.controller.weight_tracker import WeightTracker
from areal_fast.wire.handles import WorkerError, WorkerHandle

DEADLINE_CHECK_SECONDS = 0.1  # deadlines are checked at most this often (O(workers) each)
log = logging.getLogger("areal_fast.controller")


@dataclass
class RecoveryScope:
    """What :class:`Recovery` reads of a running controller and what it may change.

    It changes ``ledger`` only through its transitions (requeue, lose_unspooled,
    note_restart, note_recovery, restore), ``fleet`` only by putting a restarted worker in
    the dead one's place (:meth:`RolloutFleet.replace`) and ``weights`` only by
    :meth:`WeightTracker.restarted`; ``evals`` and ``saves`` it only reads, for their
    deadlines. The policy version and the time of the last step are arguments of each call.
    """

    ledger: Ledger
    fleet: RolloutFleet
    weights: WeightTracker
    evals: StepEvals
    saves: PendingSaves
    trainer: str  # the trainer's (rank 0) name, for error messages


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: the checkpoint's policy version and the training seconds
    the run had taken until then."""

    version: int
    elapsed_seconds: float


class Recovery:
    """Restarts dead rollout workers, checks every worker's deadline, resumes from a checkpoint.

    Parameters
    ----------
    scope : RecoveryScope
        What it watches and may change.
    restart_rollout : callable (name) -> WorkerHandle, or None
        Replaces a dead rollout worker by a ready new one (None: a death fails the run).
    config : RecoveryConfig
        ``max_rollout_restarts`` is used.
    timeouts : Timeouts
    """

    def __init__(
        self,
        scope: RecoveryScope,
        restart_rollout: Optional[Callable[[str], WorkerHandle]],
        config: RecoveryConfig,
        timeouts: Timeouts,
    ):
        self.scope, self.restart_rollout, self.timeouts = scope, restart_rollout, timeouts
        self.max_restarts = config.max_rollout_restarts
        self.restarts_left = config.max_rollout_restarts  # in this attempt
        # restarted workers: (version to serve, death time, restart time)
        self.warming: dict[str, tuple[int, float, float]] = {}
        self._checked = 0.0  # time.monotonic() of the last deadline scan
        # name -> the version that worker is to serve (a reproducible run tells each worker
        # its next version only once its groups have finished); None: the policy version
        self.serving: Optional[Callable[[str], int]] = None

    def on_worker_error(self, exc: WorkerError, version: int) -> WorkerHandle:
        """Replace the dead rollout worker of ``exc`` if a restart is left; else re-raise.

        The new worker is in the fleet in the dead one's place; its running groups wait in
        the ledger for a worker, its finished ones stay (spooled) or are dropped; it takes
        rollouts once it serves ``version`` (the policy version now). What it must be sent
        to catch up (weights, a cancel, evaluations) is the caller's to send.

        Returns
        -------
        WorkerHandle
            The new worker.

        Raises
        ------
        WorkerError
            Not a dead rollout worker, no restart function, or no restart left (then the
            message names ``recovery.max_rollout_restarts``).
        """
        rollout_died = exc.died and exc.worker in self.scope.fleet.names
        if not rollout_died or self.restart_rollout is None:
            raise exc
        if self.restarts_left <= 0:
            raise WorkerError(
                f"{exc} (no restart left: recovery.max_rollout_restarts = {self.max_restarts})",
                exc.worker,
                True,
            ) from exc
        name, died_at = exc.worker, time.monotonic()
        new = self._restart(name, exc)
        scope = self.scope
        scope.fleet.replace(new, died_at)
        scope.ledger.requeue(name)
        scope.ledger.lose_unspooled(name)
        scope.weights.restarted(name)
        self.warming[name] = (version, died_at, time.monotonic())
        self.end_warm_up(name)
        return new

    def _restart(self, name: str, exc: WorkerError) -> WorkerHandle:
        """A ready new worker named ``name``, which died with ``exc`` (retried while restarts
        are left).

        Raises
        ------
        WorkerError
            The last restart left failed too.
        """
        while True:
            self.restarts_left -= 1
            self.scope.ledger.note_restart()
            log.warning(
                "%s; restarting it (%d restarts left after this one)", exc, self.restarts_left
            )
            try:
                return self.restart_rollout(name)
            except WorkerError as failed:
                if self.restarts_left <= 0:
                    raise
                exc = failed

    def end_warm_up(self, name: str) -> None:
        """A restarted worker takes rollouts once it serves the version current at its
        restart; the time since the death is recorded."""
        acked = self.scope.weights.acked[name]
        if name in self.warming and acked >= self.warming[name][0]:
            seconds = time.monotonic() - self.warming.pop(name)[1]
            self.scope.ledger.note_recovery(seconds)
            log.warning(
                "rollout worker %r is back, serving weights version %d, %.1f s after its death",
                name,
                acked,
                seconds,
            )

    def check_step_time(self, version: int, last_step: float, now: float) -> None:
        """Raise a :class:`WorkerError` naming the trainer when its oldest step in training
        has taken longer than ``timeouts.train_step`` by ``now`` (``time.monotonic()``),
        counted from its request or ``last_step``, whichever is later.

        Called by :meth:`check_deadlines` and once more when the step's reply arrives, so a
        step that ends between two deadline scans is still held to its deadline.
        """
        training, limit = self.scope.ledger.training, self.timeouts.train_step
        if training and now - max(training[0].sent_at, last_step) > limit:
            raise WorkerError(
                f"trainer {self.scope.trainer!r} did not finish step "
                f"{version + 1} within timeouts.train_step = {limit:g} s",
                self.scope.trainer,
            )

    def check_deadlines(self, version: int, last_step: float) -> None:
        """Raise a :class:`WorkerError` naming the first worker past its deadline: the
        trainer's step or save (``train_step``), a weight update (``weight_update``; counted
        from the end of a worker's evaluation during training if later, as newer weights wait
        for it), an evaluation during training (``evaluate``), a rollout worker with running
        groups that finishes none (``rollout_stall``).

        Parameters
        ----------
        version : int
            The policy version the rollout workers should serve.
        last_step : float
            ``time.monotonic()`` when the last step finished (or the run started).
        """
        s, t, now = self.scope, self.timeouts, time.monotonic()
        if now - self._checked < DEADLINE_CHECK_SECONDS:
            return
        self._checked = now
        self.check_step_time(version, last_step, now)
        late = [
            name
            for name in s.fleet.names
            if s.weights.acked[name] < (self.serving(name) if self.serving else version)
            and name not in self.warming
            and not s.evals.excused(name, now, t.weight_update)
        ]
        s.evals.check_deadline(now)
        warming = [
            name
            for name, (_, _, started) in self.warming.items()
            if now - started > t.weight_update
        ]
        if warming:
            raise WorkerError(
                f"restarted rollout worker {warming[0]!r} did not load weights "
                f"within timeouts.weight_update = {t.weight_update:g} s",
                warming[0],
            )
        if late and now - last_step > t.weight_update:
            raise WorkerError(
                f"rollout worker {late[0]!r} did not load weights version "
                f"{version} within timeouts.weight_update = "
                f"{t.weight_update:g} s"
            )
        slow = s.saves.slow(now, t.train_step)
        if slow:
            raise WorkerError(
                f"trainer {s.trainer!r} did not save its state into "
                f"{slow} within timeouts.train_step = {t.train_step:g} s",
                s.trainer,
            )
        stalled = [
            name
            for name in s.fleet.names
            if s.ledger.running_on(name) > 0 and now - s.fleet.progress[name] > t.rollout_stall
        ]
        if stalled:
            raise WorkerError(
                f"rollout worker {stalled[0]!r} finished no rollout within "
                f"timeouts.rollout_stall = {t.rollout_stall:g} s "
                f"({s.ledger.running_on(stalled[0])} running)"
            )

    def resume(self, state: dict) -> ResumePoint:
        """Continue from a checkpoint's controller state (``controller.json``): the ledger
        takes its counts (the groups that were pending then are counted as dropped); returns
        the version and elapsed seconds to continue from (every rollout worker is to load
        that version's weights)."""
        self.scope.ledger.restore(state["counts"], int(state["pending_groups"]))
        return ResumePoint(int(state["version"]), float(state["elapsed_seconds"]))
