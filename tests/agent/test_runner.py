"""Faults around agent sessions: misbehaving agents, odd data, the end of training.

The runner tests use a fake chat backend (no tokenizer, no engine) so that only the runner's
behaviour is under test; the rollout-worker tests drive :class:`RolloutWorker`'s handlers
in-process with a fake engine, connection and agent workload.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass

import numpy
import pytest

from areal_fast.agent.bridge import EngineBridge
from areal_fast.agent.client import SessionDefaults
from areal_fast.agent.protocol import BadRequest, chat_completion, choice
from areal_fast.agent.runner import AgentConfig, AgentRunner, GroupSessions, load_agent
from areal_fast.agent.session import ModelCall, Session
from areal_fast.agent.store import TrajectoryConfig, TrajectoryStoreError, read_trajectories
from areal_fast.agent.workload import AgentWorkload, AgentWorkloadSpec
from areal_fast.controller.async_loop import AsyncController, RunPlan
from areal_fast.controller.step_record import agent_totals
from areal_fast.rollout.config import RolloutConfig
from areal_fast.rollout.engine import GenOutput, SamplingParams
from areal_fast.wire import messages as msg
from areal_fast.wire.shards import ShardMetadata
from areal_fast.workers.rollout_worker import RolloutWorker, RolloutWorkerSpec

QUESTION = [{"role": "user", "content": "6*7?"}]


class EchoBackend:
    """Answers every request of a running session with "42" and records one call."""

    async def complete(self, session: Session, request, defaults) -> dict:
        if session.status != "running":
            raise BadRequest("the session has ended")
        number, session.next_call = session.next_call, session.next_call + 1
        rid = f"chatcmpl-{session.session_id[:8]}-{number}"
        session.calls.append(
            ModelCall(f"{rid}:0", [1, 2], [3], [-0.5], [0], "stop", request.messages, "42")
        )
        return chat_completion(rid, "m", [choice(0, "42", [], "stop", None)], 2, 1)


def start_runner(agent, config=None, grace=10.0):
    """A started runner over :class:`EchoBackend` and the queue its groups arrive on."""
    done: queue.Queue = queue.Queue()
    runner = AgentRunner(
        agent,
        lambda loop: (EchoBackend(), None),
        config or AgentConfig(timeout=30.0),
        done.put,
        grace=grace,
    )
    runner.start()
    return runner, done


def run_groups(agent, groups, n=3, **kwargs) -> list[GroupSessions]:
    """Run ``groups`` [(group_id, data)] of ``n`` sessions; returns the reported groups."""
    runner, done = start_runner(agent, **kwargs)
    try:
        for group_id, data in groups:
            runner.submit_group(group_id, data, n, 7, SessionDefaults(max_tokens=8))
        return sorted((done.get(timeout=20) for _ in groups), key=lambda g: g.group_id)
    finally:
        runner.close()


# ------------------------------------------------------------------------ session data


async def appending_agent(data, client):
    seen = (len(data["messages"]), data["meta"]["count"])
    data["messages"].append({"role": "assistant", "content": "mine"})
    data["meta"]["count"] += 1
    await client.chat.completions.create(messages=QUESTION)  # the others run meanwhile
    return float(10 * seen[0] + seen[1])


def test_sibling_sessions_get_their_own_copy_of_data():
    data = {"messages": [{"role": "user", "content": "hi"}], "meta": {"count": 0}}
    [group] = run_groups(appending_agent, [(0, data)], n=4)
    # every session saw one message and count 0: none saw another's changes
    assert [s.reward for s in group.sessions] == [10.0] * 4
    assert all(
        s.data == {"messages": [{"role": "user", "content": "hi"}], "meta": {"count": 0}}
        for s in group.sessions
    )
    assert data == {"messages": [{"role": "user", "content": "hi"}], "meta": {"count": 0}}


async def typed_agent(data, client):
    await client.chat.completions.create(messages=QUESTION)
    return 1.0 if type(data["answer"]) is numpy.int64 and data["answer"] == 3 else 0.0


def test_values_json_cannot_hold_reach_the_agent_intact():
    [group] = run_groups(typed_agent, [(0, {"answer": numpy.int64(3), "uid": "u1"})], n=2)
    assert [(s.status, s.reward) for s in group.sessions] == [("done", 1.0)] * 2
    assert [s.data for s in group.sessions] == [{"answer": "3", "uid": "u1"}] * 2


# ------------------------------------------------------------------------------- hangs


def test_a_session_that_ignores_cancellation_does_not_hold_its_group():
    release = asyncio.Event()  # bound to the runner's loop on first use
    order = itertools.count()

    async def agent(data, client):
        await client.chat.completions.create(messages=QUESTION)
        if next(order) == 0:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # ignores its cancellation at agent.timeout
            await release.wait()
        return 1.0

    runner, done = start_runner(agent, AgentConfig(timeout=0.2), grace=0.2)
    try:
        runner.submit_group(5, {"question": "q"}, 3, 7, SessionDefaults(max_tokens=8))
        group = done.get(timeout=20)
        runner.loop.call_soon_threadsafe(release.set)  # its late result changes nothing
        stuck, *others = group.sessions
        assert (stuck.status, stuck.drop_reason, stuck.reward) == ("dropped", "timeout", None)
        assert "agent.timeout = 0.2 s and ignored cancellation for 0.2 s" in stuck.error
        assert [(s.status, s.reward) for s in others] == [("done", 1.0)] * 2
        assert runner.tasks == {}
    finally:
        runner.close()
    assert (stuck.status, stuck.reward, len(stuck.calls)) == ("dropped", None, 1)


async def good_agent(data, client):
    await client.chat.completions.create(messages=QUESTION)
    return 1.0


def test_a_group_whose_sessions_cannot_start_is_reported_dropped(caplog):
    uncopyable = {"question": "q", "lock": threading.Lock()}  # deepcopy raises TypeError
    with caplog.at_level(logging.WARNING, logger="areal_fast.agent"):
        bad, good = run_groups(good_agent, [(0, uncopyable), (1, {"question": "q"})], n=2)
    assert [(s.status, s.drop_reason) for s in bad.sessions] == [("dropped", "agent_error")] * 2
    assert all(s.error.startswith("the sessions could not start: TypeError:") for s in bad.sessions)
    assert all(s.group_id == 0 and s.data["question"] == "q" for s in bad.sessions)
    assert [s.reward for s in good.sessions] == [1.0, 1.0]  # the loop goes on
    assert sum("could not start" in r.message for r in caplog.records) == 1


def test_a_blocked_event_loop_fails_cancel_all_with_one_line():
    entered, unblock = threading.Event(), threading.Event()

    async def blocking(data, client):
        entered.set()
        unblock.wait(30)  # blocks the whole loop (what an agent must not do)
        return 1.0

    runner, _ = start_runner(blocking)
    try:
        runner.submit_group(0, {}, 1, 7, SessionDefaults())
        assert entered.wait(20)
        with pytest.raises(RuntimeError) as exc:
            runner.cancel_all(timeout=0.5)
        assert str(exc.value).startswith(
            "agent sessions did not stop within 0.5 s of being "
            "cancelled: an agent blocks the event loop"
        )
        assert "\n" not in str(exc.value)
        unblock.set()
        runner.cancel_all(timeout=20)  # the loop is free again
    finally:
        unblock.set()
        runner.close()
    assert not runner.thread.is_alive()


# ------------------------------------------------------------------------- load_agent


class ExplodingAgent:
    def __init__(self):
        raise RuntimeError("built in the controller")

    async def run_agent_return_reward(self, data, client):
        return 1.0


class NoDataAgent:
    async def run_agent_return_reward(self):
        return 1.0


class StaticAgent:
    @staticmethod
    async def run_agent_return_reward(data):
        return 1.0


class SyncAgent:
    def run_agent_return_reward(self, data):
        return 1.0


def test_load_agent_checks_a_class_without_constructing_it():
    assert load_agent("test_runner:ExplodingAgent", construct=False) is ExplodingAgent
    assert load_agent("test_runner:StaticAgent", construct=False) is StaticAgent
    assert load_agent("test_runner:good_agent", construct=False) is good_agent
    with pytest.raises(ValueError, match="cannot construct ExplodingAgent"):
        load_agent("test_runner:ExplodingAgent")
    with pytest.raises(ValueError, match=r"must take \(self, data\) or \(self, data, client\)"):
        load_agent("test_runner:NoDataAgent", construct=False)
    with pytest.raises(ValueError, match="not an async function"):
        load_agent("test_runner:SyncAgent", construct=False)
    with pytest.raises(ValueError, match="has no 'Missing'"):
        load_agent("test_runner:Missing", construct=False)


# ----------------------------------------------------------------- workload: finishing


def _call(session: Session, request: int, parent=None) -> ModelCall:
    return ModelCall(
        f"chatcmpl-{session.session_id[:8]}-{request}:0",
        [1, 2],
        [3, 4],
        [-0.1, -0.2],
        [0, 0],
        "stop",
        [{"role": "user", "content": "q"}],
        "hi",
        parent=parent,
    )


def _group() -> GroupSessions:
    done, timed_out, cancelled, silent = (Session(group_id=9) for _ in range(4))
    done.calls = [_call(done, 0)]
    done.finish(1.0)
    timed_out.calls = [_call(timed_out, 0)]
    timed_out.drop("timeout", "did not finish within agent.timeout = 1 s")
    # its second request starts a fresh prompt (an unlinked call)
    cancelled.calls = [_call(cancelled, 0), _call(cancelled, 1)]
    cancelled.drop("cancelled", "cancelled by the controller")
    silent.drop("no_calls", "the agent returned a reward without calling the model")
    return GroupSessions(9, [done, timed_out, cancelled, silent])


def _workload(tiny_model_dir, tmp_path, **agent) -> AgentWorkload:
    spec = AgentWorkloadSpec(
        AgentConfig(path="test_runner:good_agent", **agent),
        str(tiny_model_dir),
        TrajectoryConfig(
            enabled=True, directory=str(tmp_path), compression="none", write_threads=1
        ),
    )
    return AgentWorkload(spec, None, itertools.count(), "w", lambda group: None)


@pytest.mark.parametrize("dropped_reward", [None, 0.0, -0.5])
def test_dropped_reward_trains_dropped_sessions_that_called_the_model(
    tiny_model_dir, tmp_path, dropped_reward
):
    workload = _workload(tiny_model_dir, tmp_path, dropped_reward=dropped_reward)
    group = _group()
    try:
        trajectories, stats = workload.finish(group)
        workload.flush(30)
    finally:
        workload.close()
    rewards = sorted(t.reward for t in trajectories)
    if dropped_reward is None:
        assert rewards == [1.0]
        assert stats["agent/dropped_trained"] == 0.0  # present in every report
    else:  # the timed-out session too; not the cancelled one, not the one without calls
        assert rewards == [dropped_reward, 1.0]
        assert stats["agent/dropped_trained"] == 1.0
    assert stats["agent/sessions"] == 4.0 and stats["agent/sessions_dropped"] == 3.0
    assert stats["agent/unlinked_calls"] == 1.0 and stats["agent/resumed_calls"] == 0.0
    # the record and the session keep how the session ended
    records = {r["session_id"]: r for r in read_trajectories(tmp_path)}
    timed_out = group.sessions[1]
    assert (timed_out.status, timed_out.reward) == ("dropped", None)
    record = records[timed_out.session_id]
    assert (record["status"], record["drop_reason"], record["reward"]) == (
        "dropped",
        "timeout",
        None,
    )
    assert len(records) == 4


def test_agent_config_checks_dropped_reward():
    with pytest.raises(ValueError, match="agent.dropped_reward = nan must be a finite"):
        AgentConfig(dropped_reward=float("nan"))
    with pytest.raises(ValueError, match="agent.max_tokens_cap = 0 must be >= 1"):
        AgentConfig(max_tokens_cap=0)


class AbortOnce:
    """Engine that aborts a fresh request after one token and finishes resumed ones."""

    def __init__(self):
        self.outputs = []

    def submit(self, requests, front=False):
        for r in requests:
            n = r.max_new_tokens if r.offset else 1
            self.outputs.append(
                GenOutput(
                    r.rid, [5] * n, [-0.1] * n, [r.offset] * n, "length" if r.offset else "abort"
                )
            )

    def get_outputs(self, timeout):
        out, self.outputs = self.outputs, []
        return out


def test_bridge_counts_resumed_calls():
    async def main():
        bridge = EngineBridge(AbortOnce(), asyncio.get_running_loop())
        tasks = [asyncio.create_task(bridge.generate([1], 3, 1.0, 1.0, s)) for s in (1, 2)]
        await asyncio.sleep(0)
        while not all(t.done() for t in tasks):
            bridge.pump(0)
            await asyncio.sleep(0)
        return bridge, [t.result() for t in tasks]

    bridge, results = asyncio.run(main())
    assert bridge.resumed == 2
    assert [r.output_ids for r in results] == [[5, 5, 5]] * 2


# ------------------------------------------------------------- rollout worker handlers


class FakeEngine:
    def __init__(self, fail_close: bool):
        self.fail_close, self.closed, self.stop = fail_close, False, threading.Event()

    def start(self):
        pass

    def submit(self, requests, front=False):
        pass

    def get_outputs(self, timeout):
        self.stop.wait(timeout)
        return []

    def pause(self, timeout, keep=None):
        pass

    def resume(self):
        pass

    def drop_queued(self):
        return 0

    def close(self):
        self.closed = True
        self.stop.set()
        if self.fail_close:
            raise RuntimeError("engine close failed")


@dataclass
class FakeEngineFactory:
    fail_close: bool = False

    def __call__(self):
        return FakeEngine(self.fail_close), lambda ids: ""


class FakeConn:
    """The worker's end of the pipe: ``incoming`` are received in order, then EOF."""

    def __init__(self, *incoming):
        self.incoming, self.sent = list(incoming), []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        if not self.incoming:
            raise EOFError
        return self.incoming.pop(0)


