"""User reward functions (``reward.*``): loading by path, the bad-input errors, calling sync /
async / batched rewards, and the thread and process pools with their failure handling."""

from __future__ import annotations

import math
import queue
import time

import pytest

from areal_fast.data.user_reward import (
    RewardConfig,
    RewardValueError,
    batched,
    is_batched,
    load_reward,
    resolve_path,
    score,
)
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.worker_specs import check_reward, cluster_spec
from areal_fast.workers.reward_pool import GroupScores, RewardPool

REWARDS = """
import asyncio
import math
import time

from areal_fast.data.user_reward import batched


def exact(completion, sample):
    return 1.0 if completion.strip() == sample["answer"] else 0.0


async def exact_async(completion, sample):
    await asyncio.sleep(0)
    return 1.0 if completion.strip() == sample["answer"] else 0.0


@batched
def lengths(completions, samples):
    return [float(len(c)) for c in completions]


@batched
async def lengths_async(completions, samples):
    return [float(len(c)) for c in completions]


def boom(completion, sample):
    if completion == "bad":
        raise ValueError("cannot parse " + completion)
    return 1.0


def slow(completion, sample):
    if completion == "slow":
        time.sleep(float(sample.get("sleep", 30)))
    return 1.0


def nan(completion, sample):
    return math.nan if completion == "nan" else 1.0


def flag(completion, sample):
    return completion == "yes"


def one_argument(completion):
    return 1.0


def three_required(completion, sample, extra):
    return 1.0


NOT_CALLABLE = 3
"""


