"""``areal-fast submit --status RUN_DIR``: the Slurm state of a run's job, how the run
stands, and its last metrics line.

Slurm's state comes from ``squeue`` while the job is pending or running and from
``scontrol show job`` while slurmctld still remembers it (``MinJobAge``); the run's own
files say the rest (``summary.json``, ``INTERRUPTED``, ``FAILED``, ``metrics.jsonl``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from areal_fast.launch.config import ConfigError
from areal_fast.launch.slurm.script import LOG_PATTERN, SLURM_DIR
from areal_fast.launch.slurm.submit import JOBS_FILE

QUERY_TIMEOUT = 30.0  # seconds squeue / scontrol may take
# metrics shown from the last metrics.jsonl line, in order, when present
SHOWN_METRICS = ("reward_mean", "accuracy", "loss", "staleness_mean", "step_seconds")


def status_lines(run_dir: str) -> list[str]:
    """The lines ``--status`` prints: job id and Slurm state, the run's state, the last
    metrics line, the log.

    Raises
    ------
    ConfigError
        ``run_dir`` holds no job submitted by ``areal-fast submit`` (no ``slurm/jobs``).
    """
    run = Path(run_dir)
    jobs = run / SLURM_DIR / JOBS_FILE
    if not jobs.is_file():
        raise ConfigError(f"{run} holds no job submitted by areal-fast submit (no {jobs})")
    job_id = jobs.read_text().split()[-2]
    lines = [f"job {job_id}: {slurm_state(job_id)}", f"run: {run_state(run)}"]
    last = last_metrics(run)
    if last:
        lines.append(f"last step: {last}")
    lines.append(f"log: {run / SLURM_DIR / LOG_PATTERN.replace('%j', job_id)}")
    return lines


def slurm_state(job_id: str) -> str:
    """``RUNNING on node1 for 0:42``, ``PENDING (Priority)``, ``COMPLETED (exit 0)``..., or
    why Slurm cannot tell."""
    queued = _query(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%M|%N"])
    if queued:
        state, reason, elapsed, nodes = (queued.splitlines()[0].split("|") + [""] * 4)[:4]
        if state == "RUNNING":
            return f"RUNNING on {nodes} for {elapsed}"
        return f"{state} ({reason})" if reason and reason != "None" else state
    shown = _query(["scontrol", "show", "job", "-o", job_id])
    fields = dict(f.split("=", 1) for f in (shown or "").split() if "=" in f)
    if "JobState" in fields:
        code, _, signal = fields.get("ExitCode", "?").partition(":")
        how = f"exit {code}" + (f", signal {signal}" if signal not in ("", "0") else "")
        restarts = fields.get("Restarts", "0")
        return f"{fields['JobState']} ({how}" + (
            f", {restarts} requeues)" if restarts != "0" else ")"
        )
    return "not known to Slurm now (it forgets a job some minutes after it ended)"


def _query(command: list[str]) -> Optional[str]:
    """A Slurm query's output (None when the command is missing, fails or times out)."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=QUERY_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_state(run: Path) -> str:
    """How the run stands by its files."""
    if (run / "summary.json").is_file():
        return "finished (summary.json)"
    for name in ("INTERRUPTED", "FAILED"):
        if (run / name).is_file():
            first = (run / name).read_text().splitlines()[:1]
            return f"{name}: {first[0] if first else ''}".rstrip(": ")
    if (run / "metrics.jsonl").is_file():
        return "training"
    return "not started" if not (run / "config.yaml").is_file() else "starting"


def last_metrics(run: Path) -> str:
    """``step 12: reward_mean 0.41, accuracy 0.39, ...`` of the last metrics.jsonl line."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return ""
    lines = path.read_text().splitlines()
    try:
        record = json.loads(lines[-1]) if lines else None
    except ValueError:  # being written
        record = json.loads(lines[-2]) if len(lines) > 1 else None
    if not record:
        return ""
    shown = [
        f"{k} {record[k]:.4g}" for k in SHOWN_METRICS if isinstance(record.get(k), (int, float))
    ]
    return f"step {record.get('step')}: " + ", ".join(shown)
