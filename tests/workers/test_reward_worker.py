"""A rollout worker with ``reward.path``: the reward runs in its pool, off the worker's main
loop, so a weight update is acknowledged while a slow reward is still running; failed rewards
reach the controller as counted drop reasons; held-out records use the same reward."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass

import pytest

from areal_fast.controller.acceptance import Acceptance
from areal_fast.controller.ledger import Ledger
from areal_fast.data.user_reward import RewardConfig
from areal_fast.rollout.engine import GenOutput, SamplingParams
from areal_fast.sync.shared_memory import WeightBufferSpec
from areal_fast.wire import messages as msg
from areal_fast.workers.rollout_worker import RolloutWorker, RolloutWorkerSpec

REWARD = """
import time

def reward(completion, sample):
    if completion == "slow":
        time.sleep(2.0)
    if completion == "bad":
        raise KeyError("tests")
    return 1.0 if completion == sample["answer"] else 0.0
"""
WORDS = ["", "slow", "bad", "7", "8"]  # token i decodes to WORDS[i]


class InstantEngine:
    """Finishes every request at once with the single token its seed names."""

    def __init__(self):
        self.out: queue.Queue = queue.Queue()
        self.versions: list[int] = []

    def start(self):
        pass

    def submit(self, requests, front=False):
        for r in requests:
            token = r.seed % len(WORDS)
            self.out.put(GenOutput(r.rid, [token], [-0.5], [len(self.versions)], "stop"))

    def get_outputs(self, timeout):
        try:
            return [self.out.get(timeout=timeout)]
        except queue.Empty:
            return []

    def pause(self, timeout, keep=None):
        pass

    def resume(self):
        pass

    def update_weights_from_buffer(self, spec, version):
        self.versions.append(version)

    def drop_queued(self):
        return 0

    def close(self):
        pass


@dataclass
class InstantEngineFactory:
    def __call__(self):
        return InstantEngine(), lambda ids: "".join(WORDS[i] for i in ids)


class QueueConn:
    """The worker's end of its pipe: ``incoming`` blocks; what it sends goes to ``sent``."""

    def __init__(self):
        self.incoming: queue.Queue = queue.Queue()
        self.sent: queue.Queue = queue.Queue()

    def send(self, message):
        self.sent.put((time.monotonic(), message))

    def recv(self):
        return self.incoming.get()


@pytest.fixture
def worker(tmp_path, monkeypatch):
    (tmp_path / "verifier.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    made = []

    def make(**reward):
        spec = RolloutWorkerSpec(
            InstantEngineFactory(), None, reward=RewardConfig("verifier.py:reward", **reward)
        )
        w = RolloutWorker("rollout-0", QueueConn(), spec, b"k" * 32)
        thread = threading.Thread(target=w.run, daemon=True)
        thread.start()
        made.append((w, thread))
        assert isinstance(_next(w), msg.WorkerReady)
        return w

    yield make
    for w, thread in made:
        w.conn.incoming.put(msg.Shutdown())
        thread.join(10)
        assert not thread.is_alive()


def _next(w: RolloutWorker, timeout: float = 10.0):
    return w.conn.sent.get(timeout=timeout)[1]


def _group(group_id: int, seeds_word: int, n: int = 2, answer: str = "7") -> msg.GroupRequest:
    """A group whose samples all decode to WORDS[seeds_word] (the engine reads the seed)."""
    from areal_fast.rollout.engine import sample_seed

    seed = next(
        s for s in range(10_000) if all(sample_seed(s, i) % 5 == seeds_word for i in range(n))
    )
    return msg.GroupRequest(
        group_id, [1, 2], SamplingParams(n=n, max_new_tokens=4), seed, answer, f"uid-{group_id}"
    )


def test_weight_update_is_acknowledged_while_a_slow_reward_runs(worker):
    w = worker(timeout=10.0)
    start = time.monotonic()
    w.conn.incoming.put(msg.SubmitGroups([_group(0, WORDS.index("slow"))]))
    time.sleep(0.2)  # the group has finished generating: its reward sleeps 2 s in the pool
    w.conn.incoming.put(msg.UpdateWeights(1, WeightBufferSpec("/nonexistent", 0, ())))
    acked_at, acked = w.conn.sent.get(timeout=10)
    assert isinstance(acked, msg.WeightsUpdated) and acked.version == 1
    assert acked_at - start < 1.0  # well inside any weight-update deadline; reward still asleep
    done_at, done = w.conn.sent.get(timeout=10)
    assert isinstance(done, msg.GroupDone) and done.group_id == 0
    assert done.rewards == [0.0, 0.0] and done.shard is not None and done.drop_reason == ""
    assert done_at - start >= 2.0
    assert w.engine.versions == [1]


def test_failed_reward_drops_the_group_with_a_counted_reason(worker):
    w = worker()
    w.conn.incoming.put(msg.SubmitGroups([_group(3, WORDS.index("bad"))]))
    done = _next(w)
    assert isinstance(done, msg.GroupDone) and done.group_id == 3
    assert (done.shard, done.rewards, done.drop_reason) == (None, [], "reward_error")
    assert done.completion_lengths == [1, 1]
    assert done.errors == [f"reward {w.spec.reward.path} on sample uid 'uid-3': KeyError: 'tests'"]
    # the controller's side: the ledger counts it as summary.json's rollouts_dropped
    ledger = Ledger(None)
    done = dataclasses.replace(done, group_id=0)  # the ledger's first group
    ledger.submit(_group(0, 0), "rollout-0", 0)
    acceptance = Acceptance(False, 1000, 32, max_reward_drops_in_a_row=2)
    ledger.finish(done, acceptance.drop_reason(done, stale=False))
    assert ledger.counts.as_dict()["rollouts_dropped"] == {"reward_error": 1}
    with pytest.raises(ValueError, match=r"^reward: the last 2 groups were all dropped"):
        acceptance.drop_reason(done, stale=False)


def test_on_error_zero_keeps_the_group(worker):
    w = worker(on_error="zero")
    w.conn.incoming.put(msg.SubmitGroups([_group(4, WORDS.index("bad"))]))
    done = _next(w)
    assert done.rewards == [0.0, 0.0] and done.shard is not None and done.drop_reason == ""


def test_evaluation_uses_the_reward(worker):
    w = worker()
    right, wrong = _group(-1, WORDS.index("7"), n=1), _group(-2, WORDS.index("8"), n=1)
    w.conn.incoming.put(msg.Evaluate([right, wrong]))
    done = _next(w)
    assert isinstance(done, msg.EvalDone)
    got = sorted((r["uid"], r["completion"], r["reward"], r["correct"]) for r in done.records)
    assert got == [("uid--1", "7", 1.0, True), ("uid--2", "8", 0.0, False)]


def test_a_group_cancelled_while_scored_is_not_reported(worker):
    w = worker(timeout=10.0)
    w.conn.incoming.put(msg.SubmitGroups([_group(5, WORDS.index("slow"))]))
    time.sleep(0.2)
    w.conn.incoming.put(msg.CancelAll())
    assert _next(w) == msg.Cancelled(1)
    with pytest.raises(queue.Empty):
        w.conn.sent.get(timeout=2.5)  # its reward ended meanwhile: ignored
