"""The weight path chosen per rollout worker, end to end on the local launcher: workers forced
onto network links (``sync.transport=broadcast`` or ``disk``) train exactly like workers that
map the trainer's slots, and every installed version is bit-exact with the trainer's."""

from __future__ import annotations

import json

import pytest
from linked_job import JOB_CWD, REPO, STEPS, job_args  # noqa: E402 - beside this file

from areal_fast.cli import main


def _args(model_dir, root, trial, *extra):
    return job_args(model_dir, root, trial, "rollout.max_head_offpolicyness=0", *extra)


def _run(model_dir, root, trial, *extra) -> tuple[dict, list[float]]:
    assert main(_args(model_dir, root, trial, *extra)) == 0
    run_dir = root / "grpo-arith" / trial
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    return summary, losses


@pytest.fixture(scope="module")
def shm_run(tiny_model_dir, tmp_path_factory):
    return _run(tiny_model_dir, tmp_path_factory.mktemp("shm"), "shm", "sync.transport=shm")


@pytest.mark.parametrize(
    "transport, bind_host", [("broadcast", None), ("disk", None), ("broadcast", "0.0.0.0")]
)
def test_linked_workers_train_like_slot_workers(
    transport, bind_host, tiny_model_dir, tmp_path, shm_run
):
    extra = [f"sync.transport={transport}"]
    if bind_host:  # a wildcard bind: the links still use an interface's address
        extra.append(f"scheduler.bind_host={bind_host}")
    summary, losses = _run(tiny_model_dir, tmp_path, transport, *extra)
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


def test_a_killed_linked_worker_gets_the_current_weights_over_its_new_link(
    tiny_model_dir, tmp_path
):
    """η = 1, every worker on a link: rollout-1 is killed after step 2; its replacement
    joins a new link, receives the current version over it, bit-exact, and every accepted
    group is trained."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "grpo-arith" / "kill"
    args = _args(
        tiny_model_dir,
        tmp_path,
        "kill",
        "sync.transport=broadcast",
        "rollout.max_head_offpolicyness=1",
        "rollout.drop_stale=false",
        "total_steps=5",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_fast.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=JOB_CWD,
    )
    metrics, workers = run_dir / "metrics.jsonl", run_dir / "workers.json"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2 and workers.is_file()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the job did not reach step 2"
        time.sleep(0.05)
    os.kill(json.loads(workers.read_text())["rollout-1"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout_worker_restarts"] == 1
    assert summary["rollouts_trained"] == 5 * 4
    assert set(summary["rollouts_dropped"]) <= {"unused_at_end", "in_flight_at_end"}
    served = summary["weight_versions"]["rollout-1"]  # the old worker's, then the new one's
    assert served[-1] == 5 and served == sorted(served), served
    # recovery ends when the new worker serves the version current at its restart
    assert 0 < summary["rollout_recovery_seconds"][0] < 60
    for version, crcs in summary["weight_checksums"].items():
        if "trainer" in crcs:
            assert len(set(crcs.values())) == 1, (version, crcs)


def test_an_unwritable_disk_dir_is_one_line_before_anything_starts(tmp_path, capsys):
    args = _args(tmp_path / "model", tmp_path, "disk", "sync.transport=disk")
    assert main([*args, "sync.disk_dir=/proc/no-such-folder"]) == 2
    err = capsys.readouterr().err
    assert "sync.disk_dir = '/proc/no-such-folder' is not a folder this job can write" in err
    assert not (tmp_path / "grpo-arith").exists()
