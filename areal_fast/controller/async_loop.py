"""The asynchronous RL controller: rollout and training run at the same time, bounded by
staleness (AReaL, Fu et al. 2025). η = max_head_offpolicyness = 0 is synchronous RL through
the same code path.

The controller holds no tensors. It starts rollouts on the rollout workers as the
:class:`~areal_fast.controller.staleness.StalenessManager` allows, collects finished groups
as shard metadata, hands every batch_size accepted groups (in acceptance order) to the trainer
as a :class:`~areal_fast.controller.batch.DistributedBatch`, and after each step tells every
rollout worker to load the new weights (they interrupt and resume their running samples).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from areal_fast.controller import messages as msg
from areal_fast.controller.batch import DistributedBatch
from areal_fast.controller.staleness import StalenessManager
from areal_fast.controller.workers import WorkerError, WorkerHandle, wait_messages

TRAIN_PIPELINE = 2  # batches handed to the trainer ahead of completion (prefetch depth)
log = logging.getLogger("areal_fast.controller")


@dataclass
class Timeouts:
    """Seconds before the controller gives up on a worker (each error names the worker)."""

    train_step: float = 3600.0  # one TrainStep, fetch to publish
    weight_update: float = 600.0  # a rollout worker acknowledging new weights
    rollout_stall: float = 1800.0  # no rollout finished while some are running
    evaluate: float = 3600.0

    def __post_init__(self):
        for name in ("train_step", "weight_update", "rollout_stall", "evaluate"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} = {value} must be a finite number > 0")


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


@dataclass
class RunCounts:
    """Where every submitted rollout went: trained exactly once, or dropped with a reason."""

    submitted: int = 0
    trained: int = 0
    dropped: dict = field(default_factory=lambda: collections.Counter())
    interruptions: int = 0
    stale_dropped_tokens: int = 0  # completion tokens of the groups dropped as stale

    def as_dict(self) -> dict:
        """The counts as plain JSON-able values (for summary.json)."""
        return {"rollouts_submitted": self.submitted, "rollouts_trained": self.trained,
                "rollouts_dropped": dict(self.dropped),
                "sample_interruptions": self.interruptions,
                "stale_dropped_completion_tokens": self.stale_dropped_tokens}


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
    """

    def __init__(self, rollout_workers: list[WorkerHandle], trainer: WorkerHandle,
                 weight_buffers, next_request: Callable[[int], msg.GroupRequest],
                 settings: ControllerSettings, on_step: Callable[[dict], None]):
        self.workers, self.trainer, self.buffers = rollout_workers, trainer, weight_buffers
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
            for worker, message in wait_messages(self._all(), self._wait_seconds(),
                                                 self._doing()):
                self._on_message(worker, message)
            self._check_deadlines()
        self._wind_down()
        return self.counts

    def _out_of_time(self) -> bool:
        return self.s.max_seconds is not None and \
            time.monotonic() - self.start > self.s.max_seconds

    def _submit_rollouts(self) -> None:
        if self._out_of_time():
            return
        c = self.staleness.counts
        still_needed = self.s.total_steps * self.s.batch_size - (c.accepted + c.running)
        capacity = min(self.staleness.capacity(self.version), still_needed)
        if capacity <= 0:
            return
        per_worker: dict[str, list[msg.GroupRequest]] = {}
        for _ in range(capacity):
            worker = min(self.workers, key=lambda w: self.in_flight[w.name])
            if self.in_flight[worker.name] == 0:
                self.progress[worker.name] = time.monotonic()
            self.in_flight[worker.name] += 1
            group_id = self.counts.submitted
            per_worker.setdefault(worker.name, []).append(self.next_request(group_id))
            self.submitted_at[group_id] = self.version
            self.counts.submitted += 1
        self.staleness.on_submit(capacity)
        for worker in self.workers:
            if worker.name in per_worker:
                worker.send(msg.SubmitGroups(per_worker[worker.name]))

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
            self.trainer.send(msg.TrainStep(DistributedBatch([g.shard for g in batch]),
                                            slot=new_version % 2))

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
        elif isinstance(message, msg.EvalDone):
            self.eval_records[worker.name] = message.records
        else:
            raise WorkerError(f"worker {worker.name!r} sent an unexpected "
                              f"{type(message).__name__}")

    def _on_group_done(self, worker: WorkerHandle, done: msg.GroupDone) -> None:
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
        worker.send(msg.DropShards([group.group_id]))

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
        for worker in self.workers:
            worker.send(msg.UpdateWeights(self.version, self.buffers[self.version % 2]))
        self.on_step(self._step_record(batch, sent, done))

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
            "step_seconds": now - self.last_step, "elapsed_seconds": now - self.start,
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

    # ---- deadlines and shutdown -----------------------------------------------------
    def _all(self) -> list[WorkerHandle]:
        return [*self.workers, self.trainer]

    def _doing(self) -> str:
        return f"at policy version {self.version} (step {self.version + 1})"

    def _wait_seconds(self) -> float:
        return 1.0

    def _check_deadlines(self) -> None:
        now, t = time.monotonic(), self.s.timeouts
        if self.training and now - max(self.training[0][1], self.last_step) > t.train_step:
            raise WorkerError(f"trainer {self.trainer.name!r} did not finish step "
                              f"{self.version + 1} within timeouts.train_step = {t.train_step:g} s")
        late = [w.name for w in self.workers if self.acked[w.name] < self.version]
        if late and now - self.last_step > t.weight_update:
            raise WorkerError(f"rollout worker {late[0]!r} did not load weights version "
                              f"{self.version} within timeouts.weight_update = "
                              f"{t.weight_update:g} s")
        stalled = [w.name for w in self.workers if self.in_flight[w.name] > 0
                   and now - self.progress[w.name] > t.rollout_stall]
        if stalled:
            raise WorkerError(f"rollout worker {stalled[0]!r} finished no rollout within "
                              f"timeouts.rollout_stall = {t.rollout_stall:g} s "
                              f"({self.in_flight[stalled[0]]} running)")

    def _wind_down(self) -> None:
        """Cancel running rollouts, drop unused ones, wait until every worker serves the
        final weights; each discarded rollout is counted with its reason."""
        for worker in self.workers:
            worker.send(msg.CancelAll())
        unused = list(self.ready)
        self.ready.clear()
        self.counts.dropped["unused_at_end"] += len(unused)
        by_worker: dict[str, list[int]] = {}
        for group in unused:
            by_worker.setdefault(group.shard.node_id, []).append(group.group_id)
        for worker in self.workers:
            if worker.name in by_worker:
                worker.send(msg.DropShards(by_worker[worker.name]))
        cancelled = {w.name for w in self.workers}
        deadline = time.monotonic() + self.s.timeouts.weight_update
        while cancelled or min(self.acked.values()) < self.version:
            if time.monotonic() > deadline:
                late = sorted(cancelled) or [w.name for w in self.workers
                                             if self.acked[w.name] < self.version]
                raise WorkerError(f"rollout worker {late[0]!r} did not cancel its rollouts and "
                                  f"load weights version {self.version} within "
                                  f"timeouts.weight_update = {self.s.timeouts.weight_update:g} s")
            for worker, message in wait_messages(self._all(), 1.0, "while winding down"):
                if isinstance(message, msg.Cancelled):
                    cancelled.discard(worker.name)
                    self.counts.dropped["in_flight_at_end"] += message.groups
                elif isinstance(message, msg.GroupDone) and \
                        message.group_id not in self.submitted_at:
                    self._on_unknown_group(worker, message)
                elif isinstance(message, msg.GroupDone):  # finished before the cancel
                    self.submitted_at.pop(message.group_id)
                    self.counts.dropped["unused_at_end"] += 1
                    self._free_shard(message, worker)
                else:
                    self._on_message(worker, message)
        self.in_flight = {w.name: 0 for w in self.workers}
        self.staleness.counts.running = 0
        self.submitted_at.clear()

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
        for i, worker in enumerate(self.workers):
            worker.send(msg.Evaluate(requests[i::len(self.workers)]))
        deadline = time.monotonic() + self.s.timeouts.evaluate
        while len(self.eval_records) < len(self.workers):
            if time.monotonic() > deadline:
                missing = [w.name for w in self.workers if w.name not in self.eval_records]
                raise WorkerError(f"rollout worker {missing[0]!r} did not finish evaluation "
                                  f"within timeouts.evaluate = {self.s.timeouts.evaluate:g} s")
            for worker, message in wait_messages(self._all(), 1.0, "during evaluation"):
                self._on_message(worker, message)
        order = {r.uid: i for i, r in enumerate(requests)}
        records = [r for recs in self.eval_records.values() for r in recs]
        return sorted(records, key=lambda r: order.get(r["uid"], 0))
