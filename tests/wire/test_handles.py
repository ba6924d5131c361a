"""MessageWaiter: a worker's death never discards messages already read from others."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from areal_fast.wire import messages as msg
from areal_fast.wire.codec import MessageChannel
from areal_fast.wire.handles import MessageWaiter, WorkerError, WorkerHandle


class _PipeHandle(WorkerHandle):
    def __init__(self, name):
        ours, theirs = mp.Pipe(duplex=True)
        self.name, self.conn, self.peer = name, MessageChannel(ours), MessageChannel(theirs)

    def stop(self, timeout=1.0):
        self.conn.close()


def test_death_is_raised_after_the_messages_of_the_same_call():
    trainer, rollout = _PipeHandle("trainer"), _PipeHandle("rollout-0")
    waiter = MessageWaiter([trainer, rollout])
    trainer.peer.send(msg.StepDone(3, {"loss": 0.5}, [1, 2]))
    rollout.peer.close()  # the rollout worker is gone: end of file on its channel
    got = waiter.wait(1.0, "at step 3")
    assert [(h.name, type(m).__name__, m.version) for h, m in got] == [("trainer", "StepDone", 3)]
    with pytest.raises(WorkerError, match="'rollout-0'.*died.*at step 3") as info:
        waiter.wait(1.0, "at step 3")
    assert info.value.worker == "rollout-0" and info.value.died


def test_failure_message_names_the_worker():
    handle = _PipeHandle("rollout-1")
    waiter = MessageWaiter([handle])
    handle.peer.send(msg.WorkerFailed("rollout-1", "RuntimeError: boom"))
    with pytest.raises(WorkerError, match="'rollout-1' failed while testing: RuntimeError: boom"):
        waiter.wait(1.0, "while testing")
