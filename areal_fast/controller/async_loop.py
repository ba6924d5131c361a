"""The asynchronous RL controller: rollout and training run at the same time, bounded by
staleness (AReaL, Fu et al. 2025). η = max_head_offpolicyness = 0 is synchronous RL through
the same code path.

The controller holds no tensors. Every prompt group is a record of its
:class:`~areal_fast.controller.ledger.Ledger`. The loop requests rollouts as the
:class:`~areal_fast.controller.staleness.StalenessManager` allows, hands every batch_size
finished groups (in acceptance order) to the trainer as a
:class:`~areal_fast.wire.shards.DistributedBatch`, and after each step tells every
rollout worker to load the new weights (they interrupt and resume their running samples).

Faults (:mod:`~areal_fast.controller.recovery`): a rollout worker that dies is restarted and
its running groups are resubmitted; groups it had finished are read by the trainer from their
spool files. A trainer rank that dies ends :meth:`AsyncController.run` with a
:class:`WorkerError` (the launcher resumes from the last checkpoint). Checkpoints are taken
between steps without stopping rollout.

With ``rollout.reproducible`` the batches, the versions they are generated under and the
workers follow a fixed plan instead (:mod:`~areal_fast.controller.fixed_schedule`, sent by
:mod:`~areal_fast.controller.fixed_dispatch`), and checkpoints keep the rollouts of the
batches they will train (:mod:`~areal_fast.controller.held_rollouts`).
"""

from __future__ import annotations

import heapq
import logging
import time
from pathlib import Path
from typing import Callable, Optional

from areal_fast._signals import signals_held
from areal_fast.controller.acceptance import Acceptance
from areal_fast.controller.checkpoint_manager import CheckpointManager, PendingSaves
from areal_fast.controller.config import RecoveryConfig, RunPlan, Timeouts
from areal_fast.controller.drain import Drain
from areal_fast.controller.fixed_dispatch import FixedDispatch
from areal_fast.controller.fixed_schedule import FixedSchedule
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.held_rollouts import HeldRollouts, restore_groups
from areal_fast.controller.ledger import Ledger, RunCounts
from areal_fast.controller.recovery import Recovery, RecoveryScope
from areal_fast.controller.staleness import StalenessManager
from areal_fast.controller.step_evals import StepEvals
from areal_fast.controller.step_record import step_record
from areal_fast.controller.weight_tracker import WeightTracker
from areal_fast.rollout.config import RolloutConfig
from areal_fast.wire import messages as msg
from areal_fast.wire.codec import Encoded, encode_message
from areal_fast.wire.handles import MessageWaiter, WorkerError, WorkerHandle
from areal_fast.wire.shards import DistributedBatch

TRAIN_PIPELINE = 2  # batches handed to the trainer ahead of completion (prefetch depth)
log = logging.getLogger("areal_fast.controller")


