"""The run directory: checks before anything is written (an existing run, resume=true with
another model, problems or held-out set, or with no step left), its preparation, and the file that records a failed run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import IO

from areal_fast.launch.config import ConfigError, ExperimentConfig, to_yaml


def check_run_dir(cfg: ExperimentConfig) -> None:
    """Fail early if the run directory cannot be (re)used; changes nothing on disk.

    An existing directory is replaced only with ``overwrite=true`` and only if it is a run
    directory (holds ``config.yaml``), never an arbitrary folder.
    """
    run_dir = cfg.run_dir
    for parent in reversed(run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(
                f"fileroot: {parent} is a file, so run directory {run_dir} cannot be created"
            )
    if cfg.resume:
        if not run_dir.exists():
            raise ConfigError(
                f"resume=true: there is no run to resume at {run_dir} (fileroot/"
                f"experiment_name/trial_name); without resume=true the run starts there, or "
                f"set fileroot, experiment_name and trial_name to those of the run to continue"
            )
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(
                f"resume=true: {run_dir} is not an areal-fast run directory (no config.yaml)"
            )
        _check_same_inputs(cfg, run_dir / "config.yaml")
        _check_steps_left(cfg, run_dir)
        return
    if not run_dir.exists() or _submitted_only(run_dir):
        return
    if not cfg.overwrite:
        if (run_dir / "INTERRUPTED").is_file():
            raise ConfigError(
                f"run directory {run_dir} already exists and was interrupted; "
                f"pass resume=true to continue it, overwrite=true to replace "
                f"it, or choose another trial_name"
            )
        raise ConfigError(
            f"run directory {run_dir} already exists; pass overwrite=true "
            f"or choose another trial_name"
        )
    if not (run_dir.is_dir() and (run_dir / "config.yaml").is_file()):
        raise ConfigError(
            f"overwrite=true refuses to delete {run_dir}: it is not an areal-fast "
            f"run directory (no config.yaml)"
        )


def _check_same_inputs(cfg: ExperimentConfig, saved_path: Path) -> None:
    """A resumed run must train the model its checkpoints hold, on the same problems, and be
    evaluated on the same held-out set (its before → after comparison spans the resume).

    Raises
    ------
    ConfigError
        Naming the first ``model.*``, ``data.*`` or ``eval.max_new_tokens`` key that differs
        from the run's ``config.yaml``.
    """
    from omegaconf import OmegaConf

    saved_all = OmegaConf.to_container(OmegaConf.load(saved_path))
    for section in ("model", "data", "eval"):
        saved = saved_all.get(section, {})
        now = OmegaConf.to_container(OmegaConf.structured(getattr(cfg, section)))
        for key, value in now.items():
            if section == "eval" and key != "max_new_tokens":  # eval.before / after may change
                continue
            if saved.get(key, value) != value:
                raise ConfigError(
                    f"resume=true: {section}.{key} = {value!r} differs from the run's "
                    f"{saved_path} ({saved[key]!r}); a resumed run keeps its model, "
                    f"problems and held-out set"
                )


def _check_steps_left(cfg: ExperimentConfig, run_dir: Path) -> None:
    """Refuse to resume a finished run (``summary.json``) whose newest complete checkpoint
    already has ``total_steps`` (a run that stopped after its last checkpoint but before its
    summary resumes: its final evaluation and model are still to come).

    Raises
    ------
    ConfigError
        Naming the checkpoint and ``total_steps``.
    """
    from areal_fast.controller.checkpoint_manager import CheckpointManager

    if not (run_dir / "summary.json").is_file():
        return
    latest = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.every_steps).latest(
        quiet=True
    )
    if latest is not None and latest.version >= cfg.total_steps:
        raise ConfigError(
            f"resume=true: {run_dir} finished and has trained {latest.version} steps "
            f"({latest.path.name}), total_steps = {cfg.total_steps}: nothing to resume; "
            f"raise total_steps to train further, or start another trial_name"
        )


def prepare_run_dir(cfg: ExperimentConfig) -> Path:
    """Create the run directory (replacing an old run's when allowed) with ``config.yaml``;
    with ``resume`` keep it, only removing the marks of the ended attempt. The directory is
    claimed for this process (:func:`claim_run_dir`) before anything in it changes.

    Raises
    ------
    ConfigError
        The directory cannot be used (:func:`check_run_dir`), cannot be created, or another
        process runs in it.
    """
    check_run_dir(cfg)
    run_dir = cfg.run_dir
    if run_dir.is_dir():
        claim_run_dir(run_dir)
    if cfg.resume:
        for name in ("FAILED", "INTERRUPTED", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        (run_dir / "config.resumed.yaml").write_text(to_yaml(cfg))  # the original stays
        return run_dir
    if run_dir.exists() and not _submitted_only(run_dir):
        release_run_dir(run_dir)
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"fileroot: cannot create run directory {run_dir} ({exc.strerror})"
        ) from exc
    claim_run_dir(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def check_trajectory_dir(cfg: ExperimentConfig) -> None:
    """Create an explicitly set ``trajectory.directory`` now, so a path that cannot hold it
    fails before any work (the run directory's default is created with the run).

    Raises
    ------
    ConfigError
        Naming ``trajectory.directory`` and the OS error.
    """
    store = cfg.trajectory
    if not (store.enabled and store.directory):
        return
    try:
        Path(store.directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"trajectory.directory = {store.directory!r} cannot be created ({exc.strerror or exc})"
        ) from exc


def mark_failed(run_dir: Path, exc: BaseException) -> None:
    """Write ``FAILED``: the error's type and first line (its type alone when it has no
    message)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    (run_dir / "FAILED").write_text(
        f"{type(exc).__name__}: {first}\n" if first else f"{type(exc).__name__}\n"
    )


def write_eval_records(path: Path, records: list[dict]) -> int:
    """Write held-out evaluation ``records`` (uid, answer, completion, correct, reward) to
    ``path`` as JSON lines; returns how many are correct."""
    with path.open("w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    return sum(bool(r["correct"]) for r in records)


def _submitted_only(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds only what ``areal-fast submit`` wrote (its ``slurm/``
    folder): a run not started yet, which the job starts in place."""
    return run_dir.is_dir() and {p.name for p in run_dir.iterdir()} - {LOCK_FILE} == {"slurm"}


LOCK_FILE = ".lock"  # in the run directory: flock-ed by the process that runs in it
_claimed: dict[Path, IO] = {}  # run directory -> its open, locked LOCK_FILE


def claim_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on ``run_dir`` until :func:`release_run_dir` or this process
    ends, so that no second run (a resumed one, a requeued Slurm job's twin) writes into it
    at the same time; a directory this process holds already is held still.

    Raises
    ------
    ConfigError
        Another process holds it (its process id named).
    """
    key = Path(run_dir).resolve()
    if key in _claimed:
        return
    handle = open(key / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(
            f"run directory {run_dir} is in use by another areal-fast process (pid {holder}); "
            f"wait for it to end or stop it"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _claimed[key] = handle


def release_run_dir(run_dir: Path) -> None:
    """Let go of a directory :func:`claim_run_dir` holds (nothing if it holds none)."""
    handle = _claimed.pop(Path(run_dir).resolve(), None)
    if handle is not None:
        handle.close()
