"""The ledger of rollout groups under random submits, finishes, worker deaths (through
:class:`Recovery`), resubmissions, stale drops, training steps, checkpoints/resumes and the
end of training, checked after every rule: each submitted group in exactly one state, trained
once or dropped once with a reason, no trained group staler than η, capacity never negative.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from areal_fast.controller.checkpoint_manager import PendingSaves
from areal_fast.controller.config import RecoveryConfig, Timeouts
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger, LedgerError, RunCounts, State
from areal_fast.controller.recovery import Recovery, RecoveryScope
from areal_fast.controller.staleness import StalenessManager
from areal_fast.controller.step_evals import StepEvals
from areal_fast.controller.weight_tracker import WeightTracker
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.wire.shards import ShardMetadata

WORKERS = ("rollout-0", "rollout-1", "rollout-2")
MAX_CONCURRENT, PIPELINE = 7, 2


class FakeHandle:
    def __init__(self, name: str):
        self.name, self.sent = name, []

    def send(self, message) -> None:
        self.sent.append(message)


def request(group_id: int) -> msg.GroupRequest:
    return msg.GroupRequest(group_id, [1, 2], SamplingParams(n=2), group_id)


class LedgerMachine(RuleBasedStateMachine):
    @initialize(batch=st.integers(1, 3), eta=st.integers(0, 2), drop_stale=st.booleans())
    def start(self, batch, eta, drop_stale):
        self.batch, self.eta, self.drop_stale = batch, eta, drop_stale
        self.staleness = StalenessManager(batch, eta, MAX_CONCURRENT)
        self.ledger = Ledger(self.max_staleness, keep_finished=True)
        self.fleet = RolloutFleet([FakeHandle(n) for n in WORKERS])
        self.weights = WeightTracker(list(WORKERS))
        watched = RecoveryScope(
            self.ledger, self.fleet, self.weights, StepEvals(), PendingSaves(None), "trainer"
        )
        self.recovery = Recovery(
            watched, FakeHandle, RecoveryConfig(max_rollout_restarts=10**6), Timeouts()
        )
        self.version = 0
        self.first_id, self.resumed_at = 0, -1  # groups before a resume are only counted
        self.ended_before = RunCounts()  # counts at the last resume
        self.cancelled: set[str] = set()
        self.staleness_trained: list[int] = []
        self.outcomes: dict[int, State] = {}  # every group that ended, seen once

    @property
    def max_staleness(self):
        return self.eta if self.drop_stale else None

    # ---- rules ------------------------------------------------------------------------
    @precondition(lambda self: not self.ledger.closing)
    @rule(n=st.integers(1, 8), worker=st.sampled_from(WORKERS))
    def submit(self, n, worker):
        """Resubmit the waiting groups, then as many new ones as the bound allows."""
        if worker in self.recovery.warming:
            return
        for record in self.ledger.waiting():
            self.ledger.assign(record.group_id, worker, self.version)
        ledger = self.ledger
        capacity = self.staleness.capacity_for(self.version, ledger.accepted, ledger.running)
        assert capacity >= 0
        for _ in range(min(n, capacity)):
            ledger.submit(request(ledger.counts.submitted), worker, self.version)

    @precondition(lambda self: self.ledger.running > len(self.ledger.waiting()))
    @rule(
        data=st.data(),
        outcomes=st.lists(
            st.tuples(
                st.sampled_from(["kept", "kept", "kept", "flat", "agent"]),
                st.booleans(),
                st.integers(0, 2),
            ),
            min_size=1,
            max_size=3,
        ),
    )
    def finish(self, data, outcomes):
        """Groups finish (kept, all rewards equal, or every agent session dropped; spooled
        or not; with some interruptions), as the controller decides their fate."""
        for kind, spooled, interruptions in outcomes:
            on_workers = {g: w for w, groups in self.ledger._on_worker.items() for g in groups}
            if not on_workers:
                return
            # newest first is the simplest draw: older groups then wait and turn stale
            gid = data.draw(st.sampled_from(sorted(on_workers, reverse=True)))
            shard = (
                None
                if kind == "agent"
                else ShardMetadata(
                    on_workers[gid], "127.0.0.1:1", gid, 2, 0, {}, f"/spool/{gid}" * spooled
                )
            )
            rewards = [] if shard is None else [1.0, 1.0 if kind == "flat" else 0.0]
            done = msg.GroupDone(
                shard, gid, rewards, [3, 5][: len(rewards)], ["stop"] * len(rewards), interruptions
            )
            if self.ledger.closing:
                self.ledger.finish(done)
                continue
            train_version = (
                self.version + len(self.ledger.training) + self.ledger.num_ready // self.batch
            )
            stale = self.ledger.too_stale(gid, train_version)
            reason = (
                "agent_sessions_dropped"
                if shard is None
                else ("dynamic_filter" if kind == "flat" else "stale" if stale else None)
            )
            self.ledger.finish(done, reason)

    @precondition(
        lambda self: (
            not self.ledger.closing
            and self.ledger.num_ready >= self.batch
            and len(self.ledger.training) < PIPELINE
        )
    )
    @rule()
    def send_batch(self):
        self.ledger.take_batch(self.batch, self.version + len(self.ledger.training), 0.0)

    @precondition(lambda self: not self.ledger.closing)
    @rule(data=st.data(), worker=st.sampled_from(WORKERS))
    def run_a_step(self, data, worker):
        """Submit what the bound allows, finish the newest groups until a batch is ready
        (older ones keep running, and may turn stale), train it."""
        self.submit(MAX_CONCURRENT, worker)
        while self.ledger.num_ready < self.batch and self.ledger.running > len(
            self.ledger.waiting()
        ):
            self.finish(data, [("kept", False, 0)])
        if self.ledger.num_ready >= self.batch and len(self.ledger.training) < PIPELINE:
            self.send_batch()
        if self.ledger.training:
            self.step_done()

    @precondition(lambda self: self.ledger.training)
    @rule()
    def step_done(self):
        batch = self.ledger.trained(self.ledger.training[0].group_ids)
        assert batch.train_version == self.version
        self.staleness_trained += [batch.train_version - g.version for g in batch.groups]
        self.version += 1
        with pytest.raises(LedgerError):  # a batch is trained once
            self.ledger.trained(batch.group_ids)

    @precondition(lambda self: self.recovery.warming)
    @rule(worker=st.sampled_from(WORKERS))
    def acknowledge(self, worker):
        """``worker`` serves the current weights (ends its warm-up)."""
        self.weights.acknowledged(worker, msg.WeightsUpdated(self.version, 0.1))
        self.recovery.end_warm_up(worker)

    @rule(worker=st.sampled_from(WORKERS), roll=st.integers(0, 3))
    def worker_dies(self, worker, roll):
        if roll:  # deaths are rarer than the other events
            return
        old = next(w for w in self.fleet.workers if w.name == worker)
        died = WorkerError(f"{worker} died", worker, died=True)
        new = self.recovery.on_worker_error(died, self.version)
        assert new is not old and new.name == worker and new in self.fleet.workers
        assert self.weights.acked[worker] == 0  # serves nothing until it acknowledges
        if self.ledger.closing:
            self.cancelled.discard(worker)  # the new worker has to answer the cancel
        assert self.ledger.running_on(worker) == 0

    @precondition(
        lambda self: (
            not self.ledger.closing and not self.ledger.training and self.version > self.resumed_at
        )
    )
    @rule(roll=st.integers(0, 3))
    def checkpoint_and_resume(self, roll):
        """A checkpoint now, resumed in a fresh ledger: pending groups counted as dropped."""
        if roll:  # resumes are rarer than the other events
            return
        state = self.ledger.counts.as_dict()
        pending = self.ledger.live
        resumed = Ledger(self.max_staleness, keep_finished=True)
        resumed.restore(state, pending)
        kept = {k: v for k, v in resumed.counts.as_dict().items() if k != "rollouts_dropped"}
        assert kept == {k: v for k, v in state.items() if k != "rollouts_dropped"}
        assert (
            resumed.counts.dropped["pending_at_checkpoint"]
            == self.ledger.counts.dropped["pending_at_checkpoint"] + pending
        )
        self.ledger = self.recovery.scope.ledger = resumed
        self.first_id, self.resumed_at = resumed.counts.submitted, self.version
        self.ended_before = RunCounts.from_dict(resumed.counts.as_dict())
        self.outcomes = {}

    @precondition(
        lambda self: not self.ledger.closing and not self.ledger.training and self.version >= 1
    )
    @rule()
    def end_training(self):
        self.ledger.close()
        self.cancelled = set()
        assert not self.ledger.waiting() and not self.ledger.ready_ids()
        with pytest.raises(LedgerError):
            self.ledger.submit(request(self.ledger.counts.submitted), WORKERS[0], self.version)

    @precondition(lambda self: self.ledger.closing)
    @rule(worker=st.sampled_from(WORKERS))
    def cancel(self, worker):
        self.ledger.cancelled(worker)
        self.cancelled.add(worker)
        if self.cancelled == set(WORKERS):
            self.ledger.reopen()
            assert self.ledger.live == 0

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def tables_agree(self):
        self.ledger.check()

    @invariant()
    def every_group_in_exactly_one_state(self):
        ledger = self.ledger
        for gid in range(self.first_id, ledger.counts.submitted):
            state = ledger.state(gid)
            assert state is not None, gid
            if state in (State.TRAINED, State.DROPPED):
                previous = self.outcomes.setdefault(gid, state)
                assert previous is state, f"group {gid} ended twice ({previous}, {state})"
        live = [
            g
            for g in range(self.first_id, ledger.counts.submitted)
            if ledger.state(g) not in (State.TRAINED, State.DROPPED)
        ]
        assert len(live) == ledger.live

    @invariant()
    def trained_once_or_dropped_once_with_a_reason(self):
        ledger, before = self.ledger, self.ended_before
        finished = ledger.finished.values()
        trained = [r for r in finished if r.state is State.TRAINED]
        dropped = [r for r in finished if r.state is State.DROPPED]
        assert all(r.reason for r in dropped) and not any(r.reason for r in trained)
        assert len(trained) == ledger.counts.trained - before.trained
        assert len(dropped) == sum(ledger.counts.dropped.values()) - sum(before.dropped.values())
        assert ledger.counts.submitted == ledger.live + ledger.counts.trained + sum(
            ledger.counts.dropped.values()
        )

    @invariant()
    def no_trained_group_staler_than_eta(self):
        assert all(0 <= s for s in self.staleness_trained)
        if self.drop_stale:
            assert all(s <= self.eta for s in self.staleness_trained)

    @invariant()
    def capacity_never_negative(self):
        ledger = self.ledger
        assert self.staleness.capacity_for(self.version, ledger.accepted, ledger.running) >= 0
        assert 0 <= ledger.running <= MAX_CONCURRENT
        if not ledger.closing:
            assert ledger.accepted + ledger.running <= (self.eta + self.version + 1) * self.batch


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_illegal_transitions_raise():
    ledger = Ledger(max_staleness=0)
    with pytest.raises(LedgerError):
        ledger.submit(request(1), "w", 0)  # not the next id
    ledger.submit(request(0), "w", 0)
    done = msg.GroupDone(
        ShardMetadata("w", "a:1", 0, 2, 0, {}), 0, [1.0, 0.0], [2, 2], ["stop"] * 2, 0
    )
    with pytest.raises(LedgerError):
        ledger.assign(0, "v", 0)  # running, not waiting
    with pytest.raises(LedgerError):
        ledger.trained([0])  # not in training
    ledger.finish(done)
    with pytest.raises(LedgerError):
        ledger.finish(done)  # finished twice
    assert ledger.take_batch(1, 1, 0.0) is None  # submitted at 0, trained at 1 > η = 0
    assert ledger.counts.dropped == {"stale": 1} and ledger.counts.stale_dropped_tokens == 4
    assert [r.group_id for r in ledger.pop_released()] == [0] and ledger.pop_released() == []
    with pytest.raises(LedgerError):
        ledger.drop(0, "stale")  # dropped twice