class AsyncController:
    """Drives rollout workers and one trainer worker; see the module docstring.

    Parameters
    ----------
    rollout_workers : list[WorkerHandle]
        Started rollout workers (their :class:`WorkerReady` already received).
    trainer : WorkerHandle
        Started trainer worker.
    weight_buffers : tuple[WeightBufferSpec, ...]
        The trainer's weight slots, n of them (version v is published into slot v % n).
    next_request : callable (group_id) -> GroupRequest
        Supplies the next prompt group to sample.
    plan : RunPlan
    rollout : RolloutConfig
        ``max_head_offpolicyness`` (η), ``max_concurrent_rollouts`` (None: (η + 1) · B),
        ``dynamic_filter``, ``drop_stale`` and ``reproducible`` are used.
    on_step : callable (dict) -> None
        Receives each step's metrics record (keys: :data:`~.step_record.STEP_METRICS`).
    timeouts : Timeouts, optional
    recovery : RecoveryConfig, optional
        ``max_rollout_restarts`` (used when ``restart_rollout`` is given).
    trainer_ranks : list[WorkerHandle], optional
        Every trainer rank, ``trainer`` (rank 0) first; each gets the trainer messages.
    restart_rollout : callable (name) -> WorkerHandle, optional
        Replaces a dead rollout worker by a ready new one (None: a death fails the run).
    checkpoints : CheckpointManager, optional
        When and where to save recoverable checkpoints (None: never).
    resume : dict, optional
        ``controller.json`` of the checkpoint this run resumes from; the trainer must have
        loaded its trainer state (its version is the checkpoint's).
    step_evals : StepEvals, optional
        Held-out evaluations during training (``eval.every_steps``; None: none).

    Raises
    ------
    ValueError
        ``rollout.reproducible`` with fewer than η + 1 weight slots.
    """

    def __init__(
        self,
        rollout_workers: list[WorkerHandle],
        trainer: WorkerHandle,
        weight_buffers,
        next_request: Callable[[int], msg.GroupRequest],
        plan: RunPlan,
        rollout: RolloutConfig,
        on_step: Callable[[dict], None],
        timeouts: Optional[Timeouts] = None,
        recovery: Optional[RecoveryConfig] = None,
        trainer_ranks: Optional[list[WorkerHandle]] = None,
        restart_rollout: Optional[Callable[[str], WorkerHandle]] = None,
        checkpoints: Optional[CheckpointManager] = None,
        resume: Optional[dict] = None,
        step_evals: Optional[StepEvals] = None,
    ):
        self.fleet = RolloutFleet(rollout_workers)
        self.trainer, self.buffers = trainer, weight_buffers
        self.trainer_ranks = trainer_ranks or [trainer]
        self.next_request, self.plan = next_request, plan
        self.rollout, self.on_step, self.evals = rollout, on_step, step_evals or StepEvals()
        eta = rollout.max_head_offpolicyness
        self.staleness = StalenessManager(
            plan.batch_size, eta, rollout.max_concurrent_rollouts or (eta + 1) * plan.batch_size
        )
        # rollout.reproducible: a fixed plan, every token's staleness min(k, η) by construction
        fixed = rollout.reproducible
        self.ledger = Ledger(eta if rollout.drop_stale and not fixed else None, ordered=not fixed)
        self.timeouts = timeouts or Timeouts()
        schedule = None
        if fixed and len(weight_buffers) < rollout.weight_slots:  # a replaced worker: its version
            raise ValueError(
                f"rollout.reproducible at rollout.max_head_offpolicyness = {eta} needs "
                f"{rollout.weight_slots} trainer weight slots, the trainer has "
                f"{len(weight_buffers)}"
            )
        if fixed:
            schedule = FixedSchedule(plan.batch_size, eta, len(rollout_workers), plan.total_steps)
        self.saves = PendingSaves(checkpoints, HeldRollouts(schedule) if fixed else None)
        self.dropped_done: dict[int, msg.GroupDone] = {}  # reproducible: dropped groups
        self.weights = WeightTracker(self.fleet.names)  # the weights version each serves
        watched = RecoveryScope(
            self.ledger, self.fleet, self.weights, self.evals, self.saves, trainer.name
        )
        self.recovery = Recovery(
            watched, restart_rollout, recovery or RecoveryConfig(), self.timeouts
        )
        self.drain = Drain(self.ledger, self.fleet, self._pump, self.timeouts)
        self.version = 0
        self.agent_stats: dict[str, dict] = {}  # per worker: its agent running totals
        self.acceptance = Acceptance.from_plan(rollout.dynamic_filter, plan)
        self.start = self.last_step = time.monotonic()
        self.trained_tokens = 0
        self.elapsed_before = 0.0  # training seconds of the run before a resume
        self._waiter: Optional[MessageWaiter] = None  # over every worker; rebuilt on change
        if resume is not None:
            point = self.recovery.resume(resume)
            self.version, self.elapsed_before = point.version, point.elapsed_seconds
            for worker in self.fleet.workers:
                self.fleet.send(worker, self._current_weights())
        self.dispatch: Optional[FixedDispatch] = None  # rollout.reproducible only
        if fixed:
            if resume is not None:  # the rollouts of batches version … version + η − 1
                self._restore_held(resume, schedule)
            self.dispatch = FixedDispatch(
                schedule, self.fleet, self.ledger, next_request, weight_buffers, self.version
            )
            self.recovery.serving = self.dispatch.serving

    @property
    def workers(self) -> list[WorkerHandle]:
        """The rollout workers now (a restarted one in the place of the dead one)."""
        return self.fleet.workers

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> RunCounts:
        """Train ``total_steps`` steps (fewer if ``max_seconds`` runs out first: no batch is
        sent after that, batches in flight finish); returns the rollout accounting.

        Raises
        ------
        WorkerError
            A worker died, failed or missed its deadline (the message names it).
        ValueError
            ``dynamic_filter`` dropped ``max_filtered_in_a_row`` groups in a row.
        """
        self.start = self.last_step = time.monotonic()
        self.fleet.restart_clocks(self.start)
        if self.dispatch is not None:
            self.dispatch.start()
        while self.version < self.plan.total_steps and not (
            self._out_of_time() and not self.ledger.training
        ):
            with signals_held():  # a Ctrl-C or SIGTERM stops the run between two rounds
                self._request_rollouts()  # as many as the staleness bound allows
                self._send_batches()  # to the trainer, while a batch is ready
                # finished groups; finished steps (→ publish weights, record, checkpoint)
                self.handle(
                    self.wait(1.0, f"at policy version {self.version} (step {self.version + 1})")
                )
                self.recovery.check_deadlines(self.version, self.last_step)
        self.drain.wind_down(self.version, self.weights.acked, self.evals, self.saves)
        return self.ledger.counts

    def _request_rollouts(self) -> None:
        """Start as many new groups as the staleness bound allows (and resubmit those of a
        dead worker), each on the least busy ready worker (a reproducible run's
        :class:`FixedDispatch` sends its groups itself)."""
        if self._out_of_time() or self.dispatch is not None:
            return
        ledger, b = self.ledger, self.plan.batch_size
        still_needed = self.plan.total_steps * b - (ledger.accepted + ledger.running)
        allowed = self.staleness.capacity_for(self.version, ledger.accepted, ledger.running)
        capacity = max(0, min(allowed, still_needed))
        waiting = ledger.waiting()
        if capacity == 0 and not waiting:
            return
        ready = [w for w in self.fleet.workers if w.name not in self.recovery.warming]
        if not ready:
            return
        # (in flight, index, worker), least busy first, ties to the earlier worker: the
        # choice of min(ready, key=in_flight) per group at O(log workers) instead of O(workers)
        loads = [(ledger.running_on(w.name), i, w) for i, w in enumerate(ready)]
        heapq.heapify(loads)
        per_worker: dict[str, list[msg.GroupRequest]] = {}
        for record in waiting:  # running groups of a dead worker, already counted as running
            name = self._least_busy(loads)
            ledger.assign(record.group_id, name, self.version)
            per_worker.setdefault(name, []).append(record.request)
        for _ in range(capacity):
            request, name = self.next_request(ledger.counts.submitted), self._least_busy(loads)
            ledger.submit(request, name, self.version)
            per_worker.setdefault(name, []).append(request)
        for worker in ready:
            if worker.name in per_worker:
                self.fleet.send(worker, msg.SubmitGroups(per_worker[worker.name]))

    def _least_busy(self, loads: list) -> str:
        """Pop the least busy worker of the heap ``loads`` and count one more group on it."""
        n, i, worker = heapq.heappop(loads)
        if n == 0:
            self.fleet.progressed(worker.name, time.monotonic())
        heapq.heappush(loads, (n + 1, i, worker))
        return worker.name

    def _send_batches(self) -> None:
        """Send batches of ready groups to the trainer (at most TRAIN_PIPELINE in training,
        none past ``total_steps`` or ``max_seconds``)."""
        while (
            len(self.ledger.training) < TRAIN_PIPELINE
            and self.ledger.num_ready >= self.plan.batch_size
            and not self._out_of_time()
        ):
            new_version = self.version + len(self.ledger.training) + 1
            if new_version > self.plan.total_steps:
                return
            # its slot last held new_version - n: every worker must have loaded that already
            slots = len(self.buffers)
            if min(self.weights.acked.values(), default=self.version) < new_version - slots:
                return
            batch = self._take_batch(new_version - 1)
            self.free_released()
            if batch is None:
                return
            self._send_trainer(
                msg.TrainStep(
                    DistributedBatch([g.done.shard for g in batch.groups]), slot=new_version % slots
                )
            )

    def _take_batch(self, k: int):
        """Batch ``k`` (trained into version k + 1): the first B ready groups, or in a
        reproducible run the schedule's groups of batch k once all have finished (None until
        then).

        Raises
        ------
        WorkerError
            Every group of a reproducible run's batch was dropped (nothing to train).
        """
        if self.dispatch is None:
            return self.ledger.take_batch(self.plan.batch_size, k, time.monotonic())
        kept = self.dispatch.batch(k)
        if kept is None:
            return None
        if not kept:
            raise WorkerError(
                f"every prompt group of batch {k} was dropped (rollouts_dropped: "
                f"{dict(self.ledger.counts.dropped)}): step {k + 1} has nothing to train"
            )
        return self.ledger.take_groups(kept, k, time.monotonic())

    def _on_step_done(self, done: msg.StepDone) -> None:
        """A step is done: publish its weights, evaluate them if due, record, checkpoint."""
        training = self.ledger.training
        if not training or done.group_ids != training[0].group_ids:
            raise WorkerError(
                f"trainer {self.trainer.name!r} reported a step for groups "
                f"{done.group_ids[:4]}... that were not sent to it"
            )
        if done.version != self.version + 1:
            raise WorkerError(
                f"trainer {self.trainer.name!r} reported version {done.version} "
                f"after version {self.version}"
            )
        # a step that ended between two deadline scans is held to its deadline too
        self.recovery.check_step_time(self.version, self.last_step, time.monotonic())
        batch = self.ledger.trained(done.group_ids)
        self.version = done.version
        self.weights.published(done)
        if self.dispatch is not None:  # each worker once its groups have finished
            self.dispatch.advance_all(self.version)
        else:
            update = Encoded(encode_message(self._current_weights()))
            for worker in self.fleet.workers:  # encoded once for all
                self.fleet.send(worker, update)
        # the trained groups' spool files are deleted only now that the step is done
        if batch.groups[0].done.shard.path:
            self.fleet.drop_shards(g.done for g in batch.groups)
        now = time.monotonic()
        self.trained_tokens += done.trained_tokens
        record = step_record(
            batch,
            done,
            self.ledger,
            trained_tokens=self.trained_tokens,
            since_start=now - self.start,
            since_last_step=now - self.last_step,
            trainer_wait=max(0.0, batch.sent_at - self.last_step),
            elapsed=now - self.start + self.elapsed_before,
            agent_stats=self.agent_stats,
        )
        # sent after the update: on version v
        record = self.evals.after_step(self.version, record, self.fleet)
        self.last_step = now
        self.on_step(record)
        tmp = self.saves.after_step(self.version, self._snapshot(record), self._finished())
        if tmp is not None:
            self._send_trainer(msg.SaveState(tmp))

    def _snapshot(self, record: dict) -> dict:
        """What a run resumed from this step needs (``controller.json``): a reproducible
        run's counts say every group of the batches its checkpoint keeps was submitted, and
        no group is pending (they are kept, not dropped)."""
        counts = self.ledger.counts.as_dict()
        pending = self.ledger.live
        if self.dispatch is not None:
            held = self.saves.held.needed(self.version)
            counts["rollouts_submitted"] = self.plan.batch_size * self.version + len(held)
            pending = 0
        return {
            "version": self.version,
            "counts": counts,
            "pending_groups": pending,
            "elapsed_seconds": record["elapsed_seconds"],
        }

    def _finished(self) -> list[msg.GroupDone]:
        """A reproducible run's finished groups not trained yet (ready, in training or
        dropped): those a checkpoint taken now may keep."""
        if self.dispatch is None:
            return []
        live = [self.ledger.record(g) for g in self.ledger.ready_ids()]
        live += [r for b in self.ledger.training for r in b.groups]
        first = self.version * self.plan.batch_size  # older groups are trained or given up
        self.dropped_done = {g: d for g, d in self.dropped_done.items() if g >= first}
        return [r.done for r in live] + list(self.dropped_done.values())

    def _restore_held(self, resume: dict, schedule: FixedSchedule) -> None:
        """Make the groups a reproducible run's checkpoint kept READY again (dropped ones
        stay dropped)."""
        restored = restore_groups(Path(resume["checkpoint"]), Path(resume["restore_dir"]))
        for done in restored:
            if done.shard is not None and not done.drop_reason:
                self.ledger.restore_ready(
                    done, schedule.version_of(schedule.batch_of(done.group_id))
                )

    # ---- messages -------------------------------------------------------------------
    def wait(self, timeout: float, doing: str) -> list:
        """Messages from every worker (:class:`MessageWaiter`); a dead rollout worker is
        replaced (and nothing returned this time) while restarts are left."""
        try:
            if self._waiter is None:
                self._waiter = MessageWaiter([*self.fleet.workers, *self.trainer_ranks])
            return self._waiter.wait(timeout, doing)
        except WorkerError as exc:
            serving = self.dispatch.serving(exc.worker) if self._fixed(exc.worker) else self.version
            new = self.recovery.on_worker_error(exc, serving)  # or raises
            if self._waiter is not None:  # its handles include the dead one
                self._waiter.close()
                self._waiter = None
            self._catch_up(new)
            return []

    def _catch_up(self, new: WorkerHandle) -> None:
        """Tell a restarted rollout worker what the dead one had been told: the current
        weights, the cancel of a wind-down, its share of every unanswered evaluation."""
        # slot version % 2 is being overwritten while version + 2 trains: then the new worker
        # gets the next version with everyone else
        if self.dispatch is not None:  # the version of its groups, and its groups
            newest = self.version + len(self.ledger.training)
            self.dispatch.restarted(new, self.version, newest)
        elif self.version > 0 and len(self.ledger.training) < 2:
            self.fleet.send(new, self._current_weights())
        if self.ledger.closing:
            self.fleet.send(new, msg.CancelAll())
        for evaluate in [*self.drain.owed(new.name), *self.evals.owed(new.name)]:
            self.fleet.send(new, evaluate)

    def _pump(self, doing: str) -> None:
        """One round of message handling while draining: check the deadlines, then wait up
        to 1 s for messages and act on each."""
        self.recovery.check_deadlines(self.version, self.last_step)
        self.handle(self.wait(1.0, doing))

    def handle(self, messages: list) -> None:
        """Act on each ``(worker, message)``; then free the shards of dropped groups."""
        for worker, message in messages:
            self._on_message(worker, message)
        self.free_released()

    def _on_message(self, worker: WorkerHandle, message) -> None:
        if isinstance(message, msg.GroupDone):
            if self.dispatch is not None and self.dispatch.is_replay(worker.name, message.group_id):
                self._on_replayed_group(worker, message)
            elif self.ledger.is_running(message.group_id):
                self._on_group_done(worker, message)
            else:
                self._on_unknown_group(worker, message)
        elif isinstance(message, msg.StepDone):
            self._on_step_done(message)
        elif isinstance(message, msg.WeightsUpdated):
            self.weights.acknowledged(worker.name, message)
            self.ledger.counts.update_seconds.append(message.seconds)
            self.recovery.end_warm_up(worker.name)
        elif isinstance(message, msg.StateSaved):
            if self.saves.commit(message.path, message.version) is None:
                raise WorkerError(
                    f"trainer {self.trainer.name!r} saved state into "
                    f"{message.path}, which was not asked for",
                    self.trainer.name,
                )
        elif isinstance(message, msg.Cancelled):
            self.ledger.cancelled(worker.name)
            self.fleet.cancelled(worker.name)
        elif isinstance(message, msg.EvalDone) and message.version is None:
            self.drain.answered(worker.name, message.records)
        elif isinstance(message, msg.EvalDone):
            self.evals.on_eval_done(worker.name, message)
        else:
            raise WorkerError(f"worker {worker.name!r} sent an unexpected {type(message).__name__}")

    def _on_group_done(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
        """A running group finished: ready, or dropped (dynamic filter, too stale, every
        agent session dropped); too many such drops in a row end the run."""
        if self.ledger.closing:  # finished before the cancel: not needed
            self.ledger.finish(done)
            return
        self.fleet.progressed(worker.name, time.monotonic())
        if done.agent_stats:
            self.agent_stats[worker.name] = done.agent_stats
        # the version that will train it: batches are formed from the ready groups in order
        train_version = (
            self.version + len(self.ledger.training) + self.ledger.num_ready // self.plan.batch_size
        )
        # a too-stale group is dropped now, so that a replacement starts at once
        stale = self.ledger.too_stale(done.group_id, train_version)
        reason = self.acceptance.drop_reason(done, stale)
        self.ledger.finish(done, reason)
        self.acceptance.check_filter_limit()
        if self.dispatch is not None:  # its next version and groups, once all have finished
            if reason is not None:
                self.dropped_done[done.group_id] = done
            self.saves.kept(done)  # into the checkpoints waiting for it
            self.dispatch.advance(worker, self.version)

    def _on_replayed_group(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
        """A restarted worker redid a group that had finished before (its chunk is redone
        whole): the report is ignored; the shard is dropped unless the group is still live
        (then its spool file was rewritten with the same bytes)."""
        if done.shard is not None and self.ledger.state(done.group_id) is None:
            self.fleet.send(worker, msg.DropShards([done.group_id]))
        self.dispatch.advance(worker, self.version)

    def _on_unknown_group(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
        """A group that is not running (it was cancelled at the end of training, or reported
        twice): free its shard unless the group is live, and change no counts."""
        log.warning(
            "rollout worker %r reported group %d, which is not running (cancelled "
            "before it finished?); it is ignored",
            worker.name,
            done.group_id,
        )
        if done.shard is not None and self.ledger.state(done.group_id) is None:
            self.fleet.send(worker, msg.DropShards([done.group_id]))

    def _send_trainer(self, message) -> None:
        """Send ``message`` to every trainer rank (rank 0 answers)."""
        for rank in self.trainer_ranks:
            rank.send(message)

    def free_released(self) -> None:
        """Tell the workers to delete the shards of the groups the ledger dropped."""
        self.fleet.drop_shards(r.done for r in self.ledger.pop_released())

    def _current_weights(self) -> msg.UpdateWeights:
        """The update to the current policy version (in slot ``version % n``)."""
        return msg.UpdateWeights(self.version, self.buffers[self.version % len(self.buffers)])

    def _fixed(self, name: Optional[str]) -> bool:
        """Whether ``name`` is a rollout worker of a reproducible run's dispatch."""
        return self.dispatch is not None and name in self.dispatch.told

    def _out_of_time(self) -> bool:
        return (
            self.plan.max_seconds is not None
            and time.monotonic() - self.start + self.elapsed_before > self.plan.max_seconds
        )

    def evaluate(self, requests: list[msg.GroupRequest]) -> list[dict]:
        """Run evaluation groups (greedy, n=1) spread over the rollout workers; returns one
        record per request (uid, answer, completion, correct, reward), in request order.

        Raises
        ------
        WorkerError
            A worker died or did not finish within ``timeouts.evaluate``.
        RuntimeError
            Called while :meth:`run` has groups running or in training.
        """
        return self.drain.evaluate(requests)
