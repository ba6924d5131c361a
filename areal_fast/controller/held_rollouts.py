"""The rollouts a reproducible run's checkpoint carries (``rollout.reproducible``).

A checkpoint of version s is trained up to batch s − 1, but batches s … s + η − 1 were
generated under versions before s, whose weights it does not hold. So its commit waits until
each group of those batches has finished, and the checkpoint keeps every one of them under
``rollouts/``: ``<group id>.safetensors`` (a hard link to the group's spool file, or a copy)
and ``<group id>.msg`` (its :class:`~areal_fast.wire.messages.GroupDone`, msgpack-encoded
by :mod:`~areal_fast.wire.codec`). A run resumed from it trains those groups as they were and
generates from batch s + η on, exactly as the uninterrupted run did.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from areal_fast.controller.fixed_schedule import FixedSchedule
from areal_fast.wire import messages as msg
from areal_fast.wire.codec import decode_message, encode_message

ROLLOUTS_DIR = "rollouts"
RESTORED_NODE = "checkpoint"  # node_id of a restored group's shard (read from its file)


class HeldRollouts:
    """Which groups each pending checkpoint still waits for, and their files.

    Parameters
    ----------
    schedule : FixedSchedule
    """

    def __init__(self, schedule: FixedSchedule):
        self.schedule = schedule
        self.missing: dict[str, set[int]] = {}  # checkpoint temp dir -> groups not kept yet

    def needed(self, version: int) -> list[int]:
        """Group ids of batches ``version`` … ``version + η − 1`` (the run's last batch at
        most): generated before the checkpoint of ``version``, trained after it."""
        last = min(version + self.schedule.eta, self.schedule.total_steps)
        return [g for k in range(version, last) for g in self.schedule.batch_ids(k)]

    def begin(self, tmp: str, version: int, finished: list[msg.GroupDone]) -> None:
        """A checkpoint asked for after step ``version`` is being written into ``tmp``:
        keep the ``finished`` groups it may need now, wait for the others (:meth:`keep`).
        The trainer saves the version it has reached when the request arrives, ``version``
        or ``version + 1`` (one batch is sent ahead), so until :meth:`settle` the groups of
        both are kept."""
        self.missing[tmp] = set(self.needed(version)) | set(self.needed(version + 1))
        (Path(tmp) / ROLLOUTS_DIR).mkdir()
        for done in finished:
            self.keep(done)

    def settle(self, tmp: str, version: int) -> None:
        """The trainer saved ``version`` into ``tmp``: the checkpoint keeps (and waits for)
        only the groups that version needs."""
        needed = set(self.needed(version))
        folder = Path(tmp) / ROLLOUTS_DIR
        for path in folder.iterdir():
            if int(path.name.split(".")[0]) not in needed:
                path.unlink()
        self.missing[tmp] = self.missing.get(tmp, set()) & needed

    def keep(self, done: msg.GroupDone) -> None:
        """A group finished (kept or dropped): put it into each pending checkpoint that
        needs it."""
        for tmp, missing in self.missing.items():
            if done.group_id in missing:
                _write_group(Path(tmp) / ROLLOUTS_DIR, done)
                missing.discard(done.group_id)

    def complete(self, tmp: str) -> bool:
        """Whether the checkpoint in ``tmp`` holds every group it needs."""
        return not self.missing.get(tmp)

    def forget(self, tmp: str) -> None:
        """The checkpoint in ``tmp`` was committed or given up."""
        self.missing.pop(tmp, None)


def _write_group(folder: Path, done: msg.GroupDone) -> None:
    gid = done.group_id
    if done.shard is not None:
        target = folder / f"{gid}.safetensors"
        try:
            os.link(done.shard.path, target)
        except OSError:  # another file system: a copy
            shutil.copyfile(done.shard.path, target)
    (folder / f"{gid}.msg").write_bytes(encode_message(done))


def restore_groups(checkpoint: Path, into: Path) -> list[msg.GroupDone]:
    """The groups a checkpoint keeps, in id order, each shard copied into ``into`` (the
    checkpoint may be deleted, ``checkpoint.keep``, while the run still needs them; the end
    of the run deletes the copies).

    Raises
    ------
    ValueError
        A group's files are missing or unreadable (the file named).
    """
    folder = Path(checkpoint) / ROLLOUTS_DIR
    if not folder.is_dir():
        return []
    into.mkdir(parents=True, exist_ok=True)
    groups = []
    for path in sorted(folder.glob("*.msg"), key=lambda p: int(p.stem)):
        try:
            done = decode_message(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read the kept rollout ({exc})") from None
        if done.shard is not None:
            copy = into / f"{done.group_id}.safetensors"
            try:
                shutil.copyfile(folder / f"{done.group_id}.safetensors", copy)
            except OSError as exc:
                raise ValueError(f"{folder}: rollout {done.group_id}'s shard ({exc})") from None
            done.shard = replace(done.shard, node_id=RESTORED_NODE, node_addr="", path=str(copy))
        groups.append(done)
    return groups
