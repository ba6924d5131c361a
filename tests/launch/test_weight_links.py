"""The weight path chosen per rollout worker, end to end on the local launcher: workers forced
onto network links (``sync.transport=broadcast`` or ``disk``) train exactly like workers that
map the trainer's slots, and every installed version is bit-exact with the trainer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_fast.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _args(model_dir, root, trial, *extra):
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        f"trial_name={trial}",
        f"total_steps={STEPS}",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=4",
        "data.train_size=60",
        "rollout.num_workers=2",
        "rollout.max_head_offpolicyness=0",
        "threads=1",
        "actor.loss.entropy_coef=0.5",
        "actor.optim.lr=1e-2",
        "sync.checksum=true",
        "checkpoint.final_model=false",
        *extra,
    ]


def _run(model_dir, root, trial, *extra) -> tuple[dict, list[float]]:
    assert main(_args(model_dir, root, trial, *extra)) == 0
    run_dir = root / "grpo-arith" / trial
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    return summary, losses


@pytest.fixture(scope="module")
def shm_run(tiny_model_dir, tmp_path_factory):
    return _run(tiny_model_dir, tmp_path_factory.mktemp("shm"), "shm", "sync.transport=shm")


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_linked_workers_train_like_slot_workers(transport, tiny_model_dir, tmp_path, shm_run):
    summary, losses = _run(tiny_model_dir, tmp_path, transport, f"sync.transport={transport}")
    ref_summary, ref_losses = shm_run
    assert ref_summary["weight_transports"] == {"rollout-0": "shm", "rollout-1": "shm"}
    assert summary["weight_transports"] == {"rollout-0": transport, "rollout-1": transport}
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    assert summary["rollouts_trained"] == ref_summary["rollouts_trained"] == STEPS * 4
    for name in ("rollout-0", "rollout-1"):
        assert summary["weight_versions"][name] == list(range(1, STEPS + 1))
    for version in range(1, STEPS + 1):
        crcs = summary["weight_checksums"][str(version)]
        assert set(crcs) == {"trainer", "rollout-0", "rollout-1"}
        assert len(set(crcs.values())) == 1, (version, crcs)
        assert ref_summary["weight_checksums"][str(version)]["trainer"] == crcs["trainer"]
    assert len(summary["weight_update_latency_seconds"]) == STEPS


def test_sync_config_errors_name_the_key():
    from areal_fast.launch.config import ConfigError, load_config

    for override, key in [
        ("sync.transport=nccl", "sync.transport"),
        ("sync.bucket_mb=0", "sync.bucket_mb"),
        ("sync.timeout=0", "sync.timeout"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(str(REPO / "examples" / "arith.yaml"), [override])
        assert key in str(info.value) and "\n" not in str(info.value)
