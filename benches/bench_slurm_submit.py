"""``areal-fast submit`` against submitit on a one-node Slurm cluster started on this machine
(tests/launch/slurm/slurm_cluster.py: munged, slurmctld, slurmd; needs Debian's Slurm and
munge packages and root): the seconds each takes to submit a job, and what each job does
when it is requeued mid-run (``scontrol requeue``).

Submission is timed as a user meets it: ``areal-fast submit`` as the whole command (Python
start, the config checked, the script written, sbatch), submitit as
``AutoExecutor.submit`` of a ``CommandFunction`` running ``areal-fast train`` in a Python
session where submitit is imported already. The requeue case trains the same tiny job
(``--model``, 30 steps of 4 prompts x 2 samples, a checkpoint every 2 steps) under each and
requeues it after 3 steps.

    python benches/bench_slurm_submit.py --model DIR --json benches/results/slurm_submit_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "launch" / "slurm"))

import slurm_cluster  # noqa: E402 - the test cluster, beside the Slurm tests
from _harness import positive_int  # noqa: E402 - beside this file

STEPS = 30


def _job_overrides(model: str, root: Path, trial: str) -> list[str]:
    return [
        f"model.path={model}", f"fileroot={root}", f"trial_name={trial}",
        f"total_steps={STEPS}", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6", "threads=1", "batch_size=4", "data.eval_size=4",
        "data.train_size=60", "checkpoint.every_steps=2",
    ]  # fmt: skip


def _time_ours(cluster, model: str, root: Path, repeats: int) -> list[float]:
    seconds = []
    for i in range(repeats):
        command = [sys.executable, "-m", "areal_fast.cli", "submit", "--config",
                   str(REPO / "examples" / "arith.yaml"), *_job_overrides(model, root, f"o{i}")]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=cluster.env, cwd=root)
        seconds.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
        cluster.run("scancel", done.stdout.split()[3].rstrip(":"))
    return seconds


def _train_command(model: str, root: Path, trial: str):
    import submitit

    return submitit.helpers.CommandFunction(
        [sys.executable, "-m", "areal_fast.cli", "train", "--config",
         str(REPO / "examples" / "arith.yaml"), "--no-progress", *_job_overrides(model, root, trial)],
        cwd=str(root),
    )  # fmt: skip


def _time_submitit(cluster, model: str, root: Path, repeats: int) -> tuple[list[float], object]:
    import submitit

    executor = submitit.AutoExecutor(folder=str(root / "submitit"))
    executor.update_parameters(timeout_min=60, slurm_partition="debug")
    seconds = []
    for i in range(repeats):
        start = time.perf_counter()
        job = executor.submit(_train_command(model, root, f"s{i}"))
        seconds.append(time.perf_counter() - start)
        cluster.run("scancel", job.job_id)
    return seconds, executor


def _requeue(cluster, job_id: str, run_dir: Path) -> dict:
    """Requeue the job after 3 steps; wait for its end; what became of the run."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline, f"job {job_id} did not reach step 3"
        time.sleep(0.2)
    cluster.run("scontrol", "requeue", job_id)
    while cluster.job_field(job_id, "JobState") not in ("PENDING", ""):
        time.sleep(0.2)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    while job_id in cluster.job_ids():
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(0.5)
    summary = run_dir / "summary.json"
    return {
        "job_state": cluster.job_field(job_id, "JobState"),
        "restarts": cluster.job_field(job_id, "Restarts"),
        "finished": summary.is_file(),
        "resumed_from_version": json.loads(summary.read_text()).get("resumed_from_version")
        if summary.is_file()
        else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a small model directory (model.path)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="submissions timed")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if importlib.util.find_spec("submitit") is None:
        parser.error("needs submitit (pip install submitit)")
    root = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    try:
        cluster = slurm_cluster.start(root / "slurm")
    except slurm_cluster.Unavailable as exc:
        parser.error(f"no Slurm cluster here: {exc}")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]  # submitit's sbatch reads it here
    try:
        ours = _time_ours(cluster, args.model, root, args.repeats)
        theirs, executor = _time_submitit(cluster, args.model, root, args.repeats)
        time.sleep(2)
        done = subprocess.run(
            [sys.executable, "-m", "areal_fast.cli", "submit", "--config",
             str(REPO / "examples" / "arith.yaml"), *_job_overrides(args.model, root, "rq-ours")],
            capture_output=True, text=True, env=cluster.env, cwd=root,
        )  # fmt: skip
        ours_requeue = _requeue(
            cluster, done.stdout.split()[3].rstrip(":"), root / "grpo-arith" / "rq-ours"
        )
        job = executor.submit(_train_command(args.model, root, "rq-submitit"))
        theirs_requeue = _requeue(cluster, job.job_id, root / "grpo-arith" / "rq-submitit")
        theirs_requeue["error"] = (job.stderr() or "").strip().splitlines()[-2:]
    finally:
        slurm_cluster.stop(cluster)
    import submitit

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "submitit": submitit.__version__,
        "areal_fast_submit_seconds": ours,
        "submitit_submit_seconds": theirs,
        "median_seconds": {"areal_fast": statistics.median(ours), "submitit": statistics.median(theirs)},
        "requeue": {"areal_fast": ours_requeue, "submitit": theirs_requeue},
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
