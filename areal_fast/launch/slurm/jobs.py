"""The jobs of a run directory (``<run dir>/slurm/jobs``, one line each: the job id, the
time, ``submitted`` by ``areal-fast submit`` or ``started`` by the script of a job submitted
by hand) and what Slurm says of one (``squeue``, ``scontrol show job``), each query with a
timeout."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

from areal_fast.launch.slurm.script import SLURM_DIR

JOBS_FILE = "jobs"
QUERY_TIMEOUT = 30.0  # seconds squeue / scontrol may take
LIVE_STATES = frozenset(
    {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED"}
)


def record_job(run_dir: Path, job_id: str, how: str = "submitted") -> None:
    """Append ``job_id`` to the run's jobs file."""
    with open(Path(run_dir) / SLURM_DIR / JOBS_FILE, "a") as jobs:
        jobs.write(f"{job_id} {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {how}\n")


def last_job(run_dir: Path) -> Optional[str]:
    """The id of the run's newest job (None: no jobs file, or no line with a job id)."""
    path = Path(run_dir) / SLURM_DIR / JOBS_FILE
    if not path.is_file():
        return None
    ids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
    ids = [job for job in ids if job.isdigit()]
    return ids[-1] if ids else None


def query(command: list[str]) -> tuple[bool, str]:
    """Run a Slurm client command: ``(True, its output)``, or ``(False, why it failed)`` (a
    missing command, its error line, or the timeout)."""
    if shutil.which(command[0]) is None:
        return False, f"{command[0]} is not on PATH"
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=QUERY_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return False, f"{command[0]} did not answer within {QUERY_TIMEOUT:g} s"
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        return False, lines[-1] if lines else f"{command[0]} exited with code {done.returncode}"
    return True, done.stdout.strip()


def live_state(job_id: str) -> Optional[str]:
    """The job's state while Slurm still holds it in the queue (PENDING, RUNNING, ...);
    None once it has left the queue, or when squeue cannot tell."""
    ok, out = query(["squeue", "-h", "-j", job_id, "-o", "%T"])
    state = out.splitlines()[0].strip() if ok and out else ""
    return state if state in LIVE_STATES else None
