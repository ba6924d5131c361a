"""The reproducible run's plan: batches in data order, versions max(0, k − η), workers by
group id (the runs themselves: tests/launch/test_reproducible.py)."""

import pytest

from areal_fast.controller.fixed_schedule import FixedSchedule


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
