"""Recovery through its scope: a dead rollout worker replaced (ledger transitions, fleet,
weights), restarts counted and bounded, every deadline named, a resume's starting point."""

from __future__ import annotations

import time

import pytest

from areal_fast.controller.checkpoint_manager import CheckpointManager, PendingSaves
from areal_fast.controller.config import RecoveryConfig, Timeouts
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger, State
from areal_fast.controller.recovery import Recovery, RecoveryScope, ResumePoint
from areal_fast.controller.step_evals import StepEvals
from areal_fast.controller.weight_tracker import WeightTracker
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.wire.shards import ShardMetadata

TIMEOUTS = Timeouts(train_step=30.0, weight_update=20.0, rollout_stall=40.0, evaluate=50.0)


class Handle:
    def __init__(self, name: str):
        self.name, self.sent = name, []

    def send(self, message) -> None:
        self.sent.append(message)


class Restarts:
    """``restart_rollout``: a new handle per call; the first ``failures`` calls fail."""

    def __init__(self, failures: int = 0):
        self.failures, self.calls = failures, []

    def __call__(self, name: str) -> Handle:
        self.calls.append(name)
        if len(self.calls) <= self.failures:
            raise WorkerError(f"restarted {name!r} died at start", name, died=True)
        return Handle(name)


def make(tmp_path, restarts=None, max_restarts: int = 3, evals=None):
    """A recovery over two workers "a", "b" and a trainer; returns (recovery, scope)."""
    saves = PendingSaves(CheckpointManager(tmp_path / "checkpoints", every_steps=1))
    scope = RecoveryScope(
        Ledger(max_staleness=None, keep_finished=True),
        RolloutFleet([Handle("a"), Handle("b")]),
        WeightTracker(["a", "b"]),
        evals or StepEvals(),
        saves,
        "trainer",
    )
    config = RecoveryConfig(max_rollout_restarts=max_restarts)
    return Recovery(scope, restarts or Restarts(), config, TIMEOUTS), scope


def submit(ledger: Ledger, worker: str, spooled: bool = False, finish: bool = False) -> int:
    """One group on ``worker`` at version 0 (finished into a shard when ``finish``)."""
    gid = ledger.counts.submitted
    ledger.submit(msg.GroupRequest(gid, [1, 2], SamplingParams(n=2), gid), worker, 0)
    if finish:
        path = f"/spool/{gid}" if spooled else None
        shard = ShardMetadata(worker, "127.0.0.1:1", gid, 2, 0, {}, path)
        ledger.finish(msg.GroupDone(shard, gid, [1.0, 0.0], [3, 4], ["stop"] * 2, 0))
    return gid


def test_a_dead_worker_is_replaced_through_ledger_fleet_and_weights(tmp_path):
    restarts = Restarts()
    recovery, scope = make(tmp_path, restarts)
    running = submit(scope.ledger, "a")
    spooled = submit(scope.ledger, "a", spooled=True, finish=True)
    unspooled = submit(scope.ledger, "a", finish=True)
    other = submit(scope.ledger, "b")
    scope.weights.acknowledged("a", msg.WeightsUpdated(3, 0.1))
    old = scope.fleet.workers[0]
    new = recovery.on_worker_error(WorkerError("a died", "a", died=True), version=3)
    assert restarts.calls == ["a"] and new.name == "a" and new is not old
    assert scope.fleet.workers == [new, scope.fleet.workers[1]]
    assert scope.weights.acked == {"a": 0, "b": 0}
    ledger = scope.ledger
    assert [r.group_id for r in ledger.waiting()] == [running]  # submitted again later
    assert ledger.state(spooled) is State.READY and ledger.state(other) is State.RUNNING
    assert ledger.state(unspooled) is State.DROPPED
    assert ledger.counts.dropped == {"rollout_worker_died": 1}
    assert ledger.counts.resubmitted == 1 and ledger.counts.rollout_restarts == 1
    assert recovery.restarts_left == 2 and recovery.warming["a"][0] == 3
    assert new.sent == []  # catching up is the controller's (weights, cancel, evaluations)
    scope.weights.acknowledged("a", msg.WeightsUpdated(3, 0.1))
    recovery.end_warm_up("a")
    assert "a" not in recovery.warming and len(ledger.counts.recovery_seconds) == 1


def test_at_version_zero_the_new_worker_is_warm_at_once(tmp_path):
    recovery, scope = make(tmp_path)
    recovery.on_worker_error(WorkerError("b died", "b", died=True), version=0)
    assert recovery.warming == {} and len(scope.ledger.counts.recovery_seconds) == 1


def test_what_is_not_restarted(tmp_path):
    recovery, _ = make(tmp_path)
    failed = WorkerError("a failed", "a", died=False)  # raised an error: restarting won't help
    with pytest.raises(WorkerError, match="a failed"):
        recovery.on_worker_error(failed, 0)
    trainer = WorkerError("trainer died", "trainer", died=True)
    with pytest.raises(WorkerError, match="trainer died"):
        recovery.on_worker_error(trainer, 0)
    no_restarts, _ = make(tmp_path, max_restarts=0)
    with pytest.raises(WorkerError, match=r"no restart left: recovery.max_rollout_restarts = 0"):
        no_restarts.on_worker_error(WorkerError("a died", "a", died=True), 0)


def test_a_failed_restart_is_retried_while_restarts_are_left(tmp_path):
    restarts = Restarts(failures=1)
    recovery, scope = make(tmp_path, restarts, max_restarts=2)
    new = recovery.on_worker_error(WorkerError("a died", "a", died=True), 0)
    assert restarts.calls == ["a", "a"] and scope.fleet.workers[0] is new
    assert recovery.restarts_left == 0 and scope.ledger.counts.rollout_restarts == 2
    always = Restarts(failures=5)
    recovery, _ = make(tmp_path, always, max_restarts=2)
    with pytest.raises(WorkerError, match="restarted 'b' died at start"):
        recovery.on_worker_error(WorkerError("b died", "b", died=True), 0)
    assert always.calls == ["b", "b"]


