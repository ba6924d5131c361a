"""The controller's rollout workers: sends that tolerate a dead worker, a restarted worker
in the dead one's place, the cancel of a wind-down, shard deletion per worker."""

from __future__ import annotations

import logging

import pytest

from areal_fast.controller.fleet import RolloutFleet
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.wire.shards import ShardMetadata


class Handle:
    """A worker's handle that records what it is sent (or fails as told)."""

    def __init__(self, name: str, fails: WorkerError | None = None):
        self.name, self.sent, self.fails = name, [], fails

    def send(self, message) -> None:
        if self.fails is not None:
            raise self.fails
        self.sent.append(message)


def done(group_id: int, worker: str) -> msg.GroupDone:
    shard = ShardMetadata(worker, "127.0.0.1:1", group_id, 2, 0, {})
    return msg.GroupDone(shard, group_id, [1.0, 0.0], [3, 4], ["stop", "stop"], 0)


def test_send_logs_a_dead_worker_and_raises_other_failures(caplog):
    dead = Handle("a", WorkerError("worker 'a' is unreachable", "a", died=True))
    broken = Handle("b", WorkerError("encoding failed", "b", died=False))
    fleet = RolloutFleet([dead, broken])
    with caplog.at_level(logging.WARNING, "areal_fast.controller"):
        fleet.send(dead, msg.CancelAll())
    assert "worker 'a' is unreachable (while sending CancelAll)" in caplog.text
    with pytest.raises(WorkerError, match="encoding failed"):
        fleet.send(broken, msg.CancelAll())


def test_replace_keeps_the_order_and_restarts_the_progress_clock():
    fleet = RolloutFleet([Handle("a"), Handle("b"), Handle("c")])
    fleet.restart_clocks(10.0)
    fleet.progressed("a", 12.5)
    new = Handle("b")
    fleet.replace(new, died_at=20.0)
    assert fleet.names == ["a", "b", "c"] and fleet.workers[1] is new
    assert fleet.progress == {"a": 12.5, "b": 20.0, "c": 10.0}
    with pytest.raises(KeyError, match="no rollout worker named 'd'"):
        fleet.replace(Handle("d"), died_at=21.0)


def test_cancel_all_until_each_answers():
    fleet = RolloutFleet([Handle("a"), Handle("b")])
    fleet.cancel_all()
    assert fleet.cancelling == {"a", "b"}
    assert all(type(m) is msg.CancelAll for w in fleet.workers for m in w.sent)
    fleet.cancelled("b")
    fleet.cancelled("b")  # a second answer changes nothing
    assert fleet.cancelling == {"a"}


def test_drop_shards_one_message_per_holding_worker():
    a, b, c = Handle("a"), Handle("b"), Handle("c")
    fleet = RolloutFleet([a, b, c])
    fleet.drop_shards(done(g, w) for g, w in [(4, "b"), (1, "a"), (7, "b")])
    assert a.sent == [msg.DropShards([1])] and b.sent == [msg.DropShards([4, 7])]
    assert c.sent == []
    fleet.drop_shards([])  # nothing released: nothing sent
    assert len(a.sent) + len(b.sent) + len(c.sent) == 2
