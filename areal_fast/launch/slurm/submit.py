"""``areal-fast submit``: check the config, write the batch script into the run directory,
``sbatch`` it, print the job id and where its log goes.

Nothing is written before every check passed (the whole config, ``slurm.*`` included, the
run directory as ``areal-fast train`` would check it, sbatch on PATH, no job of this run
still pending or running), and what was written is undone when sbatch refuses the job: its
error is the one line. A run replaced with ``overwrite=true`` is moved aside first and put
back on a refusal.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

from areal_fast.launch.config import ConfigError, ExperimentConfig, load_config, to_yaml
from areal_fast.launch.run_dir import check_run_dir
from areal_fast.launch.slurm.jobs import last_job, live_state, record_job
from areal_fast.launch.slurm.script import (
    CONFIG_NAME,
    LOG_PATTERN,
    SCRIPT_NAME,
    SLURM_DIR,
    render_script,
)

SBATCH_TIMEOUT = 120.0  # seconds sbatch may take to answer (slurmctld busy or down)
# a path an #SBATCH line can hold unquoted ('%' would be one of sbatch's patterns)
_PLAIN_PATH = re.compile(r"^[^\s'\"\\\x00-\x1f\x7f%]+$")


class SubmitError(RuntimeError):
    """sbatch did not take the job; ``str()`` is the one line to show."""


class SubmitTimeout(SubmitError):
    """sbatch did not answer: it may have taken the job."""


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
        used or that a job of this run still uses, a path an ``#SBATCH`` line cannot hold,
        sbatch, ``slurm.venv`` or ``slurm.python`` not found: nothing written.
    SubmitError
        sbatch failed (its error line; what was written is undone) or did not answer.
    """
    cfg = load_config(config_path, overrides)
    sbatch = _checked_environment(cfg)
    check_run_dir(cfg)
    run_dir = cfg.run_dir.resolve()
    _check_no_live_job(run_dir)
    created = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)
    aside = _move_aside(run_dir) if cfg.overwrite and created is None else None
    try:
        (run_dir / SLURM_DIR).mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        _undo(run_dir, created, aside, {})
        raise ConfigError(f"fileroot: cannot create {run_dir / SLURM_DIR} ({exc})") from None
    previous = _write_job_files(cfg, run_dir)
    try:
        job_id = _run_sbatch(sbatch, run_dir / SLURM_DIR / SCRIPT_NAME)
    except SubmitTimeout:  # it may have taken the job: its files stay
        raise
    except SubmitError:
        _undo(run_dir, created, aside, previous)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    record_job(run_dir, job_id)
    folder = run_dir / SLURM_DIR
    return Submitted(job_id, folder / SCRIPT_NAME, folder / LOG_PATTERN.replace("%j", job_id))


def _checked_environment(cfg: ExperimentConfig) -> str:
    """The absolute path of ``slurm.sbatch``, after checking the paths the script names.

    Raises
    ------
    ConfigError
        Naming the key (``slurm.sbatch``, ``slurm.venv``, ``slurm.python``, ``fileroot``) or
        the working directory.
    """
    slurm = cfg.slurm
    found = shutil.which(slurm.sbatch)
    if found is None:
        raise ConfigError(
            f"slurm.sbatch: {slurm.sbatch!r} is not found on PATH; areal-fast submit needs "
            f"Slurm's client commands (run it on a login node of the cluster)"
        )
    if slurm.venv and not (Path(slurm.venv) / "bin" / "activate").is_file():
        raise ConfigError(f"slurm.venv: {slurm.venv}/bin/activate does not exist")
    if slurm.python and shutil.which(slurm.python) is None:
        raise ConfigError(f"slurm.python: {slurm.python!r} is not an executable here")
    for what, path in (
        ("fileroot: run directory", cfg.run_dir.resolve()),
        ("the working directory", Path.cwd()),
    ):
        if not _PLAIN_PATH.match(str(path)):
            raise ConfigError(
                f"{what} {path} has whitespace, quotes or '%' in its path, which #SBATCH "
                f"lines cannot hold; use another"
            )
    return found


def _check_no_live_job(run_dir: Path) -> None:
    """ConfigError when the last job submitted into ``run_dir`` is still pending or running
    (two trainers in one run directory would corrupt it)."""
    job = last_job(run_dir)
    state = live_state(job) if job else None
    if state:
        raise ConfigError(
            f"job {job} ({state}) still uses run directory {run_dir}; wait for it or "
            f"cancel it (scancel {job}) first, or choose another trial_name"
        )


def _move_aside(run_dir: Path) -> Path:
    """Rename the run ``overwrite=true`` replaces beside itself; returns the new path."""
    aside = run_dir.with_name(f".{run_dir.name}.replaced-{int(time.time())}")
    run_dir.rename(aside)
    return aside


def _write_job_files(cfg: ExperimentConfig, run_dir: Path) -> dict[Path, Optional[bytes]]:
    """Write the run's config and the batch script (the job may start at once, so both
    are in place before sbatch runs); returns each file's previous bytes (None: new)."""
    folder = run_dir / SLURM_DIR
    job_cfg = dataclasses.replace(cfg, overwrite=False, resume=False)
    texts = {
        folder / CONFIG_NAME: to_yaml(job_cfg),
        folder / SCRIPT_NAME: render_script(
            cfg.slurm, run_dir, Path.cwd().resolve(), cfg.trial_name
        ),
    }
    previous = {path: path.read_bytes() if path.is_file() else None for path in texts}
    for path, text in texts.items():
        path.write_text(text)
    (folder / SCRIPT_NAME).chmod(0o700)
    return previous


def _undo(run_dir: Path, created: Optional[Path], aside: Optional[Path], previous: dict) -> None:
    """Take back what a refused submission wrote: folders it created, the run it moved
    aside, the files it replaced."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    if aside is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
        aside.rename(run_dir)
        return
    for path, old in previous.items():
        if old is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(old)
    folder = run_dir / SLURM_DIR
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _run_sbatch(sbatch: str, script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id.

    Raises
    ------
    SubmitError
        sbatch exited non-zero (its telling error line), did not answer within
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
        raise SubmitTimeout(
            f"sbatch did not answer within {SBATCH_TIMEOUT:g} s (is slurmctld up? `scontrol "
            f"ping`); it may have taken the job: look with squeue before submitting again"
        ) from None
    if done.returncode != 0:
        raise SubmitError(f"sbatch failed: {_telling_line(done.stderr, done.returncode)}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed no job id: {done.stdout.strip()[:200]!r}")
    return job_id


def _telling_line(stderr: str, code: int) -> str:
    """sbatch's most telling line: a ``fatal:`` one, else its last ``error:`` one, else its
    first line that is not the pointer to ``--help``."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if "fatal:" in line]
    errors = [line for line in lines if "error:" in line]
    other = [line for line in lines if "--help" not in line]
    line = (fatal[:1] or errors[-1:] or other[:1] or [f"sbatch exited with code {code}"])[0]
    return re.sub(r"^sbatch: (fatal: |error: )?", "", line)
