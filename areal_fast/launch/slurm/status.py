"""``areal-fast submit --status RUN_DIR``: the Slurm state of a run's newest job, how the
run stands, and its last metrics line.

Slurm's state comes from ``squeue`` while the job is pending or running and from
``scontrol show job`` while slurmctld still remembers it (``MinJobAge``); the run's own
files say the rest (``summary.json``, ``INTERRUPTED``, ``FAILED``, ``metrics.jsonl``) and,
for a job that failed before the run began, the last line of its log.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_fast.launch.config import ConfigError
from areal_fast.launch.slurm.jobs import JOBS_FILE, last_job, query
from areal_fast.launch.slurm.script import LOG_PATTERN, SLURM_DIR

# metrics shown from the last metrics.jsonl line, in order, when present
SHOWN_METRICS = ("reward_mean", "accuracy", "loss", "staleness_mean", "step_seconds")
TAIL_BYTES = 65536  # of metrics.jsonl and the log read for their last lines


def status_lines(run_dir: str) -> list[str]:
    """The lines ``--status`` prints: job id and Slurm state, the run's state, the last
    metrics line, the log.

    Raises
    ------
    ConfigError
        ``run_dir`` holds no job submitted by ``areal-fast submit`` (no job in
        ``slurm/jobs``).
    """
    run = Path(run_dir).resolve()
    job_id = last_job(run)
    if job_id is None:
        raise ConfigError(
            f"{run} holds no job submitted by areal-fast submit (no job id in "
            f"{run / SLURM_DIR / JOBS_FILE})"
        )
    log = run / SLURM_DIR / LOG_PATTERN.replace("%j", job_id)
    state = slurm_state(job_id)
    lines = [f"job {job_id}: {state}", f"run: {run_state(run)}"]
    last = last_metrics(run)
    if last:
        lines.append(f"last step: {last}")
    elif state.startswith("FAILED") and log.is_file():  # it failed before the run began
        tail = _tail_lines(log, 1)
        lines.append(f"log's last line: {tail[0] if tail else '(empty)'}")
    lines.append(f"log: {log}")
    return lines


def slurm_state(job_id: str) -> str:
    """``RUNNING on node1 for 0:42``, ``PENDING (Priority)``, ``COMPLETED (exit 0)``,
    ``CANCELLED (exit 143: stopped on SIGTERM)``..., or why Slurm cannot tell."""
    ok, queued = query(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%M|%N"])
    if ok and queued:
        state, reason, elapsed, nodes = (queued.splitlines()[0].split("|") + [""] * 4)[:4]
        if state == "RUNNING":
            return f"RUNNING on {nodes} for {elapsed}"
        return f"{state} ({reason})" if reason and reason != "None" else state
    shown_ok, shown = query(["scontrol", "show", "job", "-o", job_id])
    fields = dict(f.split("=", 1) for f in shown.split() if "=" in f) if shown_ok else {}
    if "JobState" in fields:
        code, _, signal = fields.get("ExitCode", "?").partition(":")
        how = f"exit {code}" + (f", signal {signal}" if signal not in ("", "0") else "")
        if code == "143":
            how += ": stopped on SIGTERM"
        restarts = fields.get("Restarts", "0")
        return f"{fields['JobState']} ({how}" + (
            f", {restarts} requeues)" if restarts != "0" else ")"
        )
    if not ok and "invalid job id" not in queued.lower():
        return f"unknown: Slurm did not answer ({queued})"
    return "not known to Slurm now (it forgets a job some minutes after it ended)"


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
    """``step 12: reward_mean 0.41, accuracy 0.39, ...`` of the last complete metrics.jsonl
    line ("" when there is none)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return ""
    for line in reversed(_tail_lines(path, 2)):
        try:
            record = json.loads(line)
            break
        except ValueError:  # the line being written
            continue
    else:
        return ""
    shown = [
        f"{k} {record[k]:.4g}" for k in SHOWN_METRICS if isinstance(record.get(k), (int, float))
    ]
    return f"step {record.get('step')}: " + ", ".join(shown)


def _tail_lines(path: Path, count: int) -> list[str]:
    """The last ``count`` non-empty lines of ``path``, reading at most :data:`TAIL_BYTES`."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        text = f.read().decode("utf-8", "replace")
    return [line for line in text.splitlines() if line.strip()][-count:]
