"""A rollout worker's plain groups: reward inputs, interruptions counted, finished records."""

import pytest

from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire.messages import GroupRequest
from areal_fast.workers.rollout_groups import Group, Sample, eval_record, group_done, sample_dicts
from areal_fast.workers.rollout_groups import seams as count_seams


def request(n=2, data=None):
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=8)
    return GroupRequest(7, [1, 2], params, seed=3, answer="4", uid="arith/0", data=data or {})


def test_sample_dicts_are_independent_copies_and_the_row_wins():
    dicts = sample_dicts(request(n=3, data={"answer": "four", "tests": [1]}))
    assert dicts == [{"uid": "arith/0", "answer": "four", "tests": [1]}] * 3
    dicts[0]["answer"] = "changed"
    assert dicts[1]["answer"] == "four"
    assert sample_dicts(request(n=1)) == [{"uid": "arith/0", "answer": "4"}]


def test_seams_count_version_steps():
    assert count_seams([]) == 0
    assert count_seams([2, 2, 2]) == 0
    assert count_seams([0, 0, 1, 1, 3]) == 2
    with pytest.raises(RuntimeError, match="versions decrease"):
        count_seams([1, 0])


def test_group_done_takes_the_larger_of_interruptions_and_seams():
    a = Sample(7, 0, [1, 2], 0, 8, tokens=[5, 6, 7], versions=[0, 1, 2], stop_reason="stop")
    b = Sample(7, 1, [1, 2], 1, 8, tokens=[5], versions=[1], stop_reason="length")
    b.interruptions = 1
    done = group_done(Group(request(), [a, b]), [1.0, 0.0], shard=None)
    assert done.group_id == 7 and done.rewards == [1.0, 0.0]
    assert done.completion_lengths == [3, 1] and done.stop_reasons == ["stop", "length"]
    assert done.interruptions == 3  # 2 seams in a, 1 interruption of b
    assert done.errors == [] and done.drop_reason == ""


def test_a_dropped_group_has_no_rewards_and_its_error():
    group = Group(request(), [Sample(7, 0, [1], 0, 8), Sample(7, 1, [1], 1, 8)])
    done = group_done(group, [1.0, 1.0], None, drop_reason="reward_error", error="KeyError: x")
    assert done.rewards == [] and done.drop_reason == "reward_error"
    assert done.errors == ["KeyError: x"]


def test_eval_record_correct_from_the_reward():
    assert eval_record(request(), "4", 1.0, "") == {
        "uid": "arith/0",
        "answer": "4",
        "completion": "4",
        "correct": True,
        "reward": 1.0,
    }
    failed = eval_record(request(), "x", 0.0, "reward_timeout")
    assert failed["correct"] is False and failed["error"] == "reward_timeout"
    assert eval_record(request(), "", 0.99, "")["correct"] is False