class FakeAgent:
    def __init__(self, flush_error=None, close_error=None):
        self.flush_error, self.close_error = flush_error, close_error
        self.submitted, self.finished, self.flushed, self.closed = [], [], 0, False
        self.resumed = 0

    def start(self):
        pass

    def submit(self, request):
        self.submitted.append(request.group_id)

    def route(self, out):
        return None

    def finish(self, group):
        self.finished.append(group.group_id)
        return [], {"agent/resumed_calls": float(self.resumed)}

    def cancel_all(self):
        return 99  # what the agent loop still had: not what the worker reports

    def flush(self, timeout):
        if self.flush_error is not None:
            raise self.flush_error
        self.flushed += 1

    def close(self):
        self.closed = True
        if self.close_error is not None:
            raise self.close_error


@pytest.fixture
def make_worker():
    made = []

    def make(conn=None, agent=None, fail_close=False):
        worker = RolloutWorker(
            "rollout-0",
            conn or FakeConn(),
            RolloutWorkerSpec(FakeEngineFactory(fail_close), None),
            b"k" * 32,
        )
        worker.agent = agent or FakeAgent()
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.store.close()


def _request(group_id: int) -> msg.GroupRequest:
    return msg.GroupRequest(group_id, [1, 2], SamplingParams(n=2, max_new_tokens=4), group_id)


