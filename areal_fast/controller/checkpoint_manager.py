"""Recoverable checkpoints of a run: trainer state plus controller state, written atomically.

A checkpoint is the directory ``<root>/step-<version>/`` holding the trainer's state (written
by the trainer ranks: weights, optimizer, LR schedule, RNG states, version; its
``train_state.json`` lists every file with its size and is written last) and
``controller.json`` (policy version, how many prompt groups were drawn, the run's counters).
Both are first written under a temporary name in ``root``; the rename to ``step-<version>``
is the commit, so a directory of that name is complete unless its files were damaged later.
:meth:`CheckpointManager.latest` returns the newest complete one and names each it skips.

Pending rollouts are not saved: groups that were running or finished but not yet trained at
the checkpoint are dropped on resume (``controller.json`` says how many) and their problems
are not redrawn. In synchronous mode (η = 0) there are none, so a resumed run continues
exactly as the uninterrupted one; a reproducible run (``rollout.reproducible``) keeps them
(:mod:`~areal_fast.controller.held_rollouts`), so it continues exactly at any η.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from areal_fast.controller.held_rollouts import HeldRollouts
from areal_fast.train.checkpoint import STATE_FILE, read_train_state, write_json_durably
from areal_fast.wire import messages as msg

log = logging.getLogger("areal_fast.checkpoints")
CONTROLLER_FILE = "controller.json"
DAMAGED_FILE = "DAMAGED"  # written when the trainer could not load the checkpoint
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    """A complete checkpoint: its directory, policy version and controller state."""

    path: Path
    version: int
    controller: dict


class CheckpointManager:
    """Where and when checkpoints are written, and which one a resume uses.

    Parameters
    ----------
    root : str or Path
        Folder of the run's checkpoints (``<run dir>/checkpoints``).
    every_steps : int
        Save after every this many policy versions (0: never, except ``final``).
    keep : int
        Complete checkpoints kept; older ones are deleted after a new one is committed.
    total_steps : int
        The last version is always saved when checkpoints are on.
    """

    def __init__(self, root, every_steps: int, keep: int = 2, total_steps: int = 0):
        if every_steps < 0 or keep < 1:
            raise ValueError(
                f"checkpoint.every_steps = {every_steps} must be >= 0 and "
                f"checkpoint.keep = {keep} >= 1"
            )
        self.root = Path(root)
        self.every_steps, self.keep, self.total_steps = every_steps, keep, total_steps
        self.skipped: list[str] = []  # why each incomplete checkpoint was ignored

    def due(self, version: int) -> bool:
        """Whether to save at ``version``."""
        if self.every_steps == 0 or version == 0:
            return False
        return version % self.every_steps == 0 or version == self.total_steps

    def begin(self, version: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``version``."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{version:08d}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, version: int, controller_state: dict) -> Path:
        """Add ``controller.json`` to the trainer's files in ``tmp`` and rename it to
        ``step-<version>`` (replacing an older one of that version); prune old ones.

        Raises
        ------
        ValueError
            ``tmp`` lacks the trainer's ``train_state.json`` (the trainer did not finish).
        """
        if not (tmp / STATE_FILE).is_file():
            raise ValueError(f"checkpoint {tmp}: the trainer wrote no {STATE_FILE}")
        write_json_durably(
            tmp / CONTROLLER_FILE, {**controller_state, "version": version}, indent=1
        )
        final = self.root / f"step-{version:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def _prune(self) -> None:
        complete = sorted(self._step_dirs(), reverse=True)
        for _, path in complete[self.keep :]:
            shutil.rmtree(path, ignore_errors=True)

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                out.append((int(match.group(1)), path))
        return out

    def latest(self, quiet: bool = False) -> Optional[Checkpoint]:
        """The newest complete checkpoint, or None. Each damaged or partial one on the way is
        skipped with a warning naming it and the reason (also kept in :attr:`skipped`), unless
        ``quiet`` (a look that records nothing)."""
        for version, path in sorted(self._step_dirs(), reverse=True):
            try:
                controller = check_checkpoint(path)
            except ValueError as exc:
                if not quiet:
                    reason = f"checkpoint {path} ignored: {exc}"
                    log.warning(reason)
                    self.skipped.append(reason)
                continue
            return Checkpoint(path, version, controller)
        return None

    @staticmethod
    def mark_damaged(path: Path, reason: str) -> None:
        """Mark checkpoint ``path`` as unusable (the trainer failed to load it), so that
        :meth:`latest` skips it from now on; nothing is deleted."""
        (Path(path) / DAMAGED_FILE).write_text(reason + "\n")

    def remove_temporaries(self) -> None:
        """Delete temporary directories left by saves that never committed (a crash)."""
        for tmp in self.root.glob(".tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)


def check_checkpoint(path: Path) -> dict:
    """Validate a checkpoint directory; returns its controller state.

    Raises
    ------
    ValueError
        One line naming the missing, unreadable or truncated file.
    """
    if (path / DAMAGED_FILE).is_file():
        reason = (path / DAMAGED_FILE).read_text().strip()
        raise ValueError(f"the trainer could not load it before ({reason})")
    controller = _read_json(path / CONTROLLER_FILE)
    train = read_train_state(path)  # the trainer's own check: every listed file by size
    if "version" not in controller or not isinstance(controller["version"], int):
        raise ValueError(f"{path / CONTROLLER_FILE} has no integer 'version'")
    if train["version"] != controller["version"]:
        raise ValueError(
            f"{path / STATE_FILE} is for version {train['version']}, "
            f"{CONTROLLER_FILE} for {controller['version']}"
        )
    return controller


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (partial write)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PendingSaves:
    """The controller's side of checkpoints in progress: its state at each recent version,
    and the trainer saves asked for and not yet answered.

    Parameters
    ----------
    manager : CheckpointManager or None
        When and where to save (None: never; every method is then a no-op).
    held : HeldRollouts, optional
        A reproducible run's: a checkpoint is committed only once it holds the rollouts
        of the batches it will train (:mod:`~areal_fast.controller.held_rollouts`).
    """

    def __init__(self, manager: Optional[CheckpointManager], held: Optional[HeldRollouts] = None):
        self.manager, self.held = manager, held
        self.snapshots: dict[int, dict] = {}  # version -> controller state at that step
        self.saving: dict[str, tuple[int, float]] = {}  # temp dir -> (version, asked at)
        self.answered: dict[str, int] = {}  # temp dir -> version: saved, not yet committed

    def after_step(
        self, version: int, state: dict, finished: Iterable[msg.GroupDone] = ()
    ) -> Optional[str]:
        """Remember the controller ``state`` of ``version``; returns the temporary directory
        the trainer should save its state into when a checkpoint is due (else None).
        ``finished``: the groups finished so far that a :class:`HeldRollouts` may need."""
        if self.manager is None:
            return None
        self.snapshots[version] = state
        tmp = None
        if self.manager.due(version):
            tmp = str(self.manager.begin(version))
            self.saving[tmp] = (version, time.monotonic())
            if self.held is not None:
                self.held.begin(tmp, version, list(finished))
        oldest = min((v for v, _ in self.saving.values()), default=version)
        for old in [v for v in self.snapshots if v < oldest]:
            del self.snapshots[old]
        return tmp

    def commit(self, path: str, version: int) -> Optional[Path]:
        """The trainer saved ``version`` into ``path``: write the checkpoint; returns its
        directory, or None if no save into ``path`` was asked for.

        The save stays in :attr:`saving` until its folder is renamed, and is recorded in
        :attr:`answered` meanwhile: a Ctrl-C that cuts the commit short leaves it to
        :meth:`finish_answered` instead of losing a checkpoint whose files are complete.

        Raises
        ------
        RuntimeError
            The controller recorded no state for ``version``.
        """
        if path not in self.saving:
            return None
        if version not in self.snapshots:
            raise RuntimeError(
                f"the trainer saved policy version {version} into {path} before the "
                f"controller recorded that step"
            )
        self.answered[path] = version
        if self.held is not None:
            self.held.settle(path, version)
        if self.held is not None and not self.held.complete(path):
            return Path(path)  # committed by `kept` once its rollouts are in
        return self._commit_answered(path)

    def kept(self, done: msg.GroupDone) -> list[Path]:
        """A group finished: keep it in the checkpoints that need it; commit those answered
        by the trainer that are complete now. Returns their directories."""
        if self.held is None:
            return []
        self.held.keep(done)
        complete = [p for p in self.answered if self.held.complete(p)]
        return [self._commit_answered(path) for path in complete]

    def finish_answered(self) -> list[Path]:
        """Commit the saves the trainer answered whose commit was cut short (by Ctrl-C);
        returns their directories (one still waiting for its rollouts is not committed)."""
        complete = [p for p in self.answered if self.held is None or self.held.complete(p)]
        return [self._commit_answered(path) for path in complete]

    def commit_written(self) -> list[Path]:
        """Commit the saves whose trainer files are complete on disk (its ``train_state.json``
        is written last) though its answer was not handled (a Ctrl-C between receiving and
        handling it), under the version that file names, once the controller has recorded
        that step; returns their directories."""
        done = []
        for path in list(self.saving):
            state = Path(path) / STATE_FILE
            if not state.is_file():
                continue
            try:
                version = json.loads(state.read_text()).get("version")
            except ValueError:  # the trainer is writing it right now
                continue
            if version in self.snapshots:
                done.append(self.commit(path, version))
        return done

    def _commit_answered(self, path: str) -> Path:
        version = self.answered[path]
        if Path(path).exists():
            final = self.manager.commit(Path(path), version, self.snapshots[version])
        else:  # renamed already: the commit was cut short after its last step
            final = self.manager.root / f"step-{version:08d}"
        del self.answered[path]
        del self.saving[path]
        if self.held is not None:
            self.held.forget(path)
        log.info("checkpoint of policy version %d written to %s", version, final)
        return final

    def slow(self, now: float, limit: float) -> Optional[str]:
        """The first save asked for more than ``limit`` seconds before ``now`` (None)."""
        return next((p for p, (_, asked) in self.saving.items() if now - asked > limit), None)
