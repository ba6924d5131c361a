"""What a reproducible run (``rollout.reproducible``) sends each rollout worker, and when:
the weight versions one at a time, and with each the worker's groups of the
:class:`~areal_fast.controller.fixed_schedule.FixedSchedule` generated under it, as one
submission (its "chunk").

A worker is told version v + 1 only once every group of its chunk of version v has finished,
so no weight update ever reaches a running sample and every engine batch is made of the same
requests on every run. A worker that dies is given the version of its chunk and the whole
chunk again (groups that had finished too: the engine's batches must be the same); what the
replayed groups report is ignored (:meth:`FixedDispatch.is_replay`), their spool files are
rewritten with the same bytes. The trainer keeps η + 1 weight slots in this mode, so the
version of an unfinished chunk is still in its slot.
"""

from __future__ import annotations

from typing import Callable

from areal_fast.controller.fixed_schedule import FixedSchedule
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger, LedgerError, State
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerHandle


class FixedDispatch:
    """Sends a reproducible run's weights and groups to its rollout workers.

    Parameters
    ----------
    schedule : FixedSchedule
    fleet : RolloutFleet
        The workers, in the fixed order the schedule's worker indices refer to.
    ledger : Ledger
        Made with ``ordered=False`` (groups are submitted per worker, not in id order).
    next_request : callable (group_id) -> GroupRequest
        Called with group ids 0, 1, 2, ... in order (it draws problems in call order).
    buffers : tuple[WeightBufferSpec, ...]
        The trainer's weight slots, n of them (version v in slot v % n; n = max(2, η + 1)).
    version : int
        The policy version every worker serves at the start (0, or a resumed checkpoint's).
    """

    def __init__(
        self,
        schedule: FixedSchedule,
        fleet: RolloutFleet,
        ledger: Ledger,
        next_request: Callable[[int], msg.GroupRequest],
        buffers,
        version: int = 0,
    ):
        self.schedule, self.fleet, self.ledger = schedule, fleet, ledger
        self.next_request, self.buffers = next_request, buffers
        self.told = dict.fromkeys(fleet.names, version)  # the version each worker was sent
        self.chunks: dict[str, list[msg.GroupRequest]] = {}  # each worker's current chunk
        self.replays: dict[str, set[int]] = {}  # finished groups a restarted worker redoes
        self._made: dict[int, msg.GroupRequest] = {}  # requests made ahead, by group id
        # the first group not made yet: batch 0, or after a resume at version s, batch s + η
        # (batches s … s + η − 1 were generated before the checkpoint)
        self._next_id = (version + schedule.eta if version else 0) * schedule.batch_size

    # ---- requests -------------------------------------------------------------------
    def _request(self, group_id: int) -> msg.GroupRequest:
        """The request of ``group_id``; requests are made in id order (the data order)."""
        while self._next_id <= group_id:
            self._made[self._next_id] = self.next_request(self._next_id)
            self._next_id += 1
        return self._made.pop(group_id)

    # ---- what is sent ---------------------------------------------------------------
    def start(self) -> None:
        """Send every worker its chunk of the version it serves now."""
        for worker in self.fleet.workers:
            self._submit(worker, self.told[worker.name])

    def advance(self, worker: WorkerHandle, version: int) -> None:
        """Tell ``worker`` the versions after its own, up to ``version`` (the controller's),
        one at a time, each with its chunk, while the worker has no group running."""
        name = worker.name
        busy = lambda: self.ledger.running_on(name) > 0 or self.replays.get(name)  # noqa: E731
        while not busy() and self.told[name] < version:
            told = self.told[name] + 1
            self.told[name] = told
            self.fleet.send(worker, msg.UpdateWeights(told, self._slot(told)))
            self._submit(worker, told)

    def advance_all(self, version: int) -> None:
        """:meth:`advance` every worker to ``version``."""
        for worker in self.fleet.workers:
            self.advance(worker, version)

    def _submit(self, worker: WorkerHandle, version: int) -> None:
        index = self.fleet.names.index(worker.name)
        chunk = [self._request(g) for g in self.schedule.due(version, index)]
        self.chunks[worker.name] = chunk
        self.replays[worker.name] = set()
        for request in chunk:
            self.ledger.submit(request, worker.name, version)
        if chunk:
            self.fleet.send(worker, msg.SubmitGroups(chunk))

    def restarted(self, worker: WorkerHandle, version: int, newest: int) -> None:
        """``worker`` replaced a dead one of its name. While the trainer's slot of the dead
        one's version still holds it (``newest`` < that version + the number of slots), the
        worker is sent that version and the whole chunk again (the groups still running are
        assigned to it; the finished ones are replayed and their reports ignored). Past that,
        every group of the chunk has finished (the trainer cannot publish beyond version
        v + η while a group of v's chunk, batch v + η, runs; see
        :attr:`~areal_fast.rollout.config.RolloutConfig.weight_slots`), so
        nothing is redone: the worker is told the versions after it like any other.

        Parameters
        ----------
        worker : WorkerHandle
            The new worker.
        version : int
            The controller's version (the newest the trainer reported).
        newest : int
            The newest version written or being written into the trainer's slots.

        Raises
        ------
        LedgerError
            A group of the chunk still waits though its version's slot was overwritten (the
            slot count does not cover the staleness bound).
        """
        name, told = worker.name, self.told[worker.name]
        waiting = {r.group_id for r in self.ledger.waiting()}
        chunk = self.chunks.get(name, [])
        if newest >= told + len(self.buffers):
            if any(r.group_id in waiting for r in chunk):
                raise LedgerError(
                    f"rollout worker {name!r} restarted with groups of version {told} "
                    f"unfinished, but the trainer's slot of that version holds {newest}"
                )
            self.replays[name] = set()
            self.advance(worker, version)
            return
        if told > 0:
            self.fleet.send(worker, msg.UpdateWeights(told, self._slot(told)))
        for request in chunk:
            if request.group_id in waiting:
                self.ledger.assign(request.group_id, name, told)
        self.replays[name] = {r.group_id for r in chunk} - waiting
        if chunk:
            self.fleet.send(worker, msg.SubmitGroups(chunk))

    def _slot(self, version: int):
        """The trainer's slot of ``version`` (version v in slot v % n)."""
        return self.buffers[version % len(self.buffers)]

    def is_replay(self, worker: str, group_id: int) -> bool:
        """Whether ``group_id`` reported by ``worker`` is a finished group it redid."""
        replays = self.replays.get(worker, set())
        if group_id not in replays:
            return False
        replays.discard(group_id)
        return True

    def serving(self, name: str) -> int:
        """The version worker ``name`` was told (the one it should serve)."""
        return self.told[name]

    def batch(self, k: int) -> list[int] | None:
        """The group ids of batch ``k`` kept for training once all of them have finished
        (dropped ones left out), or None while some still run or wait."""
        ids = self.schedule.batch_ids(k)
        if any(g >= self._next_id or g in self._made or self.ledger.is_running(g) for g in ids):
            return None
        return [g for g in ids if self.ledger.state(g) is State.READY]
