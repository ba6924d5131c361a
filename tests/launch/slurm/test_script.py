"""The batch script ``areal-fast submit`` writes: every value quoted, valid bash on both
launch paths (local processes, Ray), and what it runs on a first start and on a requeue."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from areal_fast.launch.slurm.config import SlurmConfig
from areal_fast.launch.slurm.script import render_script

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "examples" / "arith.yaml")


def test_the_script_quotes_every_value_and_is_valid_bash(tmp_path):
    hostile = "$(touch /tmp/pwned); `id` 'q' \"d\""
    slurm = SlurmConfig(
        partition="gpu",
        account="proj-1",
        time="1-02:00:00",
        gpus_per_node=2,
        venv=str(tmp_path / "my venv"),
        modules=["cuda/12.4"],
        env={"HF_HOME": hostile},
        extra_sbatch=["--constraint=h100"],
    )
    text = render_script(slurm, tmp_path / "run", tmp_path, "t1")
    assert "#SBATCH --partition=gpu\n#SBATCH --account=proj-1\n#SBATCH --time=1-02:00:00" in text
    assert "#SBATCH --gpus-per-node=2" in text and "#SBATCH --signal=B:TERM@180" in text
    assert "#SBATCH --constraint=h100" in text and "#SBATCH --requeue" in text
    assert f"export HF_HOME={shlex.quote(hostile)}" in text
    assert f"source {shlex.quote(str(tmp_path / 'my venv' / 'bin' / 'activate'))}" in text
    for nodes in (1, 3):
        script = tmp_path / f"job{nodes}.sbatch"
        slurm.nodes = nodes
        script.write_text(render_script(slurm, tmp_path / "run", tmp_path, "t1"))
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert "areal_fast.launch.ray" in script.read_text()  # several nodes: the Ray launcher


def test_the_script_runs_the_launcher_and_resumes_a_started_run(tmp_path):
    """The one-node script, run by bash with a stand-in python: the first start trains, a
    start after config.yaml exists passes resume=true, a start after the run finished does
    nothing; the values reach the launcher as arguments."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(SlurmConfig(python=str(python)), run_dir, tmp_path, "t"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    first = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    expected = ["-m", "areal_fast.cli", "train", "--config", f"{run_dir}/slurm/config.yaml"]
    assert first.stdout.splitlines()[1:] == [*expected, "--no-progress"], first
    (run_dir / "config.yaml").write_text("{}")
    again = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert again.stdout.splitlines()[1:] == [*expected, "--no-progress", "resume=true"], again
    # the run finished after the job's config was written (a requeue or a resubmission by
    # hand after the end): nothing to do; a job submitted by hand is recorded as it starts
    (run_dir / "slurm" / "config.yaml").write_text("{}")
    os.utime(run_dir / "slurm" / "config.yaml", (1, 1))
    (run_dir / "summary.json").write_text("{}")
    env["SLURM_JOB_ID"] = "77"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.splitlines()[1:] == [
        "areal-fast: the run has finished (summary.json): nothing to do"
    ], done
    assert (run_dir / "slurm" / "jobs").read_text().split()[::2] == ["77", "started"]
    # a new submission (resume=true with more steps) writes the config again: it runs
    (run_dir / "slurm" / "config.yaml").write_text("{}")
    more = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert more.stdout.splitlines()[1:] == [*expected, "--no-progress", "resume=true"], more
    assert len((run_dir / "slurm" / "jobs").read_text().splitlines()) == 1  # recorded once
