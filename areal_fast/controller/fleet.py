"""The rollout workers as the controller sees them: one handle per worker (a restarted worker
takes the dead one's place under the same name), when each last made progress, and which were
asked to cancel their rollouts and have not answered yet."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError, WorkerHandle

log = logging.getLogger("areal_fast.controller")


class RolloutFleet:
    """The controller's rollout workers.

    Parameters
    ----------
    workers : list[WorkerHandle]
        Started rollout workers, in a fixed order (work and evaluation shares follow it).

    Attributes
    ----------
    workers : list[WorkerHandle]
        The current handles, in the order given (a replaced one keeps its place).
    progress : dict[str, float]
        Worker name → ``time.monotonic()`` when it last finished a group or went from idle to
        busy (the stall deadline counts from it).
    cancelling : set[str]
        Workers sent :class:`~areal_fast.wire.messages.CancelAll` that have not answered.
    """

    def __init__(self, workers: list[WorkerHandle]):
        self.workers = list(workers)
        self.progress = dict.fromkeys(self.names, time.monotonic())
        self.cancelling: set[str] = set()

    @property
    def names(self) -> list[str]:
        """Worker names, in order."""
        return [w.name for w in self.workers]

    def send(self, worker: WorkerHandle, message) -> None:
        """Send ``message`` (a message dataclass, or one encoded once for many) to ``worker``.
        A dead worker is noticed by the next wait (its sentinel or the end of its channel)
        and replaced there, so a failed send is only logged here.

        Raises
        ------
        WorkerError
            The send failed for another reason than the worker's death.
        """
        try:
            worker.send(message)
        except WorkerError as exc:
            if not exc.died:
                raise
            log.warning("%s (while sending %s)", exc, type(message).__name__)

    def progressed(self, name: str, when: float) -> None:
        """Worker ``name`` made progress at ``when`` (``time.monotonic()``)."""
        self.progress[name] = when

    def restart_clocks(self, when: float) -> None:
        """Every worker's progress clock starts at ``when`` (``time.monotonic()``)."""
        self.progress = dict.fromkeys(self.names, when)

    def replace(self, new: WorkerHandle, died_at: float) -> None:
        """``new`` takes the place of the worker of the same name, which died at ``died_at``
        (``time.monotonic()``: its progress clock restarts from the death).

        Raises
        ------
        KeyError
            No worker of that name.
        """
        for index, worker in enumerate(self.workers):
            if worker.name == new.name:
                self.workers[index] = new
                self.progress[new.name] = died_at
                return
        raise KeyError(f"no rollout worker named {new.name!r}")

    def cancel_all(self) -> None:
        """Ask every worker to cancel its rollouts; each is in :attr:`cancelling` until its
        :class:`~areal_fast.wire.messages.Cancelled` (:meth:`cancelled`)."""
        self.cancelling = set(self.names)
        for worker in self.workers:
            self.send(worker, msg.CancelAll())

    def cancelled(self, name: str) -> None:
        """Worker ``name`` answered the cancel."""
        self.cancelling.discard(name)

    def drop_shards(self, groups: Iterable[msg.GroupDone]) -> None:
        """Tell the workers that hold these finished groups' shards to delete them (one
        :class:`~areal_fast.wire.messages.DropShards` per worker, groups in the order given)."""
        by_worker: dict[str, list[int]] = {}
        for group in groups:
            by_worker.setdefault(group.shard.node_id, []).append(group.group_id)
        for worker in self.workers:
            if worker.name in by_worker:
                self.send(worker, msg.DropShards(by_worker[worker.name]))
