"""``areal-fast submit``: check the config, write the batch script into the run directory,
``sbatch`` it, print the job id and where its log goes.

Nothing is written before every check passed (the whole config, ``slurm.*`` included, the
run directory as ``areal-fast train`` would check it, sbatch on PATH), and nothing stays
written when sbatch refuses the job: its refusal is the error's one line.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from areal_fast.launch.config import ConfigError, ExperimentConfig, load_config, to_yaml
from areal_fast.launch.run_dir import check_run_dir
from areal_fast.launch.slurm.script import (
    CONFIG_NAME,
    LOG_PATTERN,
    SCRIPT_NAME,
    SLURM_DIR,
    render_script,
)

SBATCH_TIMEOUT = 120.0  # seconds sbatch may take to answer (slurmctld busy or down)
JOBS_FILE = "jobs"  # one line per submission: job id, then the time it was submitted
_PLAIN_PATH = re.compile(r"^[^\s'\"\\\x00-\x1f\x7f%]+$")


class SubmitError(ValueError):
    """The job was not submitted; ``str()`` is the one line to show."""


@dataclasses.dataclass
class Submitted:
    """A submitted job: its id, the script, and Slurm's log of it."""

    job_id: str
    script: Path
    log: Path


def submit(config_path: str, overrides: list[str]) -> Submitted:
    """Submit the experiment as a Slurm batch job.

    Parameters
    ----------
    config_path : str
        The experiment's YAML config (the one ``areal-fast train`` takes).
    overrides : list of str
        ``key=value`` items, ``slurm.*`` keys included.

    Raises
    ------
    ConfigError
        A bad key or value (did-you-mean for a misspelt one), a run directory that cannot be
        used, sbatch not found: nothing written.
    SubmitError
        sbatch refused the job or did not answer: its error line; nothing left written.
    """
    cfg = load_config(config_path, overrides)
    sbatch = _sbatch_path(cfg.slurm.sbatch)
    check_run_dir(cfg)
    run_dir = cfg.run_dir.resolve()
    if not _PLAIN_PATH.match(str(run_dir)):
        raise ConfigError(
            f"fileroot: run directory {run_dir} has whitespace, quotes or '%' in its path, "
            f"which #SBATCH lines cannot hold; choose another fileroot or trial_name"
        )
    jobs = run_dir / SLURM_DIR / JOBS_FILE
    if jobs.is_file() and not (run_dir / "config.yaml").is_file() and not cfg.overwrite:
        job = jobs.read_text().split()[-2]
        raise ConfigError(
            f"job {job} was submitted into run directory {run_dir} and has not started it; "
            f"cancel it (scancel {job}) and pass overwrite=true, or choose another trial_name"
        )
    # the outermost folder this submission creates: removed again if sbatch refuses
    created = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)
    if cfg.overwrite and created is None:
        shutil.rmtree(run_dir)  # a run directory (check_run_dir made sure)
    folder = run_dir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        script = _write_job_files(cfg, run_dir)
        job_id = _run_sbatch(sbatch, script)
    except BaseException:
        if created is not None or cfg.overwrite:
            shutil.rmtree(created or run_dir, ignore_errors=True)
        else:
            for name in (f".{SCRIPT_NAME}.new", f".{CONFIG_NAME}.new"):
                (folder / name).unlink(missing_ok=True)
        raise
    os.replace(folder / f".{CONFIG_NAME}.new", folder / CONFIG_NAME)
    os.replace(script, folder / SCRIPT_NAME)
    with open(folder / JOBS_FILE, "a") as jobs:
        jobs.write(f"{job_id} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    log = folder / LOG_PATTERN.replace("%j", job_id)
    return Submitted(job_id, folder / SCRIPT_NAME, log)


def _sbatch_path(command: str) -> str:
    """The absolute path of ``slurm.sbatch``; ConfigError naming the key when absent."""
    found = shutil.which(command)
    if found is None:
        raise ConfigError(
            f"slurm.sbatch: {command!r} is not found on PATH; areal-fast submit needs "
            f"Slurm's client commands (run it on a login node of the cluster)"
        )
    return found


def _write_job_files(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """Write the run's config and the batch script beside their final names (renamed
    once sbatch took the job); returns the script's temporary path."""
    folder = run_dir / SLURM_DIR
    job_cfg = dataclasses.replace(cfg, overwrite=False, resume=False)
    (folder / f".{CONFIG_NAME}.new").write_text(to_yaml(job_cfg))
    script = folder / f".{SCRIPT_NAME}.new"
    script.write_text(render_script(cfg.slurm, run_dir, Path.cwd().resolve(), cfg.trial_name))
    script.chmod(0o700)
    return script


def _run_sbatch(sbatch: str, script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id.

    Raises
    ------
    SubmitError
        sbatch exited non-zero (its last error line), did not answer within
        :data:`SBATCH_TIMEOUT`, or printed no job id.
    """
    try:
        done = subprocess.run(
            [sbatch, "--parsable", str(script)],
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise SubmitError(
            f"sbatch did not answer within {SBATCH_TIMEOUT:g} s (is slurmctld up? "
            f"`scontrol ping`); nothing was submitted"
        ) from None
    if done.returncode != 0:
        raise SubmitError(f"Slurm refused the job: {_last_error(done.stderr, done.returncode)}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed no job id: {done.stdout.strip()[:200]!r}")
    return job_id


def _last_error(stderr: str, code: int) -> str:
    """sbatch's most telling line: its last ``error:`` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = (errors or lines or [f"sbatch exited with code {code}"])[-1]
    return line.removeprefix("sbatch: ").removeprefix("error: ")
