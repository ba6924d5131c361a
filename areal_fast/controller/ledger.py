"""The ledger of rollout groups: one record per prompt group, and the only place a group's
state lives.

A group is submitted RUNNING (on a rollout worker, or waiting for one after its worker
died), becomes READY when it finishes and is kept, TRAINING when it is sent to the trainer
in a batch, and TRAINED when the trainer reports the step. Any group that is not trained
ends DROPPED with a reason:

====================== =================================================================
reason                 meaning
====================== =================================================================
dynamic_filter         all its rewards were equal (``rollout.dynamic_filter``)
stale                  it would have been trained more than η versions after it started
agent_sessions_dropped every agent session of the group was dropped
reward_error           its reward raised or returned a non-finite value (``reward.on_error``)
reward_timeout         a call of its reward took longer than ``reward.timeout``
rollout_worker_died    finished, not spooled to disk, and its rollout worker died
in_flight_at_end       still running (or waiting for a worker) when training ended
unused_at_end          finished but not needed when training ended
pending_at_checkpoint  running or not yet trained at the checkpoint a run resumed from
====================== =================================================================

Each transition is a method that checks the state the group leaves and raises
:class:`LedgerError` on any other. Trained and dropped records are folded into
:class:`RunCounts` (kept only with ``keep_finished``), so memory does not grow with the run;
every count of ``summary.json`` and of a checkpoint's ``controller.json`` is
:meth:`RunCounts.as_dict` of :attr:`Ledger.counts`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Optional

from areal_fast.controller.run_counts import RunCounts
from areal_fast.wire import messages as msg


class LedgerError(RuntimeError):
    """A transition from a state the group is not in (an internal bookkeeping error)."""


class State(enum.Enum):
    """Where a prompt group is (see the module docstring)."""

    RUNNING = "running"
    READY = "ready"
    TRAINING = "training"
    TRAINED = "trained"
    DROPPED = "dropped"


@dataclass(eq=False)
class GroupRecord:
    """One prompt group (see the module docstring for its states)."""

    group_id: int  # submission order, from 0
    # prompt, sampling parameters, seed (resubmitted as is); None: restored from a checkpoint
    request: Optional[msg.GroupRequest]
    version: int  # policy version when it was (last) submitted
    # rollout worker running it, or holding its shard once finished; None while it waits
    worker: Optional[str]
    state: State = State.RUNNING
    done: Optional[msg.GroupDone] = None  # rewards, lengths, shard metadata once finished
    reason: str = ""  # why it was dropped


@dataclass
class TrainingBatch:
    """Groups sent to the trainer together (sorted by group id), the trainer version that
    trains them and when they were sent (``time.monotonic()``)."""

    groups: list[GroupRecord]
    train_version: int
    sent_at: float

    @property
    def group_ids(self) -> list[int]:
        return [g.group_id for g in self.groups]


class Ledger:
    """Every live prompt group of a run and the counts of the finished ones.

    Parameters
    ----------
    max_staleness : int or None
        η when stale groups are dropped (``rollout.drop_stale``): :meth:`take_batch` then
        never hands out a group submitted more than η versions before the batch's train
        version. None: no group is too stale.
    keep_finished : bool
        Keep trained and dropped records in :attr:`finished` (tests); otherwise they are
        only counted.
    ordered : bool
        Groups are submitted in id order (0, 1, 2, ...); False: in any order, each id once
        (a reproducible run submits each worker's groups together).
    """

    def __init__(
        self, max_staleness: Optional[int], keep_finished: bool = False, ordered: bool = True
    ):
        self.max_staleness = max_staleness
        self.ordered = ordered
        self.counts = RunCounts()
        self.generated_tokens = 0  # completion tokens of every finished group
        self.closing = False  # training has ended: nothing is submitted or trained any more
        self.training: collections.deque[TrainingBatch] = collections.deque()
        self.finished: Optional[dict[int, GroupRecord]] = {} if keep_finished else None
        self._running: dict[int, GroupRecord] = {}
        self._waiting: dict[int, GroupRecord] = {}  # running, worker None, in requeue order
        self._on_worker: dict[str, dict[int, GroupRecord]] = collections.defaultdict(dict)
        self._ready: dict[int, GroupRecord] = {}  # in acceptance order
        self._released: list[GroupRecord] = []  # dropped groups whose shard may be deleted

    # ---- queries ----------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Groups RUNNING (on a worker or waiting for one)."""
        return len(self._running)

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def accepted(self) -> int:
        """Groups kept for training over the run: trained, training or ready (the
        ``accepted`` of the staleness bound)."""
        return self.counts.trained + self.live - len(self._running)

    @property
    def live(self) -> int:
        """Groups neither trained nor dropped."""
        return len(self._running) + len(self._ready) + sum(len(b.groups) for b in self.training)

    def running_on(self, worker: str) -> int:
        """Groups RUNNING on ``worker``."""
        return len(self._on_worker.get(worker, ()))

    def is_running(self, group_id: int) -> bool:
        return group_id in self._running

    def waiting(self) -> list[GroupRecord]:
        """RUNNING groups without a worker (their worker died), in requeue order."""
        return list(self._waiting.values())

    def record(self, group_id: int) -> GroupRecord:
        """The record of the READY group ``group_id`` (KeyError if it is not ready)."""
        return self._ready[group_id]

    def ready_ids(self) -> list[int]:
        return list(self._ready)

    def state(self, group_id: int) -> Optional[State]:
        """The state of ``group_id`` (None if never submitted, or finished and not kept)."""
        for table in (self._running, self._ready):
            if group_id in table:
                return table[group_id].state
        if any(group_id in b.group_ids for b in self.training):
            return State.TRAINING
        record = (self.finished or {}).get(group_id)
        return record.state if record else None

    def too_stale(self, group_id: int, train_version: int) -> bool:
        """Whether the running or ready ``group_id`` would be trained more than η versions
        after it started (never, without ``max_staleness``)."""
        record = self._running.get(group_id) or self._ready[group_id]
        return self._too_stale(record, train_version)

    def _too_stale(self, record: GroupRecord, train_version: int) -> bool:
        return (
            self.max_staleness is not None and record.version + self.max_staleness < train_version
        )

    def pop_released(self) -> list[GroupRecord]:
        """Dropped groups whose shard its worker may delete now (each returned once)."""
        released, self._released = self._released, []
        return released

    # ---- transitions ------------------------------------------------------------------
    def submit(self, request: msg.GroupRequest, worker: str, version: int) -> GroupRecord:
        """A new group starts on ``worker`` at policy ``version``: → RUNNING.

        Raises
        ------
        LedgerError
            Its id is not the next one (``counts.submitted``; with ``ordered`` False: it is
            live already), or training has ended.
        """
        group_id = request.group_id
        out_of_order = group_id != self.counts.submitted and self.ordered
        if out_of_order or self.closing or (not self.ordered and self.state(group_id)):
            raise LedgerError(
                f"group {group_id} submitted as group "
                f"{self.counts.submitted}{' after the end' * self.closing}"
            )
        record = GroupRecord(request.group_id, request, version, worker)
        self._running[record.group_id] = record
        self._on_worker[worker][record.group_id] = record
        self.counts.submitted += 1
        return record

    def assign(self, group_id: int, worker: str, version: int) -> GroupRecord:
        """A waiting group starts again on ``worker`` at ``version`` (RUNNING, from scratch)."""
        record = self._waiting.pop(group_id, None)
        if record is None or self.closing:
            raise LedgerError(f"group {group_id} is not waiting for a worker")
        record.worker, record.version = worker, version
        self._on_worker[worker][group_id] = record
        return record

    def finish(self, done: msg.GroupDone, reason: Optional[str] = None) -> GroupRecord:
        """A running group finished: READY, or DROPPED with ``reason``. After the end of
        training it is dropped as "unused_at_end" (its interruptions are not counted)."""
        record = self._running.get(done.group_id)
        if record is None or record.worker is None:
            raise LedgerError(f"group {done.group_id} finished but is not running on a worker")
        self._leave_running(record)
        record.done = done
        if self.closing:
            self._end(record, State.DROPPED, "unused_at_end")
            return record
        self.counts.interruptions += done.interruptions
        self.generated_tokens += sum(done.completion_lengths)
        if reason is not None:
            self._end(record, State.DROPPED, reason)
        else:
            record.state = State.READY
            self._ready[record.group_id] = record
        return record

    def take_batch(
        self, batch_size: int, train_version: int, sent_at: float
    ) -> Optional[TrainingBatch]:
        """The first ``batch_size`` READY groups in acceptance order → TRAINING (sorted by
        group id), or None if too few remain. Too-stale groups met on the way are dropped
        as "stale", so every trained token's staleness is ≤ η."""
        if self.closing:
            raise LedgerError("no batch is taken after the end of training")
        batch, stale = [], []
        for record in self._ready.values():
            if len(batch) == batch_size:
                break
            (stale if self._too_stale(record, train_version) else batch).append(record)
        for record in stale:
            self.drop(record.group_id, "stale")
        if len(batch) < batch_size:
            return None
        for record in batch:
            del self._ready[record.group_id]
            record.state = State.TRAINING
        taken = TrainingBatch(sorted(batch, key=lambda r: r.group_id), train_version, sent_at)
        self.training.append(taken)
        return taken

    def take_groups(
        self, group_ids: list[int], train_version: int, sent_at: float
    ) -> TrainingBatch:
        """These READY groups → TRAINING, as one batch (sorted by group id).

        Raises
        ------
        LedgerError
            One of them is not READY, none is given, or training has ended.
        """
        if self.closing or not group_ids or any(g not in self._ready for g in group_ids):
            raise LedgerError(f"groups {list(group_ids)[:4]}... are not all ready for a batch")
        batch = [self._ready.pop(g) for g in sorted(group_ids)]
        for record in batch:
            record.state = State.TRAINING
        taken = TrainingBatch(batch, train_version, sent_at)
        self.training.append(taken)
        return taken

    def trained(self, group_ids: list[int]) -> TrainingBatch:
        """The oldest batch in training was trained: its groups → TRAINED (LedgerError if
        ``group_ids`` are not that batch's)."""
        if not self.training or self.training[0].group_ids != list(group_ids):
            raise LedgerError(
                f"groups {list(group_ids)[:4]}... are not the oldest batch in training"
            )
        batch = self.training.popleft()
        for record in batch.groups:
            self._end(record, State.TRAINED, "")
        self.counts.trained += len(batch.groups)
        return batch

    def drop(self, group_id: int, reason: str) -> GroupRecord:
        """A RUNNING or READY group is given up: → DROPPED(``reason``); its shard (if any)
        is released (:meth:`pop_released`)."""
        record = self._running.get(group_id) or self._ready.get(group_id)
        if record is None:
            raise LedgerError(f"group {group_id} cannot be dropped: it is not running or ready")
        if record.state is State.RUNNING:
            self._leave_running(record)
        else:
            del self._ready[group_id]
        self._end(record, State.DROPPED, reason)
        return record

    def requeue(self, worker: str) -> list[GroupRecord]:
        """``worker`` died: its running groups wait for another worker (counted as
        resubmitted), or are dropped as "in_flight_at_end" after the end of training."""
        lost = sorted(self._on_worker.pop(worker, {}).values(), key=lambda r: r.group_id)
        for record in lost:
            record.worker = None
            if self.closing:
                del self._running[record.group_id]
                self._end(record, State.DROPPED, "in_flight_at_end", release=False)
            else:
                self._waiting[record.group_id] = record
        if not self.closing:
            self.counts.resubmitted += len(lost)
        return lost

    def lose_unspooled(self, worker: str) -> list[GroupRecord]:
        """``worker`` died: its READY groups without a spool file are gone with it (dropped
        as "rollout_worker_died")."""
        gone = [
            r
            for r in self._ready.values()
            if r.done.shard.node_id == worker and not r.done.shard.path
        ]
        for record in gone:
            del self._ready[record.group_id]
            self._end(record, State.DROPPED, "rollout_worker_died", release=False)
        return gone

    def note_restart(self) -> None:
        """A dead rollout worker is being replaced (each attempt counts)."""
        self.counts.rollout_restarts += 1

    def note_recovery(self, seconds: float) -> None:
        """A restarted worker serves current weights ``seconds`` after the death."""
        self.counts.recovery_seconds.append(seconds)

    def close(self) -> None:
        """Training has ended: waiting groups are dropped ("in_flight_at_end"), READY ones
        ("unused_at_end", shards released); groups still running end by :meth:`finish`
        ("unused_at_end") or :meth:`cancelled`."""
        if self.training:
            raise LedgerError("training ended with a batch still in training")
        for record in list(self._waiting.values()):
            self._leave_running(record)
            self._end(record, State.DROPPED, "in_flight_at_end", release=False)
        for group_id in list(self._ready):
            self._end(self._ready.pop(group_id), State.DROPPED, "unused_at_end")
        self.closing = True

    def cancelled(self, worker: str) -> list[GroupRecord]:
        """``worker`` cancelled its running groups: → DROPPED("in_flight_at_end")."""
        gone = sorted(self._on_worker.pop(worker, {}).values(), key=lambda r: r.group_id)
        for record in gone:
            del self._running[record.group_id]
            self._end(record, State.DROPPED, "in_flight_at_end", release=False)
        return gone

    def reopen(self) -> None:
        """The end of training is complete: every worker cancelled (else LedgerError)."""
        if self._running:
            raise LedgerError(
                f"groups {sorted(self._running)[:4]} still running after every worker cancelled"
            )
        self.closing = False

    def restore(self, counts: dict, pending_groups: int) -> None:
        """Continue the counts of a checkpoint (``RunCounts.as_dict``); the groups pending
        then are dropped as "pending_at_checkpoint"."""
        if self._running or self._ready or self.training:
            raise LedgerError("a ledger with live groups cannot be restored")
        self.counts = RunCounts.from_dict(counts)
        if pending_groups:
            self.counts.dropped["pending_at_checkpoint"] += int(pending_groups)

    def restore_ready(self, done: msg.GroupDone, version: int) -> None:
        """A group a checkpoint kept (finished under ``version`` before it) is READY again;
        the restored counts include its submission.

        Raises
        ------
        LedgerError
            The group is live already.
        """
        if self.state(done.group_id) is not None:
            raise LedgerError(f"group {done.group_id} restored twice")
        record = GroupRecord(done.group_id, None, version, None, State.READY, done)
        self._ready[done.group_id] = record

    def check(self) -> None:
        """Assert the internal tables agree (every live group in exactly one of them)."""
        on_worker = [g for groups in self._on_worker.values() for g in groups]
        assert sorted(on_worker + list(self._waiting)) == sorted(self._running)
        assert all(r.worker is None for r in self._waiting.values())
        assert all(r.state is State.RUNNING for r in self._running.values())
        assert all(r.state is State.READY for r in self._ready.values())
        training = [r for b in self.training for r in b.groups]
        assert all(r.state is State.TRAINING for r in training)
        ids = list(self._running) + list(self._ready) + [r.group_id for r in training]
        assert len(ids) == len(set(ids)), "a group in two states"
        assert not set(ids) & set(self.finished or ())
        assert self.counts.submitted == len(ids) + self.counts.trained + sum(
            self.counts.dropped.values()
        )

    # ---- internals --------------------------------------------------------------------
    def _leave_running(self, record: GroupRecord) -> None:
        self._running.pop(record.group_id)
        if record.worker is None:
            self._waiting.pop(record.group_id)
        else:
            del self._on_worker[record.worker][record.group_id]

    def _end(self, record: GroupRecord, state: State, reason: str, release: bool = True) -> None:
        record.state, record.reason = state, reason
        if state is State.DROPPED:
            self.counts.dropped[reason] += 1
            if reason == "stale" and record.done is not None:
                self.counts.stale_dropped_tokens += sum(record.done.completion_lengths)
            if release and record.done is not None and record.done.shard is not None:
                self._released.append(record)
        if self.finished is not None:
            self.finished[record.group_id] = record
