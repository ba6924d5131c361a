"""``areal-fast submit`` against a real one-node Slurm cluster (munged, slurmctld, slurmd on
this machine, :mod:`slurm_cluster`): a tiny-model job runs to its summary; ``scancel`` stops
it as Ctrl-C does; ``scontrol requeue`` makes it resume from its checkpoint and end identical
to an uninterrupted run; a partition Slurm does not know is refused in one line with nothing
submitted.

The jobs are reproducible runs (``rollout.reproducible``, as in
tests/launch/test_reproducible.py), so a requeued run can be compared with an
uninterrupted one by ``areal-fast compare``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster  # beside this file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/launch: the tiny job
from linked_job import REPRODUCIBLE_JOB, tiny_job_args  # noqa: E402

STEPS = 30  # a tiny step takes ~0.1 s: a signal after step 3 comes while it trains
JOB_TIMEOUT = 300.0  # seconds a tiny job may take from submission to its end


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The one-node cluster (:mod:`slurm_cluster`). Where it cannot start (Slurm not
    installed, not root) the tests are skipped with the reason; with
    ``AREAL_FAST_REQUIRE_SLURM=1`` (CI) they fail instead."""
    try:
        cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    except slurm_cluster.Unavailable as exc:
        if os.environ.get("AREAL_FAST_REQUIRE_SLURM"):
            pytest.fail(f"AREAL_FAST_REQUIRE_SLURM=1 but {exc}")
        pytest.skip(str(exc))
    yield cluster
    slurm_cluster.stop(cluster)


def _job_args(model_dir, root: Path, trial: str, *extra) -> list[str]:
    """``submit`` arguments of test_reproducible's tiny job, with :data:`STEPS` steps."""
    train = tiny_job_args(model_dir, root, trial, STEPS, *REPRODUCIBLE_JOB, *extra)
    return ["submit", *(a for a in train[1:] if a != "--no-progress")]  # submit has no bars


def _submit(slurm, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", *args],
        capture_output=True,
        text=True,
        env=slurm.env,
        cwd=cwd,
        timeout=180,
    )


