"""The asynchronous RL controller: rollout and training run at the same time, bounded by
staleness (AReaL, Fu et al. 2025). η = max_head_offpolicyness = 0 is synchronous RL through
the same code path.

The controller holds no tensors. It starts rollouts on the rollout workers as the
:class:`~areal_fast.controller.staleness.StalenessManager` allows, collects finished groups
as shard metadata, hands every batch_size accepted groups (in acceptance order) to the trainer
as a :class:`~areal_fast.controller.shards.DistributedBatch`, and after each step tells every
rollout worker to load the new weights (they interrupt and resume their running samples).

Faults: a rollout worker that dies is restarted (``restart_rollout``, at most
``max_rollout_restarts`` times), loads the current weights, and its running groups are
resubmitted (to it or to the others); groups it had finished are read by the trainer from
their spool files, so no accepted rollout is lost. A trainer rank that dies ends
:meth:`AsyncController.run` with a :class:`WorkerError` (the launcher resumes from the last
checkpoint). Checkpoints (``checkpoints``) are taken between steps without stopping rollout.
"""

from __future__ import annotations

import collections
import heapq
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from areal_fast.controller import messages as msg
from areal_fast.controller.shards import DistributedBatch
from areal_fast.controller.codec import Encoded, encode_message
from areal_fast.controller.config import Timeouts
from areal_fast.controller.staleness import StalenessManager
from areal_fast.controller.workers import MessageWaiter, WorkerError, WorkerHandle

TRAIN_PIPELINE = 2  # batches handed to the trainer ahead of completion (prefetch depth)
DEADLINE_CHECK_SECONDS = 0.1  # deadlines are checked at most this often (O(workers) each)
log = logging.getLogger("areal_fast.controller")


@dataclass
class ControllerSettings:
    """What the controller itself needs (components carry the rest).

    Attributes
    ----------
    total_steps : int
    batch_size : int
        B, prompt groups per training step.
    max_head_offpolicyness : int
        η of the staleness bound (0 = synchronous).
    max_concurrent_rollouts : int
        Prompt groups in flight at most, over all rollout workers.
    dynamic_filter : bool
        Drop groups whose rewards are all equal (DAPO dynamic sampling, Yu et al. 2025) and
        keep sampling until the batch is full.
    timeouts : Timeouts
    max_filtered_in_a_row : int
        With ``dynamic_filter``, this many groups dropped in a row (all rewards equal) end
        the run with a ValueError instead of sampling forever.
    drop_stale : bool
        Drop (count as "stale") groups that would be trained more than η versions after
        they started, so every token's staleness is ≤ η. Slow groups are the long ones, so
        this shortens the mean trained completion; ``RunCounts.stale_dropped_tokens`` says how
        much was dropped. False keeps them (AReaL's behaviour): staleness may then exceed η.
    """

    total_steps: int
    batch_size: int
    max_head_offpolicyness: int
    max_concurrent_rollouts: int
    dynamic_filter: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_filtered_in_a_row: int = 1000  # groups dropped by the filter in a row before failing
    drop_stale: bool = True  # drop groups that would be trained more than η versions late
    max_seconds: Optional[float] = None  # stop sending batches after this much training time
    max_failed_agent_groups_in_a_row: int = 32  # agent groups with every session dropped
    max_rollout_restarts: int = 0  # dead rollout workers replaced before the run fails


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

    def as_dict(self) -> dict:
        """The counts as plain JSON-able values (for summary.json)."""
        return {"rollouts_submitted": self.submitted, "rollouts_trained": self.trained,
                "rollouts_dropped": dict(self.dropped),
                "sample_interruptions": self.interruptions,
                "stale_dropped_completion_tokens": self.stale_dropped_tokens,
                "rollouts_resubmitted": self.resubmitted,
                "rollout_worker_restarts": self.rollout_restarts,
                "rollout_recovery_seconds": list(self.recovery_seconds)}

    @classmethod
    def from_dict(cls, data: dict) -> "RunCounts":
        """Inverse of :meth:`as_dict` (a resumed run continues the counts)."""
        return cls(data["rollouts_submitted"], data["rollouts_trained"],
                   collections.Counter(data["rollouts_dropped"]), data["sample_interruptions"],
                   data["stale_dropped_completion_tokens"], data.get("rollouts_resubmitted", 0),
                   data.get("rollout_worker_restarts", 0),
                   list(data.get("rollout_recovery_seconds", [])))


