"""A rollout worker's weight updates: pause the engine, install the new version, resume.

Two sources, one install: a worker on trainer rank 0's node maps the trainer's slot named by
each :class:`~areal_fast.controller.messages.UpdateWeights` (its CUDA twin, copied device to
device, when the engine runs on the GPU that holds it, see :mod:`areal_fast.sync.cuda_slots`;
else the shared-memory slot); a worker given a
:class:`~areal_fast.controller.messages.ConnectWeights` receives every version over its weight
link into a node-local buffer of the same layout
(:class:`~areal_fast.sync.slot_broadcast.SlotSubscriber`) and ignores the slot names. Either
way the engine pauses in its pause mode only for the install, and the worker answers
:class:`~areal_fast.controller.messages.WeightsUpdated`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from areal_fast._nodes import node_id, reachable_host
from areal_fast.controller import messages as msg
from areal_fast.sync.config import SyncConfig, cuda_slots_usable
from areal_fast.sync.cuda_slots import CudaWeightSlot, engine_gpu, slot_gpu
from areal_fast.sync.shared_memory import SharedWeightBuffer, remove_orphaned_buffers
from areal_fast.sync.slot_broadcast import SlotSubscriber, buffer_checksum

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
        """Forget the work still waiting for a version (the end of training cancels it)."""
        self._held.clear()

    def on_update(self, message: msg.UpdateWeights) -> None:
        """Install ``message.version`` from the trainer's slot (a linked worker gets it over
        its link instead and ignores this)."""
        self.announced = max(self.announced, message.version)
        if self.link is not None:
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
