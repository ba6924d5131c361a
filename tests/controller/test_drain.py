"""Draining the rollout workers with a stand-in for the controller's message handling (the
``pump``): an evaluation outside training, the end of training, and their deadlines."""

from __future__ import annotations

import time

import pytest

from areal_fast.controller.checkpoint_manager import PendingSaves
from areal_fast.controller.config import Timeouts
from areal_fast.controller.drain import Drain
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger
from areal_fast.controller.step_evals import StepEvals
from areal_fast.controller.weight_tracker import WeightTracker
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.wire.shards import ShardMetadata


class Handle:
    def __init__(self, name: str):
        self.name, self.sent = name, []

    def send(self, message) -> None:
        self.sent.append(message)


def requests(n: int) -> list[msg.GroupRequest]:
    params = SamplingParams(n=1, temperature=0.0)
    return [msg.GroupRequest(-1 - i, [1, 2], params, 0, "1", f"u{i}") for i in range(n)]


class Handling:
    """Stands in for the controller's message handling: each round (``pump``) runs
    ``answer`` (what the workers answered, set by each test) and records what it was for."""

    def __init__(self):
        self.doing: list[str] = []
        self.answer = lambda: None

    def pump(self, doing: str) -> None:
        self.doing.append(doing)
        self.answer()
        time.sleep(0.005)  # the controller's wait lasts up to 1 s


def make(timeouts: Timeouts | None = None) -> tuple[Drain, Handling]:
    """A drain over workers "a", "b", "c"."""
    handling = Handling()
    fleet = RolloutFleet([Handle("a"), Handle("b"), Handle("c")])
    ledger = Ledger(max_staleness=None, keep_finished=True)
    return Drain(ledger, fleet, handling.pump, timeouts or Timeouts()), handling


def test_evaluate_spreads_the_requests_and_orders_the_answers():
    drain, handling = make()
    answers = iter(["c", "a", "b"])
    owed_meanwhile = {}

    def step():  # one worker answers per round, uids as given, records out of order
        worker = next(answers)
        share = drain.shares[worker]
        drain.answered(worker, [{"uid": r.uid, "correct": True} for r in reversed(share)])
        owed_meanwhile[worker] = {n: drain.owed(n) for n in drain.fleet.names}

    handling.answer = step
    records = drain.evaluate(requests(5))
    assert [r["uid"] for r in records] == ["u0", "u1", "u2", "u3", "u4"]
    sent = {w.name: [r.uid for r in w.sent[0].groups] for w in drain.fleet.workers}
    assert sent == {"a": ["u0", "u3"], "b": ["u1", "u4"], "c": ["u2"]}
    assert all(w.sent[0].version is None for w in drain.fleet.workers)
    assert handling.doing == ["during evaluation"] * 3
    # after "c" answered: "a" and "b" would be sent their shares again on a restart
    after_c = owed_meanwhile["c"]
    assert after_c["c"] == [] and [r.uid for r in after_c["a"][0].groups] == ["u0", "u3"]
    assert drain.shares == {} and drain.owed("a") == []  # nothing owed after the evaluation


def test_evaluate_refuses_while_groups_run_and_names_a_late_worker():
    drain, _ = make(Timeouts(evaluate=0.05))
    drain.ledger.submit(msg.GroupRequest(0, [1], SamplingParams(n=2), 0), "a", 0)
    with pytest.raises(RuntimeError, match="before run"):
        drain.evaluate(requests(3))
    drain, handling = make(Timeouts(evaluate=0.05))

    def step():  # "b" never answers
        for name in ("a", "c"):
            drain.answered(name, [])

    handling.answer = step
    with pytest.raises(WorkerError, match="'b' did not finish evaluation within .* = 0.05 s"):
        drain.evaluate(requests(3))


def group_on(ledger: Ledger, worker: str, finish: bool) -> int:
    gid = ledger.counts.submitted
    ledger.submit(msg.GroupRequest(gid, [1, 2], SamplingParams(n=2), gid), worker, 0)
    if finish:
        shard = ShardMetadata(worker, "127.0.0.1:1", gid, 2, 0, {})
        ledger.finish(msg.GroupDone(shard, gid, [1.0, 0.0], [3, 4], ["stop"] * 2, 0))
    return gid


def test_wind_down_cancels_drops_and_waits_for_the_final_weights():
    drain, handling = make()
    weights = WeightTracker(drain.fleet.names)
    running, ready = group_on(drain.ledger, "a", False), group_on(drain.ledger, "b", True)
    rounds = []

    def step():  # each round one worker cancels and loads version 2
        name = ["a", "b", "c"][len(rounds)]
        rounds.append((name, drain.ledger.closing))
        drain.ledger.cancelled(name)
        drain.fleet.cancelled(name)
        weights.acknowledged(name, msg.WeightsUpdated(2, 0.1))

    handling.answer = step
    drain.wind_down(2, weights.acked, StepEvals(), PendingSaves(None))
    a, b, c = drain.fleet.workers
    assert a.sent == [msg.CancelAll()] and c.sent == [msg.CancelAll()]
    assert b.sent == [msg.DropShards([ready]), msg.CancelAll()]  # the unused group's shard
    assert rounds == [("a", True), ("b", True), ("c", True)]
    assert handling.doing == ["while winding down"] * 3
    assert not drain.ledger.closing and drain.ledger.live == 0
    assert drain.ledger.counts.dropped == {"unused_at_end": 1, "in_flight_at_end": 1}
    assert drain.ledger.finished[running].reason == "in_flight_at_end"


def test_wind_down_names_a_worker_that_keeps_old_weights():
    drain, handling = make(Timeouts(weight_update=0.05))
    weights = WeightTracker(drain.fleet.names)

    def step():  # everyone cancels; "c" stays on version 1
        for name in ("a", "b", "c"):
            drain.fleet.cancelled(name)
            weights.acknowledged(name, msg.WeightsUpdated(1 if name == "c" else 2, 0.1))

    handling.answer = step
    with pytest.raises(
        WorkerError,
        match="'c' did not cancel its rollouts and load weights version 2 within "
        "timeouts.weight_update = 0.05 s",
    ):
        drain.wind_down(2, weights.acked, StepEvals(), PendingSaves(None))