def _drop_hint(error: str) -> str:
    """What to check for an agent drop reason (the start of ``error``)."""
    hints = {"timeout": "check agent.timeout (and that the agent does not block the event loop)",
             "bad_reward": "run_agent_return_reward must return a finite number",
             "no_calls": "the agent must call the model through its client",
             "agent_error": "the agent raised: its log lines name the error"}
    return hints.get(error.split(":", 1)[0], "check agent.path")


class AsyncController:
    """Drives rollout workers and one trainer worker; see the module docstring.

    Parameters
    ----------
    rollout_workers : list[WorkerHandle]
        Started rollout workers (their :class:`WorkerReady` already received).
    trainer : WorkerHandle
        Started trainer worker.
    weight_buffers : tuple[WeightBufferSpec, WeightBufferSpec]
        The trainer's two weight slots (version v is published into slot v % 2).
    next_request : callable (group_id) -> GroupRequest
        Supplies the next prompt group to sample.
    settings : ControllerSettings
    on_step : callable (dict) -> None
        Receives each step's metrics record.
    trainer_ranks : list[WorkerHandle], optional
        Every trainer rank, ``trainer`` (rank 0) first; each gets the trainer messages.
    restart_rollout : callable (name) -> WorkerHandle, optional
        Replaces a dead rollout worker by a ready new one (None: a death fails the run).
    checkpoints : CheckpointManager, optional
        When and where to save recoverable checkpoints (None: never).
    resume : dict, optional
        ``controller.json`` of the checkpoint this run resumes from; the trainer must have
        loaded its trainer state (its version is the checkpoint's).
    """

    def __init__(self, rollout_workers: list[WorkerHandle], trainer: WorkerHandle,
                 weight_buffers, next_request: Callable[[int], msg.GroupRequest],
                 settings: ControllerSettings, on_step: Callable[[dict], None],
                 trainer_ranks: Optional[list[WorkerHandle]] = None,
                 restart_rollout: Optional[Callable[[str], WorkerHandle]] = None,
                 checkpoints=None, resume: Optional[dict] = None):
        self.workers, self.trainer, self.buffers = rollout_workers, trainer, weight_buffers
        self.trainer_ranks = trainer_ranks or [trainer]
        self.restart_rollout, self.checkpoints = restart_rollout, checkpoints
        self.next_request, self.s, self.on_step = next_request, settings, on_step
        self.staleness = StalenessManager(settings.batch_size, settings.max_head_offpolicyness,
                                          settings.max_concurrent_rollouts)
        self.version = 0
        self.counts = RunCounts()
        self.ready: collections.deque[msg.GroupDone] = collections.deque()
        self.submitted_at: dict[int, int] = {}  # group id -> policy version at submission
        self.in_flight = {w.name: 0 for w in rollout_workers}
        # per worker: when it last finished a group or went from idle to busy
        self.progress = {w.name: time.monotonic() for w in rollout_workers}
        self.filtered_in_a_row = 0
        self.failed_in_a_row = 0  # agent groups in a row whose sessions were all dropped
        self.acked = {w.name: 0 for w in rollout_workers}
        # batches sent to the trainer and not finished: (groups, send time); at most
        # TRAIN_PIPELINE, so the trainer fetches batch k + 1 while it trains batch k
        self.training: collections.deque[tuple[list[msg.GroupDone], float]] = collections.deque()
        self.eval_records: dict[str, list] = {}
        self.start = self.last_step = time.monotonic()
        self.trained_tokens = 0
        self.generated_tokens = 0
        self.agent_stats: dict[str, dict] = {}  # per worker: its agent running totals
        self.assigned: dict[int, str] = {}  # running group id -> rollout worker name
        self.requests: dict[int, msg.GroupRequest] = {}  # running groups' requests
        self.resubmit: collections.deque[msg.GroupRequest] = collections.deque()
        # restarted workers: (version to serve, death time, restart time)
        self.warming: dict[str, tuple[int, float, float]] = {}
        self.restarts_left = settings.max_rollout_restarts  # in this attempt
        self.eval_assignment: dict[str, list[msg.GroupRequest]] = {}
        self.snapshots: dict[int, dict] = {}  # version -> controller state at that step
        self.saving: dict[str, tuple[int, float]] = {}  # temp dir -> (version, asked at)
        self.elapsed_before = 0.0  # training seconds of the run before a resume
        self.winding_down = False
        self._waiter: Optional[MessageWaiter] = None  # over _all(); rebuilt when it changes
        self._deadlines_checked = 0.0  # time.monotonic() of the last _check_deadlines scan
        if resume is not None:
            self._restore(resume)

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
        self.progress = {w.name: self.start for w in self.workers}
        while self.version < self.s.total_steps and not (self._out_of_time() and
                                                         not self.training):
            self._submit_rollouts()
            self._train_if_ready()
            for worker, message in self._wait(self._wait_seconds(), self._doing()):
                self._on_message(worker, message)
            self._check_deadlines()
        self._wind_down()
        return self.counts

    def _wait(self, timeout: float, doing: str) -> list:
        """Messages from every worker (:class:`MessageWaiter`); a dead rollout worker is
        replaced (and nothing returned this time) while restarts are left."""
        try:
            if self._waiter is None:
                self._waiter = MessageWaiter(self._all())
            return self._waiter.wait(timeout, doing)
        except WorkerError as exc:
            if exc.died and self.restart_rollout is not None and self.restarts_left <= 0 and \
                    any(w.name == exc.worker for w in self.workers):
                raise WorkerError(f"{exc} (no restart left: recovery.max_rollout_restarts = "
                                  f"{self.s.max_rollout_restarts})", exc.worker, True) from exc
            if not self._can_restart(exc):
                raise
            self._replace_rollout_worker(exc)
            return []

    def _out_of_time(self) -> bool:
        return self.s.max_seconds is not None and \
            time.monotonic() - self.start + self.elapsed_before > self.s.max_seconds

    def _submit_rollouts(self) -> None:
        if self._out_of_time():
            return
        c = self.staleness.counts
        still_needed = self.s.total_steps * self.s.batch_size - (c.accepted + c.running)
        capacity = max(0, min(self.staleness.capacity(self.version), still_needed))
        if capacity == 0 and not self.resubmit:
            return
        ready = [w for w in self.workers if w.name not in self.warming]
        if not ready:
            return
        # (in flight, index, worker), least busy first, ties to the earlier worker: the
        # choice of min(ready, key=in_flight) per group at O(log workers) instead of O(workers)
        loads = [(self.in_flight[w.name], i, w) for i, w in enumerate(ready)]
        heapq.heapify(loads)
        per_worker: dict[str, list[msg.GroupRequest]] = {}
        while self.resubmit:  # running groups of a dead worker, already counted as running
            self._assign(self.resubmit.popleft(), loads, per_worker)
        for _ in range(capacity):
            group_id = self.counts.submitted
            self._assign(self.next_request(group_id), loads, per_worker)
            self.counts.submitted += 1
        if capacity > 0:
            self.staleness.on_submit(capacity)
        for worker in ready:
            if worker.name in per_worker:
                self._send_rollout(worker, msg.SubmitGroups(per_worker[worker.name]))

    def _assign(self, request: msg.GroupRequest, loads: list, per_worker: dict) -> None:
        """Give ``request`` to the least busy ready worker (``loads``: the heap of
        :meth:`_submit_rollouts`; sent by the caller)."""
        n, i, worker = heapq.heappop(loads)
        if n == 0:
            self.progress[worker.name] = time.monotonic()
        self.in_flight[worker.name] = n + 1
        heapq.heappush(loads, (n + 1, i, worker))
        per_worker.setdefault(worker.name, []).append(request)
        self.submitted_at[request.group_id] = self.version
        self.assigned[request.group_id] = worker.name
        self.requests[request.group_id] = request

    def _train_if_ready(self) -> None:
        while len(self.training) < TRAIN_PIPELINE and len(self.ready) >= self.s.batch_size \
                and not self._out_of_time():
            new_version = self.version + len(self.training) + 1
            if new_version > self.s.total_steps:
                return
            # its slot last held new_version - 2: every worker must have loaded that already
            if min(self.acked.values(), default=self.version) < new_version - 2:
                return
            batch = self._take_batch(train_version=new_version - 1)
            if batch is None:
                return
            self.training.append((batch, time.monotonic()))
            self._send_trainer(msg.TrainStep(DistributedBatch([g.shard for g in batch]),
                                             slot=new_version % 2))

    def _send_rollout(self, worker: WorkerHandle, message) -> None:
        """Send to a rollout worker; if it has died, the next wait notices (by its sentinel
        or the end of its channel) and replaces it, so the send is only logged here."""
        try:
            worker.send(message)
        except WorkerError as exc:
            if not exc.died:
                raise
            log.warning("%s (while sending %s)", exc, type(message).__name__)

    def _send_trainer(self, message) -> None:
        """Send ``message`` to every trainer rank (rank 0 answers)."""
        for rank in self.trainer_ranks:
            rank.send(message)

    def _take_batch(self, train_version: int) -> list[msg.GroupDone] | None:
        """The next batch_size ready groups in acceptance order (sorted by group id), or
        None if too few remain. Groups that started more than η versions before
        ``train_version`` are dropped as "stale", so every token's staleness is ≤ η."""
        batch = []
        while self.ready and len(batch) < self.s.batch_size:
            group = self.ready.popleft()
            if self._too_stale(group, train_version):
                self._drop(group, "stale")
                self.staleness.on_discard()
            else:
                batch.append(group)
        if len(batch) < self.s.batch_size:
            self.ready.extendleft(reversed(batch))
            return None
        for group in batch:
            del self.submitted_at[group.group_id]
        return sorted(batch, key=lambda g: g.group_id)

    def _too_stale(self, group: msg.GroupDone, train_version: int) -> bool:
        """Whether ``group`` would be trained more than η versions after it started."""
        late = self.submitted_at[group.group_id] + self.s.max_head_offpolicyness < train_version
        return self.s.drop_stale and late

    def _drop(self, group: msg.GroupDone, reason: str) -> None:
        """Forget a finished group: count it under ``reason`` and free its shard."""
        self.submitted_at.pop(group.group_id, None)
        self.counts.dropped[reason] += 1
        if reason == "stale":
            self.counts.stale_dropped_tokens += sum(group.completion_lengths)
        self._free_shard(group)

    def _on_message(self, worker: WorkerHandle, message) -> None:
        if isinstance(message, msg.GroupDone):
            if message.group_id in self.submitted_at:
                self._on_group_done(worker, message)
            else:
                self._on_unknown_group(worker, message)
        elif isinstance(message, msg.StepDone):
            self._on_step_done(message)
        elif isinstance(message, msg.WeightsUpdated):
            self.acked[worker.name] = max(self.acked[worker.name], message.version)
            self._end_warm_up(worker.name)
        elif isinstance(message, msg.StateSaved):
            self._commit_checkpoint(message)
        elif isinstance(message, msg.EvalDone):
            self.eval_records[worker.name] = message.records
        else:
            raise WorkerError(f"worker {worker.name!r} sent an unexpected "
                              f"{type(message).__name__}")

    def _on_group_done(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
        self.assigned.pop(done.group_id, None)
        self.requests.pop(done.group_id, None)
        self.in_flight[worker.name] -= 1
        self.progress[worker.name] = time.monotonic()
        self.counts.interruptions += done.interruptions
        self.generated_tokens += sum(done.completion_lengths)
        if done.agent_stats:
            self.agent_stats[worker.name] = done.agent_stats
        filtered = self.s.dynamic_filter and len(set(done.rewards)) == 1
        # the version that will train it: batches are formed from `ready` in order
        train_version = self.version + len(self.training) + len(self.ready) // self.s.batch_size
        # a too-stale group is dropped now, so that a replacement starts at once
        reason = "dynamic_filter" if filtered else (
            "stale" if self._too_stale(done, train_version) else None)
        self.failed_in_a_row = self.failed_in_a_row + 1 if done.shard is None else 0
        if done.shard is None:  # an agent group whose sessions were all dropped
            reason = "agent_sessions_dropped"
            if self.failed_in_a_row >= self.s.max_failed_agent_groups_in_a_row:
                first = done.errors[0] if done.errors else "no reason given"
                raise ValueError(f"agent: every session of the last {self.failed_in_a_row} "
                                 f"groups was dropped (e.g. {first}); {_drop_hint(first)}")
        self.filtered_in_a_row = self.filtered_in_a_row + 1 if filtered else 0
        self.staleness.on_finish(accepted=reason is None)
        if reason is None:
            self.ready.append(done)
            return
        self._drop(done, reason)
        if self.filtered_in_a_row > self.s.max_filtered_in_a_row:
            raise ValueError(f"rollout.dynamic_filter: the last {self.filtered_in_a_row} "
                             f"groups all had equal rewards and were dropped, so no batch can "
                             f"be filled; check the reward function or turn the filter off")

    def _free_shard(self, group: msg.GroupDone, worker: Optional[WorkerHandle] = None) -> None:
        """Tell the worker holding ``group``'s shard (if it has one) to drop it."""
        if group.shard is None:
            return
        worker = worker or next(w for w in self.workers if w.name == group.shard.node_id)
        self._send_rollout(worker, msg.DropShards([group.group_id]))

    def _on_unknown_group(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
        """A group that is not running (it was cancelled at the end of training, or reported
        twice): free its shard and change no counts."""
        log.warning("rollout worker %r reported group %d, which is not running (cancelled "
                    "before it finished?); it is ignored", worker.name, done.group_id)
        self._free_shard(done, worker)

    def _on_step_done(self, done: msg.StepDone) -> None:
        if not self.training or done.group_ids != [g.group_id for g in self.training[0][0]]:
            raise WorkerError(f"trainer {self.trainer.name!r} reported a step for groups "
                              f"{done.group_ids[:4]}... that were not sent to it")
        if done.version != self.version + 1:
            raise WorkerError(f"trainer {self.trainer.name!r} reported version {done.version} "
                              f"after version {self.version}")
        batch, sent = self.training.popleft()
        self.version = done.version
        self.counts.trained += len(batch)
        update = Encoded(encode_message(msg.UpdateWeights(self.version,
                                                          self.buffers[self.version % 2])))
        for worker in self.workers:  # encoded once for all
            self._send_rollout(worker, update)
        # the trained groups' spool files are deleted only now that the step is done
        for worker in self.workers:
            trained = [g.group_id for g in batch if g.shard.node_id == worker.name]
            if trained and batch[0].shard.path:
                self._send_rollout(worker, msg.DropShards(trained))
        record = self._step_record(batch, sent, done)
        self.on_step(record)
        self._maybe_checkpoint(record)

    # ---- metrics ----------------------------------------------------------------------
    def _step_record(self, batch: list[msg.GroupDone], sent: float, done: msg.StepDone) -> dict:
        now = time.monotonic()
        self.trained_tokens += done.trained_tokens
        rewards = [r for g in batch for r in g.rewards]
        lengths = [n for g in batch for n in g.completion_lengths]
        record = {
            "step": self.version, "policy_version": self.version,
            "reward_mean": statistics.fmean(rewards),
            "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
            "solve_rate": sum(max(g.rewards) == 1.0 for g in batch) / len(batch),
            "zero_adv_group_fraction": sum(len(set(g.rewards)) == 1 for g in batch) / len(batch),
            "response_length_mean": statistics.fmean(lengths),
            "response_length_max": float(max(lengths)),
            "truncated_fraction": sum(r == "length" for g in batch for r in g.stop_reasons)
            / len(rewards),
            "sample_interruptions": sum(g.interruptions for g in batch),
            **done.stats,
            "trained_tokens": done.trained_tokens,
            "trained_tokens_per_s": self.trained_tokens / (now - self.start),
            "gen_tokens_per_s": self.generated_tokens / (now - self.start),
            "train_tokens_per_s": sum(g.shard.num_tokens for g in batch)
            / max(done.train_seconds, 1e-9),
            "fetch_seconds": done.fetch_seconds, "train_seconds": done.train_seconds,
            "publish_seconds": done.publish_seconds,
            "trainer_wait_seconds": max(0.0, sent - self.last_step),
            "step_seconds": now - self.last_step,
            "elapsed_seconds": now - self.start + self.elapsed_before,
            "rollouts_running": self.staleness.counts.running, "rollouts_ready": len(self.ready),
            "rollouts_dropped_total": sum(self.counts.dropped.values()),
            **self._agent_totals(),
        }
        self.last_step = now
        return record

    def _agent_totals(self) -> dict:
        """Agent sessions and trajectory-store counters, summed over the rollout workers
        (the store's compression ratio from the summed byte counts)."""
        totals: dict = collections.Counter()
        for stats in self.agent_stats.values():
            totals.update(stats)
        if "trajectory/compression_ratio" in totals:
            stored = totals.get("trajectory/stored_bytes", 0)
            totals["trajectory/compression_ratio"] = \
                totals.get("trajectory/raw_bytes", 0) / stored if stored else 0.0
        return dict(totals)

    # ---- faults and checkpoints -------------------------------------------------------
    def _can_restart(self, exc: WorkerError) -> bool:
        return (exc.died and self.restart_rollout is not None
                and any(w.name == exc.worker for w in self.workers)
                and self.restarts_left > 0)

    def _replace_rollout_worker(self, exc: WorkerError) -> None:
        """Start a new worker in place of the dead one (retried while restarts are left);
        its running groups start again, its finished ones stay (spooled) or are dropped."""
        name, died_at = exc.worker, time.monotonic()
        while True:
            self.restarts_left -= 1
            self.counts.rollout_restarts += 1
            log.warning("%s; restarting it (%d restarts left after this one)", exc,
                        self.restarts_left)
            try:
                new = self.restart_rollout(name)
                break
            except WorkerError as failed:
                if self.restarts_left <= 0:
                    raise
                exc = failed
        self.workers = [new if w.name == name else w for w in self.workers]
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        self._requeue_running(name)
        self._drop_unspooled(name)
        self.in_flight[name], self.progress[name], self.acked[name] = 0, died_at, 0
        # slot version % 2 is being overwritten while version + 2 trains: then the new worker
        # gets the next version with everyone else
        if self.version > 0 and len(self.training) < 2:
            self._send_rollout(new, msg.UpdateWeights(self.version,
                                                      self.buffers[self.version % 2]))
        self.warming[name] = (self.version, died_at, time.monotonic())
        self._end_warm_up(name)
        if self.winding_down:
            self._send_rollout(new, msg.CancelAll())
        if name in self.eval_assignment and name not in self.eval_records:
            self._send_rollout(new, msg.Evaluate(self.eval_assignment[name]))

    def _requeue_running(self, name: str) -> None:
        """The dead worker's running groups start again (counted dropped when winding down)."""
        lost = sorted(gid for gid, owner in self.assigned.items() if owner == name)
        for gid in lost:
            del self.assigned[gid]
            if self.winding_down:  # cancelled anyway
                self.counts.dropped["in_flight_at_end"] += 1
                self.requests.pop(gid, None)
            else:
                self.resubmit.append(self.requests[gid])
        if not self.winding_down:
            self.counts.resubmitted += len(lost)

    def _drop_unspooled(self, name: str) -> None:
        """Finished groups of the dead worker that have no spool file are gone with it."""
        gone = [g for g in self.ready if g.shard.node_id == name and not g.shard.path]
        for group in gone:
            self.ready.remove(group)
            self.submitted_at.pop(group.group_id, None)
            self.counts.dropped["rollout_worker_died"] += 1
            self.staleness.on_discard()

    def _end_warm_up(self, name: str) -> None:
        """A restarted worker takes rollouts once it serves the version current at its
        restart; the time since the death is recorded."""
        if name in self.warming and self.acked[name] >= self.warming[name][0]:
            seconds = time.monotonic() - self.warming.pop(name)[1]
            self.counts.recovery_seconds.append(seconds)
            log.warning("rollout worker %r is back, serving weights version %d, %.1f s after "
                        "its death", name, self.acked[name], seconds)

    def _maybe_checkpoint(self, record: dict) -> None:
        """Remember the controller state of this version; ask the trainer for its state when
        a checkpoint is due (committed when :class:`StateSaved` arrives)."""
        if self.checkpoints is None:
            return
        self.snapshots[self.version] = self._state(record)
        if self.checkpoints.due(self.version):
            tmp = self.checkpoints.begin(self.version)
            self.saving[str(tmp)] = (self.version, time.monotonic())
            self._send_trainer(msg.SaveState(str(tmp)))
        oldest = min((v for v, _ in self.saving.values()), default=self.version)
        for version in [v for v in self.snapshots if v < oldest]:
            del self.snapshots[version]

    def _commit_checkpoint(self, saved: msg.StateSaved) -> None:
        from pathlib import Path

        if self.saving.pop(saved.path, None) is None:
            raise WorkerError(f"trainer {self.trainer.name!r} saved state into {saved.path}, "
                              f"which was not asked for", self.trainer.name)
        path = self.checkpoints.commit(Path(saved.path), saved.version,
                                       self.snapshots[saved.version])
        log.info("checkpoint of policy version %d written to %s", saved.version, path)

    def _state(self, record: dict) -> dict:
        """What a resumed run needs of the controller at the current version."""
        pending = len(self.submitted_at) + sum(len(batch) for batch, _ in self.training)
        return {"version": self.version, "counts": self.counts.as_dict(),
                "pending_groups": pending, "elapsed_seconds": record["elapsed_seconds"]}

    def _restore(self, state: dict) -> None:
        """Continue from a checkpoint's controller state: counts, version; the groups that
        were pending then are counted as dropped; every rollout worker loads the weights."""
        self.version = int(state["version"])
        self.counts = RunCounts.from_dict(state["counts"])
        if state["pending_groups"]:
            self.counts.dropped["pending_at_checkpoint"] += int(state["pending_groups"])
        self.staleness.counts.accepted = self.counts.trained
        self.elapsed_before = float(state["elapsed_seconds"])
        for worker in self.workers:
            self.acked[worker.name] = 0
            self._send_rollout(worker, msg.UpdateWeights(self.version,
                                                         self.buffers[self.version % 2]))

    # ---- deadlines and shutdown -----------------------------------------------------
    def _all(self) -> list[WorkerHandle]:
        return [*self.workers, *self.trainer_ranks]

    def _doing(self) -> str:
        return f"at policy version {self.version} (step {self.version + 1})"

    def _wait_seconds(self) -> float:
        return 1.0

    def _check_deadlines(self) -> None:
        now, t = time.monotonic(), self.s.timeouts
        if now - self._deadlines_checked < DEADLINE_CHECK_SECONDS:
            return
        self._deadlines_checked = now
        if self.training and now - max(self.training[0][1], self.last_step) > t.train_step:
            raise WorkerError(f"trainer {self.trainer.name!r} did not finish step "
                              f"{self.version + 1} within timeouts.train_step = {t.train_step:g} s",
                              self.trainer.name)
        late = [w.name for w in self.workers
                if self.acked[w.name] < self.version and w.name not in self.warming]
        warming = [name for name, (_, _, started) in self.warming.items()
                   if now - started > t.weight_update]
        if warming:
            raise WorkerError(f"restarted rollout worker {warming[0]!r} did not load weights "
                              f"within timeouts.weight_update = {t.weight_update:g} s",
                              warming[0])
        if late and now - self.last_step > t.weight_update:
            raise WorkerError(f"rollout worker {late[0]!r} did not load weights version "
                              f"{self.version} within timeouts.weight_update = "
                              f"{t.weight_update:g} s")
        slow_saves = [p for p, (_, asked) in self.saving.items() if now - asked > t.train_step]
        if slow_saves:
            raise WorkerError(f"trainer {self.trainer.name!r} did not save its state into "
                              f"{slow_saves[0]} within timeouts.train_step = {t.train_step:g} s",
                              self.trainer.name)
        stalled = [w.name for w in self.workers if self.in_flight[w.name] > 0
                   and now - self.progress[w.name] > t.rollout_stall]
        if stalled:
            raise WorkerError(f"rollout worker {stalled[0]!r} finished no rollout within "
                              f"timeouts.rollout_stall = {t.rollout_stall:g} s "
                              f"({self.in_flight[stalled[0]]} running)")

    def _wind_down(self) -> None:
        """Cancel running rollouts, drop unused ones, wait until every worker serves the
        final weights; each discarded rollout is counted with its reason."""
        self.winding_down = True
        self.counts.dropped["in_flight_at_end"] += len(self.resubmit)  # never restarted
        for request in self.resubmit:
            self.requests.pop(request.group_id, None)
        self.resubmit.clear()
        for worker in self.workers:
            self._send_rollout(worker, msg.CancelAll())
        unused = list(self.ready)
        self.ready.clear()
        self.counts.dropped["unused_at_end"] += len(unused)
        by_worker: dict[str, list[int]] = {}
        for group in unused:
            by_worker.setdefault(group.shard.node_id, []).append(group.group_id)
        for worker in self.workers:
            if worker.name in by_worker:
                self._send_rollout(worker, msg.DropShards(by_worker[worker.name]))
        cancelled = {w.name for w in self.workers}
        deadline = time.monotonic() + self.s.timeouts.weight_update
        while cancelled or min(self.acked.values()) < self.version or self.saving:
            late = sorted(cancelled) or [w.name for w in self.workers
                                         if self.acked[w.name] < self.version]
            if late and time.monotonic() > deadline:
                raise WorkerError(f"rollout worker {late[0]!r} did not cancel its rollouts and "
                                  f"load weights version {self.version} within "
                                  f"timeouts.weight_update = {self.s.timeouts.weight_update:g} s",
                                  late[0])
            self._check_deadlines()  # a final checkpoint has its own deadline
            for worker, message in self._wait(1.0, "while winding down"):
                if isinstance(message, msg.Cancelled):
                    cancelled.discard(worker.name)
                    self.counts.dropped["in_flight_at_end"] += message.groups
                    for gid in [g for g, w in self.assigned.items() if w == worker.name]:
                        del self.assigned[gid]  # counted just now
                elif isinstance(message, msg.GroupDone) and \
                        message.group_id not in self.submitted_at:
                    self._on_unknown_group(worker, message)
                elif isinstance(message, msg.GroupDone):  # finished before the cancel
                    self.submitted_at.pop(message.group_id)
                    self.assigned.pop(message.group_id, None)
                    self.requests.pop(message.group_id, None)
                    self.counts.dropped["unused_at_end"] += 1
                    self._free_shard(message, worker)
                else:
                    self._on_message(worker, message)
        self.in_flight = {w.name: 0 for w in self.workers}
        self.staleness.counts.running = 0
        self.submitted_at.clear()
        self.assigned.clear()
        self.requests.clear()
        self.winding_down = False

    def evaluate(self, requests: list[msg.GroupRequest]) -> list[dict]:
        """Run evaluation groups (greedy, n=1) spread over the rollout workers; returns one
        record per request (uid, answer, completion, correct, reward), in request order.

        Raises
        ------
        WorkerError
            A worker died or did not finish within ``timeouts.evaluate``.
        """
        if self.training or any(self.in_flight.values()):
            raise RuntimeError("evaluate() runs only before run() or after it has returned")
        self.eval_records = {}
        self.eval_assignment = {w.name: requests[i::len(self.workers)]
                                for i, w in enumerate(self.workers)}
        for worker in self.workers:
            self._send_rollout(worker, msg.Evaluate(self.eval_assignment[worker.name]))
        deadline = time.monotonic() + self.s.timeouts.evaluate
        while len(self.eval_records) < len(self.workers):
            if time.monotonic() > deadline:
                missing = [w.name for w in self.workers if w.name not in self.eval_records]
                raise WorkerError(f"rollout worker {missing[0]!r} did not finish evaluation "
                                  f"within timeouts.evaluate = {self.s.timeouts.evaluate:g} s")
            for worker, message in self._wait(1.0, "during evaluation"):
                self._on_message(worker, message)
        self.eval_assignment = {}
        order = {r.uid: i for i, r in enumerate(requests)}
        records = [r for recs in self.eval_records.values() for r in recs]
        return sorted(records, key=lambda r: order.get(r["uid"], 0))
