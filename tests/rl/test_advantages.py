"""group_advantages against per-group Python loops."""

import statistics

import pytest
import torch

from areal_fast.rl.advantages import group_advantages


def _loop_reference(rewards, groups, mode, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(members) < 2:
            out.append(0.0)
        elif mode == "grpo":
            out.append((r - statistics.fmean(members)) / (statistics.stdev(members) + eps))
        elif mode == "dr_grpo":
            out.append(r - statistics.fmean(members))
        elif mode == "rloo":
            out.append(r - (sum(members) - r) / (len(members) - 1))
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_matches_loop_with_shuffled_uneven_groups(mode, fresh_seed):
    groups = torch.randint(0, 7, (40,))
    rewards = torch.randn(40)
    got = group_advantages(rewards, group_ids=groups, mode=mode)
    want = _loop_reference(rewards.tolist(), groups.tolist(), mode)
    assert torch.allclose(got, want.float(), atol=1e-5)


def test_group_size_equals_group_ids(fresh_seed):
    rewards = (torch.rand(24) > 0.5).float()
    by_size = group_advantages(rewards, group_size=4)
    by_ids = group_advantages(rewards, group_ids=torch.arange(24) // 4)
    assert torch.equal(by_size, by_ids)
    assert torch.allclose(by_size.view(6, 4).sum(1), torch.zeros(6), atol=1e-5)


def test_equal_rewards_and_singletons_give_zero():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.3]), group_ids=torch.tensor([0, 0, 0, 1]))
    assert torch.equal(adv, torch.zeros(4))


def test_batch_mode():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.allclose(group_advantages(r, mode="batch"), (r - 1.5) / (r.std() + 1e-6))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="ppo", group_size=2), "mode"),
        (dict(), "exactly one"),
        (dict(group_size=3), "group_size"),
        (dict(group_ids=torch.zeros(3, dtype=torch.int64)), "group_ids"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(4), **kwargs)
