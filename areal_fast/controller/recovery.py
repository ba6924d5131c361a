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
from typing import TYPE_CHECKING, Callable, Optional

from areal_fast.controller.config import RecoveryConfig, Timeouts
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError, WorkerHandle

if TYPE_CHECKING:
    from areal_fast.controller.async_loop import AsyncController

DEADLINE_CHECK_SECONDS = 0.1  # deadlines are checked at most this often (O(workers) each)
log = logging.getLogger("areal_fast.controller")


class Recovery:
    """Restarts dead rollout workers, checks every worker's deadline, resumes from a checkpoint.

    Parameters
    ----------
    controller : AsyncController
        Whose workers, weights and ledger this recovers.
    restart_rollout : callable (name) -> WorkerHandle, or None
        Replaces a dead rollout worker by a ready new one (None: a death fails the run).
    config : RecoveryConfig
        ``max_rollout_restarts`` is used.
    timeouts : Timeouts
    """

    def __init__(
        self,
        controller: "AsyncController",
        restart_rollout: Optional[Callable[[str], WorkerHandle]],
        config: RecoveryConfig,
        timeouts: Timeouts,
    ):
        self.c, self.restart_rollout, self.timeouts = controller, restart_rollout, timeouts
        self.max_restarts = config.max_rollout_restarts
        self.restarts_left = config.max_rollout_restarts  # in this attempt
        # restarted workers: (version to serve, death time, restart time)
        self.warming: dict[str, tuple[int, float, float]] = {}
        self._checked = 0.0  # time.monotonic() of the last deadline scan

    def on_worker_error(self, exc: WorkerError) -> None:
        """Replace the dead rollout worker of ``exc`` if a restart is left; else re-raise.

        Raises
        ------
        WorkerError
            Not a dead rollout worker, no restart function, or no restart left (then the
            message names ``recovery.max_rollout_restarts``).
        """
        rollout_died = exc.died and any(w.name == exc.worker for w in self.c.workers)
        if not rollout_died or self.restart_rollout is None:
            raise exc
        if self.restarts_left <= 0:
            raise WorkerError(
                f"{exc} (no restart left: recovery.max_rollout_restarts = {self.max_restarts})",
                exc.worker,
                True,
            ) from exc
        self._replace(exc)

    def _replace(self, exc: WorkerError) -> None:
        """Start a new worker in place of the dead one (retried while restarts are left);
        its running groups start again, its finished ones stay (spooled) or are dropped."""
        c, name, died_at = self.c, exc.worker, time.monotonic()
        while True:
            self.restarts_left -= 1
            c.ledger.note_restart()
            log.warning(
                "%s; restarting it (%d restarts left after this one)", exc, self.restarts_left
            )
            try:
                new = self.restart_rollout(name)
                break
            except WorkerError as failed:
                if self.restarts_left <= 0:
                    raise
                exc = failed
        c.replace_worker(new)
        c.ledger.requeue(name)
        c.ledger.lose_unspooled(name)
        c.progress[name], c.acked[name] = died_at, 0
        # slot version % 2 is being overwritten while version + 2 trains: then the new worker
        # gets the next version with everyone else
        if c.version > 0 and len(c.ledger.training) < 2:
            c.send_rollout(new, msg.UpdateWeights(c.version, c.buffers[c.version % 2]))
        self.warming[name] = (c.version, died_at, time.monotonic())
        self.end_warm_up(name)
        if c.ledger.closing:
            c.send_rollout(new, msg.CancelAll())
        if name in c.eval_assignment and name not in c.eval_records:
            c.send_rollout(new, msg.Evaluate(c.eval_assignment[name]))
        c.evals.resend(c, new)

    def end_warm_up(self, name: str) -> None:
        """A restarted worker takes rollouts once it serves the version current at its
        restart; the time since the death is recorded."""
        acked = self.c.acked[name]
        if name in self.warming and acked >= self.warming[name][0]:
            seconds = time.monotonic() - self.warming.pop(name)[1]
            self.c.ledger.note_recovery(seconds)
            log.warning(
                "rollout worker %r is back, serving weights version %d, %.1f s after its death",
                name,
                acked,
                seconds,
            )

    def check_deadlines(self) -> None:
        """Raise a :class:`WorkerError` naming the first worker past its deadline: the
        trainer's step or save (``train_step``), a weight update (``weight_update``; counted
        from the end of a worker's evaluation during training if later, as newer weights wait
        for it), an evaluation during training (``evaluate``), a rollout worker with running
        groups that finishes none (``rollout_stall``)."""
        c, t, now = self.c, self.timeouts, time.monotonic()
        if now - self._checked < DEADLINE_CHECK_SECONDS:
            return
        self._checked = now
        training = c.ledger.training
        if training and now - max(training[0].sent_at, c.last_step) > t.train_step:
            raise WorkerError(
                f"trainer {c.trainer.name!r} did not finish step "
                f"{c.version + 1} within timeouts.train_step = {t.train_step:g} s",
                c.trainer.name,
            )
        late = [
            w.name
            for w in c.workers
            if c.acked[w.name] < c.version
            and w.name not in self.warming
            and not c.evals.excused(w.name, now, t.weight_update)
        ]
        c.evals.check_deadline(now)
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
        if late and now - c.last_step > t.weight_update:
            raise WorkerError(
                f"rollout worker {late[0]!r} did not load weights version "
                f"{c.version} within timeouts.weight_update = "
                f"{t.weight_update:g} s"
            )
        slow = c.saves.slow(now, t.train_step)
        if slow:
            raise WorkerError(
                f"trainer {c.trainer.name!r} did not save its state into "
                f"{slow} within timeouts.train_step = {t.train_step:g} s",
                c.trainer.name,
            )
        stalled = [
            w.name
            for w in c.workers
            if c.ledger.running_on(w.name) > 0 and now - c.progress[w.name] > t.rollout_stall
        ]
        if stalled:
            raise WorkerError(
                f"rollout worker {stalled[0]!r} finished no rollout within "
                f"timeouts.rollout_stall = {t.rollout_stall:g} s "
                f"({c.ledger.running_on(stalled[0])} running)"
            )

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint's controller state (``controller.json``): counts and
        version (the groups that were pending then are counted as dropped); every rollout
        worker loads that version's weights."""
        c = self.c
        c.version = int(state["version"])
        c.ledger.restore(state["counts"], int(state["pending_groups"]))
        c.elapsed_before = float(state["elapsed_seconds"])
        for worker in c.workers:
            c.acked[worker.name] = 0
            c.send_rollout(worker, msg.UpdateWeights(c.version, c.buffers[c.version % 2]))