def deadline_error(recovery: Recovery, version: int, last_step: float) -> str:
    recovery._checked = 0.0  # the check runs at most every DEADLINE_CHECK_SECONDS
    with pytest.raises(WorkerError) as caught:
        recovery.check_deadlines(version, last_step)
    return str(caught.value)


def test_each_deadline_names_its_worker(tmp_path):
    recovery, scope = make(tmp_path)
    now = time.monotonic()
    recovery.check_deadlines(version=0, last_step=now)  # nothing late
    # a rollout worker behind on weights, counted from the last step
    scope.weights.acknowledged("b", msg.WeightsUpdated(2, 0.1))
    assert deadline_error(recovery, 2, now - 21.0) == (
        "rollout worker 'a' did not load weights version 2 within timeouts.weight_update = 20 s"
    )
    scope.weights.acknowledged("a", msg.WeightsUpdated(2, 0.1))
    recovery.check_deadlines(2, now - 21.0)
    # a worker with running groups that finishes none
    submit(scope.ledger, "b")
    scope.fleet.progressed("b", now - 41.0)
    assert deadline_error(recovery, 2, now) == (
        "rollout worker 'b' finished no rollout within timeouts.rollout_stall = 40 s (1 running)"
    )
    scope.fleet.progressed("b", now)
    # a save the trainer has not answered
    tmp = scope.saves.after_step(2, {"version": 2})
    scope.saves.saving[tmp] = (2, now - 31.0)
    assert deadline_error(recovery, 2, now) == (
        f"trainer 'trainer' did not save its state into {tmp} within timeouts.train_step = 30 s"
    )
    # a batch in training past its deadline, counted from the later of its send and last step
    del scope.saves.saving[tmp]
    ledger = scope.ledger = Ledger(max_staleness=None)  # a ledger with no group running
    gid = submit(ledger, "b", spooled=True, finish=True)
    ledger.take_batch(1, 2, now - 31.0)
    assert ledger.training and ledger.training[0].group_ids == [gid]
    assert deadline_error(recovery, 2, now - 40.0) == (
        "trainer 'trainer' did not finish step 3 within timeouts.train_step = 30 s"
    )
    recovery.check_deadlines(2, now)  # the last step was just now


def test_a_step_that_ends_between_two_scans_is_held_to_its_deadline(tmp_path):
    """The deadline scan runs at most every DEADLINE_CHECK_SECONDS; the step's reply is checked
    against the same deadline when it arrives, whether or not a scan saw it running."""
    recovery, scope = make(tmp_path)
    now = time.monotonic()
    recovery.check_deadlines(2, now)  # a scan just ran: the next ones are skipped for a while
    ledger = scope.ledger = Ledger(max_staleness=None)
    submit(ledger, "b", spooled=True, finish=True)
    ledger.take_batch(1, 2, now - 31.0)
    recovery.check_deadlines(2, now - 40.0)  # too soon after the last scan: nothing checked
    recovery.check_step_time(2, now - 40.0, now - 2.0)  # 29 s after the send: in time
    with pytest.raises(WorkerError) as info:
        recovery.check_step_time(2, now - 40.0, now)
    assert str(info.value) == (
        "trainer 'trainer' did not finish step 3 within timeouts.train_step = 30 s"
    )
    assert info.value.worker == "trainer"
    recovery.check_step_time(2, now - 1.0, now)  # counted from the later last step


def test_a_restarted_worker_that_never_loads_weights(tmp_path):
    recovery, scope = make(tmp_path)
    scope.weights.acknowledged("b", msg.WeightsUpdated(4, 0.1))
    recovery.on_worker_error(WorkerError("a died", "a", died=True), version=4)
    recovery.check_deadlines(4, time.monotonic() - 100.0)  # warming: not late yet
    version, died_at, _ = recovery.warming["a"]
    recovery.warming["a"] = (version, died_at, time.monotonic() - 21.0)
    assert deadline_error(recovery, 4, time.monotonic()) == (
        "restarted rollout worker 'a' did not load weights within timeouts.weight_update = 20 s"
    )


def test_a_worker_evaluating_is_excused_from_the_weight_deadline(tmp_path):
    requests = [msg.GroupRequest(-1, [1], SamplingParams(n=1), 0, "1", "u0")]
    evals = StepEvals(every_steps=1, requests=requests, timeout=50.0)
    recovery, scope = make(tmp_path, evals=evals)
    evals.start(1, scope.fleet)  # both owe an answer
    recovery.check_deadlines(2, time.monotonic() - 21.0)
    not_evaluating, _ = make(tmp_path)
    assert deadline_error(not_evaluating, 2, time.monotonic() - 21.0).startswith(
        "rollout worker 'a' did not load weights version 2"
    )


def test_resume_restores_the_ledger_and_returns_where_to_continue(tmp_path):
    recovery, scope = make(tmp_path)
    counts = {
        "rollouts_submitted": 12,
        "rollouts_trained": 8,
        "rollouts_dropped": {"stale": 1},
        "sample_interruptions": 0,
        "stale_dropped_completion_tokens": 7,
    }
    state = {"version": 4, "counts": counts, "pending_groups": 3, "elapsed_seconds": 61.5}
    assert recovery.resume(state) == ResumePoint(version=4, elapsed_seconds=61.5)
    assert scope.ledger.counts.submitted == 12 and scope.ledger.counts.trained == 8
    assert scope.ledger.counts.dropped == {"stale": 1, "pending_at_checkpoint": 3}
