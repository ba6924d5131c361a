"""Range checks of the config dataclasses: one ValueError naming the key."""

import math

import pytest

from areal_fast._checks import at_least, positive_finite


def test_at_least_accepts_the_bound_and_above():
    at_least("rollout.group_size", 2, 2)
    at_least("rollout.group_size", 9, 2)


def test_at_least_names_key_value_bound_and_reason():
    with pytest.raises(ValueError) as err:
        at_least("rollout.group_size", 1, 2, "(GRPO compares samples of a group)")
    assert str(err.value) == (
        "rollout.group_size = 1 must be >= 2 (GRPO compares samples of a group)"
    )
    with pytest.raises(ValueError, match=r"^batch_size = 0 must be >= 1$"):
        at_least("batch_size", 0, 1)


@pytest.mark.parametrize("value", [0, 0.0, -1e-3, math.inf, math.nan])
def test_positive_finite_rejects(value):
    with pytest.raises(ValueError, match=rf"^reward.timeout = {value} must be a finite"):
        positive_finite("reward.timeout", value)


def test_positive_finite_accepts_small_and_large():
    positive_finite("reward.timeout", 1e-9)
    positive_finite("reward.timeout", 1e30)