def _job_id(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("submitted Slurm job "), done.stdout
    return first.split()[3].rstrip(":")


def _wait_gone(slurm, job_id: str, run_dir: Path) -> None:
    """Wait until the job has left the queue (finished, cancelled or failed)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while job_id in slurm.job_ids():
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still queued\n{_log(run_dir, job_id)}")
        time.sleep(0.5)


def _wait_steps(slurm, job_id: str, run_dir: Path, steps: int) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
        if job_id not in slurm.job_ids() or time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} ended first\n{_log(run_dir, job_id)}")
        time.sleep(0.1)


def _log(run_dir: Path, job_id: str) -> str:
    path = run_dir / "slurm" / f"slurm-{job_id}.out"
    return path.read_text()[-3000:] if path.is_file() else f"(no {path})"


def _status(slurm, run_dir: Path, cwd: Path) -> str:
    done = _submit(slurm, ["submit", "--status", str(run_dir)], cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def reference(slurm, tiny_model_dir, tmp_path_factory):
    """A submitted job run to its end: (run directory, job id)."""
    root = tmp_path_factory.mktemp("slurm-runs")
    job_id = _job_id(_submit(slurm, _job_args(tiny_model_dir, root, "ref"), root))
    run_dir = root / "grpo-arith" / "ref"
    _wait_gone(slurm, job_id, run_dir)
    return run_dir, job_id


def test_a_submitted_job_runs_to_its_summary(slurm, reference):
    run_dir, job_id = reference
    log = _log(run_dir, job_id)
    assert (run_dir / "summary.json").is_file(), log
    summary = json.loads((run_dir / "summary.json").read_text())
    dropped = sum(summary["rollouts_dropped"].values())
    assert summary["steps"] == STEPS
    assert summary["rollouts_submitted"] == summary["rollouts_trained"] + dropped == STEPS * 4
    assert f"finished {STEPS} steps in" in log and "Traceback" not in log, log
    assert slurm.job_field(job_id, "JobState") == "COMPLETED"
    assert slurm.job_field(job_id, "ExitCode") == "0:0"
    # the script and the run's config are in the run directory, the script the user's alone
    script = run_dir / "slurm" / "job.sbatch"
    assert script.stat().st_mode & 0o077 == 0
    assert f"#SBATCH --output={run_dir}/slurm/slurm-%j.out" in script.read_text()
    status = _status(slurm, run_dir, run_dir.parent)
    assert f"job {job_id}: COMPLETED (exit 0)" in status
    assert "run: finished (summary.json)" in status
    assert f"last step: step {STEPS}: reward_mean" in status, status


def test_scancel_stops_the_run_as_ctrl_c_does(slurm, tiny_model_dir, tmp_path):
    job_id = _job_id(_submit(slurm, _job_args(tiny_model_dir, tmp_path, "cancel"), tmp_path))
    run_dir = tmp_path / "grpo-arith" / "cancel"
    _wait_steps(slurm, job_id, run_dir, 3)
    done = slurm.run("scancel", job_id)
    assert done.returncode == 0, done.stderr
    _wait_gone(slurm, job_id, run_dir)
    log = _log(run_dir, job_id)
    lines = (run_dir / "INTERRUPTED").read_text().splitlines()
    assert lines[1] == "signal: SIGTERM", log
    # the checkpoint in progress at the signal was finished; no worker printed a traceback
    assert "was discarded" not in log and "Traceback" not in log, log
    assert f"areal-fast: {lines[0]}" in log
    assert "resume=true continues from step" in lines[0], log
    assert slurm.job_field(job_id, "JobState") == "CANCELLED"
    status = _status(slurm, run_dir, tmp_path)
    assert f"job {job_id}: CANCELLED (exit 143: stopped on SIGTERM)" in status
    assert "run: INTERRUPTED: interrupted at step" in status, status


def test_a_requeued_job_resumes_and_ends_as_the_uninterrupted_one(
    slurm, tiny_model_dir, tmp_path, reference
):
    from areal_fast.launch.compare import compare_runs

    job_id = _job_id(_submit(slurm, _job_args(tiny_model_dir, tmp_path, "ref"), tmp_path))
    run_dir = tmp_path / "grpo-arith" / "ref"
    _wait_steps(slurm, job_id, run_dir, 3)  # the checkpoint of step 2 is written or complete
    done = slurm.run("scontrol", "requeue", job_id)
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + JOB_TIMEOUT
    while slurm.job_field(job_id, "JobState") != "PENDING":
        assert time.monotonic() < deadline, _log(run_dir, job_id)
        time.sleep(0.2)
    # a requeued job waits some minutes (BeginTime) before it may start again: not here
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    _wait_gone(slurm, job_id, run_dir)
    log = _log(run_dir, job_id)
    assert slurm.job_field(job_id, "Restarts") == "1", log
    assert log.count("areal-fast: Slurm job") == 2, log  # both starts, in one appended log
    assert "areal-fast: interrupted at step" in log and "was discarded" not in log, log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 2 <= summary["resumed_from_version"] < STEPS, log
    differences = [f.line for f in compare_runs(reference[0], run_dir) if f.difference]
    assert differences == [], log


def test_an_unknown_partition_is_refused_in_one_line(slurm, tiny_model_dir, tmp_path):
    before = slurm.job_ids()
    args = _job_args(tiny_model_dir, tmp_path, "nowhere", "slurm.partition=nosuch")
    done = _submit(slurm, args, tmp_path)
    assert done.returncode == 2, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal-fast: error: sbatch failed:")
    assert "partition" in lines[0].lower(), lines
    assert slurm.job_ids() == before
    assert not (tmp_path / "grpo-arith").exists() or not any((tmp_path / "grpo-arith").iterdir())


def test_the_ray_path_runs_the_job_on_the_allocation(slurm, tiny_model_dir, tmp_path):
    """``slurm.placement=ray`` (the default with several nodes) on this one node: the script
    starts a Ray head, waits for the allocation's nodes and runs the Ray launcher there."""
    args = _job_args(
        tiny_model_dir,
        tmp_path,
        "ray",
        "total_steps=3",
        "rollout.reproducible=false",
        "slurm.placement=ray",
        "slurm.cpus_per_task=2",
        "scheduler.cpus_per_rollout_worker=0.5",
        "scheduler.cpus_per_trainer_rank=0.5",
    )
    job_id = _job_id(_submit(slurm, args, tmp_path))
    run_dir = tmp_path / "grpo-arith" / "ray"
    _wait_gone(slurm, job_id, run_dir)
    log = _log(run_dir, job_id)
    assert "areal-fast: 1 Ray nodes are up" in log, log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scheduler"] == "ray" and summary["steps"] == 3, log
    assert slurm.job_field(job_id, "ExitCode") == "0:0", log
    # Ray's processes ended with the job
    left = subprocess.run(["pgrep", "-f", "ray/core/src/ray/raylet"], capture_output=True)
    assert left.stdout == b"", left.stdout