def test_agent_group_ending_after_cancel_all_is_not_reported(make_worker):
    worker = make_worker()
    worker._handle_control(msg.SubmitGroups([_request(0), _request(1), _request(2)]))
    worker.agent.resumed = 2
    worker._finish_agent_group(GroupSessions(0, []))
    worker._handle_control(msg.CancelAll())
    worker._finish_agent_group(GroupSessions(1, []))  # ended on the agent loop meanwhile
    worker._finish_agent_group(GroupSessions(2, []))
    done, cancelled = worker.conn.sent
    assert isinstance(done, msg.GroupDone) and done.group_id == 0 and done.interruptions == 2
    assert cancelled == msg.Cancelled(2)
    assert worker.agent.finished == [0] and worker.agent.flushed == 1
    assert worker.agent_groups == set()


def test_group_done_carries_the_resumed_calls_since_the_previous_one(make_worker):
    worker = make_worker()
    worker._handle_control(msg.SubmitGroups([_request(0), _request(1)]))
    for group_id, resumed in ((0, 3), (1, 5)):
        worker.agent.resumed = resumed
        worker._finish_agent_group(GroupSessions(group_id, []))
    assert [m.interruptions for m in worker.conn.sent] == [3, 2]


def test_a_store_failure_at_the_end_fails_the_worker_before_cancelled(make_worker):
    error = TrajectoryStoreError(
        "trajectory writer could not write /x/w-0.jsonl: OSError: disk full; 3 records not written"
    )
    worker = make_worker(agent=FakeAgent(flush_error=error))
    worker._handle_control(msg.SubmitGroups([_request(0)]))
    with pytest.raises(TrajectoryStoreError, match="disk full"):
        worker._handle_control(msg.CancelAll())
    assert worker.conn.sent == []


