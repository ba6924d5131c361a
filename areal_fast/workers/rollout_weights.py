"""A rollout worker's weight updates: pause the engine, install the new version, resume.

Two sources, one install: a worker on trainer rank 0's node maps the trainer's slot named by
each :class:`~areal_fast.wire.messages.UpdateWeights` (its CUDA twin, copied device to
device, when the engine runs on the GPU that holds it, see :mod:`areal_fast.sync.cuda_slots`;
else the shared-memory slot); a worker given a
:class:`~areal_fast.wire.messages.ConnectWeights` receives every version over its weight
link into a node-local buffer of the same layout
(:class:`~areal_fast.sync.slot_broadcast.SlotSubscriber`) and ignores the slot names. Either
way the engine pauses in its pause mode only for the install, and the worker answers
:class:`~areal_fast.wire.messages.WeightsUpdated`.

An evaluation of a given version (:meth:`WorkerWeights.evaluate_at`) pins the weights: it
starts once that version (or a newer one) is served, and from its start every newer version
waits (in order) until it is done (:meth:`WorkerWeights.evaluated`), so its samples all run on
the weights it started on. One that has not started holds nothing back: a worker that never
gets its version (restarted, or a link that skipped it) runs it on the next one.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from areal_fast._nodes import node_id, reachable_host
from areal_fast.sync.config import SyncConfig, cuda_slots_usable
from areal_fast.sync.cuda_slots import CudaWeightSlot, engine_gpu, slot_gpu
from areal_fast.sync.shared_memory import SharedWeightBuffer, remove_orphaned_buffers
from areal_fast.sync.slot_broadcast import SlotSubscriber, buffer_checksum
from areal_fast.wire import messages as msg

PAUSE_TIMEOUT_S = 300.0


class WorkerWeights:
    """Weight installs of one rollout worker.

    Parameters
    ----------
    engine : AsyncInferenceEngine
        ``pause`` / ``resume`` and either ``update_weights_from_buffer(spec, version)`` (it
        maps a buffer itself) or ``update_weights(named_tensors, version)``; an in-process
        engine on a CUDA device (its ``device``) takes the trainer's CUDA slots on that GPU.
    conn : MessageChannel
        To the controller (for :class:`WeightsUpdated`).
    post : callable ((kind, item)) -> None
        Puts an item into the worker's inbox: ``("weights", (version, buffer, seconds))``
        from the weight link, ``("error", exc)`` when the link fails.
    host : str
        The worker's bind host (its weight link binds the node's address).
    sync : SyncConfig, optional
        ``sync.checksum``: send a CRC-32 of every installed version; ``sync.transport``:
        whether CUDA slots may be used (auto, cuda_ipc).
    """

    def __init__(self, engine, conn, post, host: str, sync: Optional[SyncConfig] = None):
        self.engine, self.conn, self.post = engine, conn, post
        self.host, self.checksum = host, bool(sync and sync.checksum)
        self.transport = sync.transport if sync else "auto"
        self.gpu = engine_gpu(engine)  # "" unless an in-process engine on a GPU
        self.slots: dict[str, SharedWeightBuffer] = {}  # the trainer's, mapped on first use
        self.link: Optional[SlotSubscriber] = None
        self.served = 0  # the version installed last
        self.announced = 0  # the newest version an UpdateWeights named
        self._held: list[Callable[[], None]] = []  # work that waits for `announced`
        self._pins: list[int] = []  # version of the evaluation started, not done (one)
        self._waiting: list[Callable[[], None]] = []  # installs of versions past a pin
        self._evals: list[tuple[int, Callable[[], None]]] = []  # (version, start) not started

    def ready(self, name: str, address: str) -> msg.WorkerReady:
        """The worker's :class:`WorkerReady`: its shard-server ``address``, node and GPU."""
        return msg.WorkerReady(name, address, node_id=node_id(), gpu_uuid=self.gpu)

    def when_current(self, work: Callable[[], None]) -> None:
        """Run ``work`` (e.g. start submitted groups) once this worker serves the newest
        version the controller announced: at once, or after the link delivered it. Work
        sent after an :class:`UpdateWeights` then never runs on older weights, as with the
        trainer's slots, whose update is done before the next message is read."""
        if self.served >= self.announced:
            work()
        else:
            self._held.append(work)

    def drop_held(self) -> None:
        """Forget the work still waiting for a version (the end of training cancels it);
        evaluations waiting for theirs are kept."""
        self._held.clear()

    def evaluate_at(self, version: Optional[int], start: Callable[[], None]) -> None:
        """Run ``start`` (an evaluation's groups) once this worker serves ``version`` or a
        newer one (at once if it does already); from then until :meth:`evaluated`
        (``version``) no newer version is installed. ``version`` None: as
        :meth:`when_current`, no pin. Evaluations run one at a time, in order of arrival
        among those whose version is served."""
        if version is None:
            self.when_current(start)
            return
        self._evals.append((version, start))
        self._start_evals()

    def evaluated(self, version: Optional[int]) -> None:
        """The evaluation of ``version`` is done: install the versions it held back (None:
        an evaluation without a pin, nothing to do)."""
        if version is None:
            return
        self._pins.remove(version)
        waiting, self._waiting = self._waiting, []
        for install in waiting:
            install()  # each re-checks the pins: an evaluation it starts may pin again
        self._start_evals()

    def _start_evals(self) -> None:
        """Start the first waiting evaluation whose version is served, one at a time."""
        while not self._pins:
            due = next(((v, s) for v, s in self._evals if self.served >= v), None)
            if due is None:
                return
            self._evals.remove(due)
            self._pins.append(due[0])
            due[1]()

    def _pinned(self, version: int, install: Callable[[], None]) -> bool:
        """Whether a running evaluation holds ``version`` back (then ``install`` waits)."""
        if self._pins and version > min(self._pins):
            self._waiting.append(install)
            return True
        return False

    def on_update(self, message: msg.UpdateWeights) -> None:
        """Install ``message.version`` from the trainer's slot (a linked worker gets it over
        its link instead and ignores this); it waits while an evaluation pins older weights."""
        self.announced = max(self.announced, message.version)
        if self.link is not None or self._pinned(message.version, lambda: self.on_update(message)):
            return
        spec, start = message.buffer, time.perf_counter()
        if cuda_slots_usable(self.transport, self.gpu, slot_gpu(spec)):
            if spec.path not in self.slots:  # mapped once, device to device from then on
                self.slots[spec.path] = CudaWeightSlot.attach(spec)
        elif spec.path not in self.slots and (
            self.checksum or not hasattr(self.engine, "update_weights_from_buffer")
        ):
            self.slots[spec.path] = SharedWeightBuffer.attach(spec)
        slot = self.slots.get(spec.path)
        self._install(message.version, spec, slot)
        self._ack(message.version, time.perf_counter() - start, slot)

    def connect(self, message: msg.ConnectWeights) -> None:
        """Receive every version over ``message.link`` from now on (a previous link closes)."""
        if self.link is not None:
            self.link.close()
        else:  # this node may not be the controller's: clear what killed processes left
            remove_orphaned_buffers()
        self.link = SlotSubscriber(
            message.link,
            reachable_host(self.host),
            deliver=lambda version, buffer, seconds: self.post(
                ("weights", (version, buffer, seconds))
            ),
            fail=lambda exc: self.post(("error", exc)),
        )
        self.link.start()

    def install_received(self, item: tuple) -> None:
        """Install a version the link delivered: ``(version, node-local buffer, seconds the
        transfer took)``; the link may then reuse the buffer."""
        version, buffer, received = item
        if self._pinned(version, lambda: self.install_received(item)):
            return  # the link sends nothing more until this one is installed
        start = time.perf_counter()
        self._install(version, buffer.spec, buffer)
        self._ack(version, received + time.perf_counter() - start, buffer)
        self.link.installed()

    def _install(self, version: int, spec, buffer: Optional[SharedWeightBuffer]) -> None:
        self.engine.pause(PAUSE_TIMEOUT_S)  # in the engine's pause mode (rollout.pause_mode)
        if isinstance(buffer, CudaWeightSlot):  # device to device, done before the ack
            self.engine.update_weights(buffer.named_tensors(), version)
            buffer.finish_read()
        elif hasattr(self.engine, "update_weights_from_buffer"):  # it maps the buffer itself
            self.engine.update_weights_from_buffer(spec, version)
        else:
            self.engine.update_weights(buffer.named_tensors(), version)
        self.engine.resume()

    def _ack(self, version: int, seconds: float, buffer: Optional[SharedWeightBuffer]) -> None:
        checksum = buffer_checksum(buffer) if self.checksum and buffer is not None else ""
        self.served = max(self.served, version)
        self.conn.send(msg.WeightsUpdated(version, seconds, checksum))
        self._start_evals()
        if self.served >= self.announced:
            held, self._held = self._held, []
            for work in held:
                work()

    def close(self) -> None:
        """Close the link and unmap the trainer's slots."""
        if self.link is not None:
            self.link.close()
        for slot in self.slots.values():
            slot.close()
