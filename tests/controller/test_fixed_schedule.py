"""The reproducible run's plan (batches in data order, versions max(0, k − η), workers by
group id) and its dispatch: a worker told its next version only once its chunk is done, and a
replaced worker given its version and chunk while the trainer's slot still holds it (the runs
themselves: tests/launch/test_reproducible.py)."""

from types import SimpleNamespace

import pytest

from areal_fast.controller.fixed_dispatch import FixedDispatch
from areal_fast.controller.fixed_schedule import FixedSchedule
from areal_fast.controller.ledger import Ledger, LedgerError
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire import messages as msg


def test_schedule_batches_versions_and_workers():
    s = FixedSchedule(batch_size=3, eta=2, num_workers=2, total_steps=5)
    assert s.batch_ids(1) == [3, 4, 5] and s.batch_of(5) == 1
    assert [s.version_of(k) for k in range(5)] == [0, 0, 0, 1, 2]
    assert list(s.batches_under(0)) == [0, 1, 2] and list(s.batches_under(2)) == [4]
    assert list(s.batches_under(3)) == [] and s.last_version() == 2
    assert s.due(0, 1) == [1, 3, 5, 7] and s.due(1, 0) == [10]
    # every group of the run planned exactly once
    planned = [g for v in range(5) for w in range(2) for g in s.due(v, w)]
    assert sorted(planned) == list(range(15))
    with pytest.raises(ValueError, match="num_workers = 0"):
        FixedSchedule(3, 2, 0, 5)


# ---------------------------------------------------------------------------- dispatch
class _Fleet:
    """The part of RolloutFleet the dispatch uses: names, workers, send (recorded)."""

    def __init__(self, n: int):
        self.workers = [SimpleNamespace(name=f"rollout-{i}") for i in range(n)]
        self.names = [w.name for w in self.workers]
        self.sent: list[tuple[str, object]] = []

    def send(self, worker, message):
        self.sent.append((worker.name, message))


def _dispatch(eta=2, slots=3):
    schedule = FixedSchedule(batch_size=2, eta=eta, num_workers=2, total_steps=6)
    fleet, ledger = _Fleet(2), Ledger(max_staleness=None, ordered=False)
    request = lambda g: msg.GroupRequest(g, [1], SamplingParams(n=2), g)  # noqa: E731
    buffers = tuple(f"slot-{i}" for i in range(slots))
    return FixedDispatch(schedule, fleet, ledger, request, buffers), fleet, ledger


def _finish(ledger, group_ids):
    for g in group_ids:
        ledger.finish(msg.GroupDone(None, g, [0.0, 0.0], [1, 1], ["stop"] * 2, 0))


def _sent(fleet):
    out = [(name, type(m).__name__, getattr(m, "version", None)) for name, m in fleet.sent]
    fleet.sent.clear()
    return out


def test_dispatch_holds_a_worker_until_its_chunk_is_done():
    dispatch, fleet, ledger = _dispatch()
    dispatch.start()  # version 0: batches 0, 1, 2 (groups 0-5), odd ids on rollout-1
    assert [[r.group_id for r in m.groups] for _, m in fleet.sent] == [[0, 2, 4], [1, 3, 5]]
    fleet.sent.clear()
    worker = fleet.workers[1]
    _finish(ledger, [1, 3])
    dispatch.advance(worker, 1)  # group 5 still runs: not told version 1
    assert _sent(fleet) == [] and dispatch.serving("rollout-1") == 0
    _finish(ledger, [5])
    dispatch.advance(worker, 1)  # batch 3 (groups 6, 7) under version 1: group 7 here
    assert _sent(fleet) == [("rollout-1", "UpdateWeights", 1), ("rollout-1", "SubmitGroups", None)]


def test_a_replaced_worker_gets_its_version_and_whole_chunk_while_its_slot_holds_it():
    dispatch, fleet, ledger = _dispatch()
    dispatch.start()
    _finish(ledger, [1, 3, 5])
    dispatch.advance(fleet.workers[1], 1)  # told 1, chunk [7]
    _finish(ledger, [0, 2])
    fleet.sent.clear()
    ledger.requeue("rollout-1")  # died with group 7 running
    dispatch.restarted(fleet.workers[1], version=2, newest=3)  # slot 1 % 3 still holds 1
    assert [(n, type(m).__name__, getattr(m, "version", None)) for n, m in fleet.sent] == [
        ("rollout-1", "UpdateWeights", 1),
        ("rollout-1", "SubmitGroups", None),
    ]
    assert fleet.sent[0][1].buffer == "slot-1" and ledger.running_on("rollout-1") == 1


def test_a_replaced_worker_whose_slot_was_overwritten_redoes_nothing():
    dispatch, fleet, ledger = _dispatch()
    dispatch.start()
    _finish(ledger, [1, 3, 5])
    dispatch.advance(fleet.workers[1], 1)
    _finish(ledger, [7])  # its chunk of version 1 done, then it died
    fleet.sent.clear()
    ledger.requeue("rollout-1")
    dispatch.restarted(fleet.workers[1], version=2, newest=4)  # slot 1 holds version 4
    # not version 1 (gone) and no replay: the next version, with its chunk (batch 4)
    assert _sent(fleet) == [("rollout-1", "UpdateWeights", 2), ("rollout-1", "SubmitGroups", None)]
    assert not dispatch.is_replay("rollout-1", 7)


def test_an_unfinished_chunk_whose_slot_was_overwritten_is_an_error():
    dispatch, fleet, ledger = _dispatch()
    dispatch.start()
    _finish(ledger, [1, 3, 5])
    dispatch.advance(fleet.workers[1], 1)
    ledger.requeue("rollout-1")  # group 7 unfinished: the trainer could not have reached 4
    with pytest.raises(LedgerError, match="'rollout-1' restarted with groups of version 1"):
        dispatch.restarted(fleet.workers[1], version=2, newest=4)