def test_shutdown_closes_everything_and_raises_the_first_error(make_worker, caplog):
    agent = FakeAgent(close_error=RuntimeError("agent close failed"))
    worker = make_worker(FakeConn(msg.Shutdown()), agent, fail_close=True)
    with caplog.at_level(logging.ERROR, logger="areal_fast.rollout_worker"):
        with pytest.raises(RuntimeError, match="agent close failed"):
            worker.run()
    assert agent.closed and worker.engine.closed and worker.store._closed
    assert isinstance(worker.conn.sent[0], msg.WorkerReady)
    assert any(
        "closing the engine failed: RuntimeError: engine close failed" in r.message
        for r in caplog.records
    )


# ------------------------------------------------------------------------- controller


@dataclass
class FakeHandle:
    name: str

    def __post_init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def _controller():
    worker = FakeHandle("rollout-0")
    controller = AsyncController(
        [worker],
        FakeHandle("trainer"),
        (),
        lambda gid: None,
        RunPlan(4, 2),
        RolloutConfig(max_head_offpolicyness=1, max_concurrent_rollouts=4),
        lambda record: None,
    )
    return controller, worker


def _done(group_id: int, node: str = "rollout-0") -> msg.GroupDone:
    shard = ShardMetadata(node, "127.0.0.1:1", group_id, 2, 0, {})
    return msg.GroupDone(shard, group_id, [1.0, 0.0], [3, 3], ["stop", "stop"], 0)


