"""Which finished groups are kept: dynamic filter, staleness, dropped agent groups, failed
rewards, and the limits on drops in a row."""

import pytest

from areal_fast.controller.acceptance import Acceptance
from areal_fast.controller.config import RunPlan
from areal_fast.wire.messages import GroupDone

SHARD = object()  # acceptance only asks whether a group has a shard


def done(rewards=(0.0, 1.0), shard=SHARD, drop_reason="", errors=()):
    return GroupDone(
        shard=shard,
        group_id=0,
        rewards=list(rewards),
        completion_lengths=[3] * len(rewards),
        stop_reasons=["stop"] * len(rewards),
        interruptions=0,
        errors=list(errors),
        drop_reason=drop_reason,
    )


def test_reasons_in_order_of_precedence():
    acc = Acceptance(True, 10, 10)
    assert acc.drop_reason(done(), stale=False) is None
    assert acc.drop_reason(done(), stale=True) == "stale"
    assert acc.drop_reason(done((1.0, 1.0)), stale=True) == "dynamic_filter"
    assert acc.drop_reason(done(shard=None), stale=False) == "agent_sessions_dropped"
    assert acc.drop_reason(done(drop_reason="reward_timeout"), stale=True) == "reward_timeout"


def test_equal_rewards_are_kept_without_the_filter():
    acc = Acceptance(False, 10, 10)
    assert acc.drop_reason(done((0.5, 0.5)), stale=False) is None
    assert acc.filtered_in_a_row == 0


def test_filter_limit_counts_drops_in_a_row():
    acc = Acceptance(True, max_filtered_in_a_row=2, max_failed_agent_groups_in_a_row=10)
    for _ in range(2):
        acc.drop_reason(done((1.0, 1.0)), stale=False)
    acc.check_filter_limit()  # 2 in a row: at the limit, not over
    acc.drop_reason(done((0.0, 1.0)), stale=False)  # a kept group resets the count
    assert acc.filtered_in_a_row == 0
    for _ in range(3):
        acc.drop_reason(done((1.0, 1.0)), stale=False)
    with pytest.raises(ValueError, match="the last 3 groups all had equal rewards"):
        acc.check_filter_limit()


def test_failed_agent_groups_in_a_row_end_the_run_with_a_hint():
    acc = Acceptance(False, 10, max_failed_agent_groups_in_a_row=2)
    assert acc.drop_reason(done(shard=None), stale=False) == "agent_sessions_dropped"
    with pytest.raises(ValueError, match=r"last 2 groups .*timeout: 30 s\); check agent.timeout"):
        acc.drop_reason(done(shard=None, errors=["timeout: 30 s"]), stale=False)


def test_reward_drops_in_a_row_end_the_run():
    acc = Acceptance.from_plan(False, RunPlan(1, 4, max_reward_drops_in_a_row=2))
    assert acc.drop_reason(done(drop_reason="reward_error", errors=["E"]), False) == "reward_error"
    assert acc.drop_reason(done(), stale=False) is None  # resets
    acc.drop_reason(done(drop_reason="reward_error"), stale=False)
    with pytest.raises(ValueError, match=r"last 2 groups were all dropped \(reward_error: E2\)"):
        acc.drop_reason(done(drop_reason="reward_error", errors=["E2"]), stale=False)