@pytest.fixture
def rewards_file(tmp_path, monkeypatch):
    """``rewards.py`` in a temporary working directory (its path is relative to it)."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return "rewards.py"


def _samples(n: int, **extra) -> list[dict]:
    return [{"uid": "u7", "answer": "42", **extra} for _ in range(n)]


# ------------------------------------------------------------------------------ loading


def test_file_path_relative_to_the_working_directory(rewards_file):
    fn = load_reward(f"{rewards_file}:exact")
    assert fn(" 42 ", {"answer": "42"}) == 1.0 and fn("41", {"answer": "42"}) == 0.0
    # loaded once per process: the same module object
    assert load_reward(f"{rewards_file}:exact") is fn


def test_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_verifiers.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_verifiers:lengths")
    assert is_batched(fn) and fn(["ab", "c"], [{}, {}]) == [2.0, 1.0]


def test_resolve_path_makes_a_file_absolute(rewards_file, tmp_path):
    assert resolve_path(f"{rewards_file}:exact") == f"{tmp_path.resolve()}/rewards.py:exact"
    assert resolve_path("pkg.mod:fn") == "pkg.mod:fn"


@pytest.mark.parametrize(
    "path, message",
    [
        ("missing.py:reward", "reward.path = 'missing.py:reward': no file 'missing.py'"),
        (
            "no_such_module_xyz:reward",
            "reward.path = 'no_such_module_xyz:reward': cannot import 'no_such_module_xyz' "
            "(ModuleNotFoundError: No module named 'no_such_module_xyz')",
        ),
        ("rewards.py:absent", "reward.path = 'rewards.py:absent': 'rewards.py' has no 'absent'"),
        (
            "rewards.py:NOT_CALLABLE",
            "reward.path = 'rewards.py:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a function",
        ),
        (
            "rewards.py:one_argument",
            "reward.path = 'rewards.py:one_argument': one_argument(completion) cannot be called "
            "as one_argument(completion, sample) (two positional arguments)",
        ),
        (
            "rewards.py:three_required",
            "reward.path = 'rewards.py:three_required': three_required(completion, sample, "
            "extra) cannot be called as three_required(completion, sample) (two positional "
            "arguments)",
        ),
    ],
)
def test_bad_paths_fail_in_one_line(rewards_file, path, message):
    with pytest.raises(ValueError) as info:
        load_reward(path)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_module_that_fails_to_import_names_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        load_reward("broken.py:reward")
    assert str(info.value) == (
        "reward.path = 'broken.py:reward': cannot import 'broken.py' (RuntimeError: needs a GPU)"
    )


def test_config_keys_are_checked():
    for override, message in [
        ("reward.pool=forked", "reward.pool = 'forked' must be 'thread' or 'process'"),
        ("reward.on_error=skip", "reward.on_error = 'skip' must be 'drop' or 'zero'"),
        ("reward.timeout=0", "reward.timeout = 0.0 must be a finite number > 0"),
        ("reward.workers=0", "reward.workers = 0 must be >= 1"),
        ("reward.path=reward", "reward.path = 'reward' must be 'module:function' or"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert str(info.value).startswith(message), str(info.value)


def test_check_reward_before_workers_start(rewards_file, tmp_path):
    check_reward(load_config(None, ["reward.path=rewards.py:exact"]))  # loads: no error
    with pytest.raises(ConfigError, match=r"^reward.path = 'rewards.py:one_argument': "):
        check_reward(load_config(None, ["reward.path=rewards.py:one_argument"]))
    both = load_config(None, ["reward.path=rewards.py:exact"])
    both.agent.path = "a.py:agent"
    with pytest.raises(ConfigError, match="set together with agent.path"):
        check_reward(both)
    # the rollout workers get the absolute path of the file (picklable: a string)
    spec = cluster_spec(load_config(None, ["reward.path=rewards.py:exact"])).rollout
    assert spec.reward.path == f"{tmp_path.resolve()}/rewards.py:exact"


# ------------------------------------------------------------------------------ calling


def test_score_sync_async_batched(rewards_file):
    assert score(load_reward("rewards.py:exact"), ["42"], _samples(1)) == [1.0]
    assert score(load_reward("rewards.py:exact_async"), ["41"], _samples(1)) == [0.0]
    assert score(load_reward("rewards.py:lengths"), ["a", "bcd"], _samples(2)) == [1.0, 3.0]
    assert score(load_reward("rewards.py:lengths_async"), ["ab"], _samples(1)) == [2.0]
    assert score(load_reward("rewards.py:flag"), ["yes"], _samples(1)) == [1.0]


def test_score_rejects_bad_values():
    with pytest.raises(RewardValueError, match="returned nan, not a finite number"):
        score(lambda c, s: math.nan, ["x"], [{}])
    with pytest.raises(RewardValueError, match="returned 'high', not a number"):
        score(lambda c, s: "high", ["x"], [{}])
    wrong = batched(lambda cs, ss: [1.0])
    with pytest.raises(RewardValueError, match="returned 1 values for 2 completions"):
        score(wrong, ["x", "y"], [{}, {}])


# ------------------------------------------------------------------------------ pools


def _pool(path: str, **kwargs):
    inbox: queue.Queue = queue.Queue()
    return RewardPool(RewardConfig(path=path, **kwargs), inbox.put), inbox


def _scores(inbox: queue.Queue, timeout: float = 30.0) -> GroupScores:
    kind, scores = inbox.get(timeout=timeout)
    assert kind == "rewards"
    return scores


def test_thread_pool_scores_a_group(rewards_file):
    pool, inbox = _pool("rewards.py:exact", workers=2)
    try:
        pool.submit(3, ["42", "41", " 42"], _samples(3))
        assert _scores(inbox) == GroupScores(3, [1.0, 0.0, 1.0])
        pool.submit(4, [], [])
        assert _scores(inbox) == GroupScores(4, [])
    finally:
        pool.close()


def test_thread_pool_batched_is_one_call_per_group(rewards_file):
    pool, inbox = _pool("rewards.py:lengths_async")
    try:
        pool.submit(0, ["a", "bb", "ccc"], _samples(3))
        assert _scores(inbox) == GroupScores(0, [1.0, 2.0, 3.0])
    finally:
        pool.close()


@pytest.mark.parametrize(
    "fn, completion, reason, error",
    [
        ("boom", "bad", "reward_error", "ValueError: cannot parse bad"),
        ("nan", "nan", "reward_error", "the reward returned nan, not a finite number"),
        (
            "slow",
            "slow",
            "reward_timeout",
            "took longer than reward.timeout = 0.5 s (its thread is abandoned)",
        ),
    ],
)
def test_thread_pool_failure_drops_the_group(rewards_file, caplog, fn, completion, reason, error):
    pool, inbox = _pool(f"rewards.py:{fn}", timeout=0.5)
    try:
        start = time.monotonic()
        pool.submit(9, ["fine", completion], _samples(2, sleep=3))
        scores = _scores(inbox)
        assert time.monotonic() - start < 2.5  # a timed-out call is not waited for
        assert (scores.group_id, scores.drop_reason) == (9, reason)
        assert scores.error == f"reward rewards.py:{fn} on sample uid 'u7': {error}"
    finally:
        pool.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "areal_fast.reward"]
    assert lines == [
        f"reward rewards.py:{fn} on sample uid 'u7': {error}; group 9 dropped ({reason})"
    ]


def test_on_error_zero_scores_the_sample_zero(rewards_file):
    pool, inbox = _pool("rewards.py:boom", on_error="zero")
    try:
        pool.submit(1, ["ok", "bad", "ok"], _samples(3))
        scores = _scores(inbox)
        assert (scores.rewards, scores.drop_reason) == ([1.0, 0.0, 1.0], "")
        assert scores.error.endswith("ValueError: cannot parse bad")
    finally:
        pool.close()


def test_process_pool_kills_a_timed_out_call_and_replaces_its_process(rewards_file):
    pool, inbox = _pool("rewards.py:slow", pool="process", workers=1, timeout=2.0)
    try:
        pool.submit(0, ["a", "b"], _samples(2))
        assert _scores(inbox, 120) == GroupScores(0, [1.0, 1.0])  # the child started
        first = pool.runners[0].proc
        pool.submit(1, ["slow"], _samples(1, sleep=60))
        scores = _scores(inbox)
        assert scores.drop_reason == "reward_timeout"
        assert "its process was killed and replaced" in scores.error
        assert first.poll() is not None and pool.runners[0].proc is not first
        pool.submit(2, ["c"], _samples(1))  # the new process answers
        assert _scores(inbox, 120) == GroupScores(2, [1.0])
    finally:
        pool.close()
    assert pool.runners[0].proc.poll() is not None


def test_process_pool_reports_the_reward_error(rewards_file):
    pool, inbox = _pool("rewards.py:boom", pool="process", workers=1)
    try:
        pool.submit(5, ["bad"], _samples(1))
        scores = _scores(inbox, 120)
        assert scores.drop_reason == "reward_error"
        assert (
            scores.error
            == "reward rewards.py:boom on sample uid 'u7': ValueError: cannot parse bad"
        )
    finally:
        pool.close()