def test_controller_ignores_a_group_it_is_not_running(caplog):
    controller, worker = _controller()
    controller.ledger.submit(msg.GroupRequest(0, [1], SamplingParams(n=2), 0), "rollout-0", 0)
    with caplog.at_level(logging.WARNING, logger="areal_fast.controller"):
        controller._on_message(worker, _done(7))  # e.g. finished after CancelAll
    assert worker.sent == [msg.DropShards([7])]
    assert controller.ledger.running_on("rollout-0") == 1 and controller.ledger.ready_ids() == []
    assert sum(controller.ledger.counts.dropped.values()) == 0
    assert any("group 7" in r.message for r in caplog.records)
    controller._on_message(worker, _done(0))
    assert controller.ledger.running_on("rollout-0") == 0 and controller.ledger.ready_ids() == [0]


def test_compression_ratio_is_recomputed_from_summed_bytes():
    controller, _ = _controller()
    controller.agent_stats = {
        "a": {
            "trajectory/raw_bytes": 1000.0,
            "trajectory/stored_bytes": 100.0,
            "trajectory/compression_ratio": 10.0,
            "agent/sessions": 4.0,
        },
        "b": {
            "trajectory/raw_bytes": 300.0,
            "trajectory/stored_bytes": 100.0,
            "trajectory/compression_ratio": 3.0,
            "agent/sessions": 2.0,
        },
    }
    totals = agent_totals(controller.agent_stats)
    assert totals["trajectory/compression_ratio"] == 6.5
    assert totals["agent/sessions"] == 6.0 and totals["trajectory/raw_bytes"] == 1300.0
