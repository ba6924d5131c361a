"""The run's rollout accounting survives a checkpoint round trip."""

import json

from areal_fast.controller.run_counts import RunCounts


def test_as_dict_and_back():
    counts = RunCounts(submitted=10, trained=6, interruptions=3, stale_dropped_tokens=120)
    counts.dropped["stale"] += 2
    counts.dropped["reward_error"] += 1
    counts.update_seconds.append(0.123456)
    counts.recovery_seconds.append(2.5)
    data = json.loads(json.dumps(counts.as_dict()))  # JSON-able, as in controller.json
    assert data["rollouts_submitted"] == 10 and data["rollouts_trained"] == 6
    assert data["rollouts_dropped"] == {"stale": 2, "reward_error": 1}
    assert data["weight_update_seconds"] == [0.1235]  # rounded for summary.json
    back = RunCounts.from_dict(data)
    assert back.dropped == {"stale": 2, "reward_error": 1}
    back.dropped["stale"] += 1  # still a Counter after the round trip
    assert back.dropped["stale"] == 3 and back.dropped["unknown"] == 0
    assert (back.submitted, back.trained, back.interruptions) == (10, 6, 3)
    assert back.stale_dropped_tokens == 120 and back.recovery_seconds == [2.5]


def test_from_dict_of_an_older_checkpoint_defaults_the_newer_keys():
    old = {
        "rollouts_submitted": 4,
        "rollouts_trained": 4,
        "rollouts_dropped": {},
        "sample_interruptions": 0,
        "stale_dropped_completion_tokens": 0,
    }
    counts = RunCounts.from_dict(old)
    assert counts.resubmitted == 0 and counts.rollout_restarts == 0
    assert counts.recovery_seconds == [] and counts.update_seconds == []
