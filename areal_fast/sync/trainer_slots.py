"""Trainer rank 0's weight slots: host shared memory, and their CUDA twins on a GPU trainer.

Version v goes into slot v % n, n the number of slots: two, or more where rollout workers may
lag further behind the trainer (a reproducible run keeps η + 1, so a replaced worker finds the
version of its groups). Every trainer keeps n host slots
(:class:`~areal_fast.sync.shared_memory.SharedWeightBuffer`: engines that map them, weight
links that send them to other nodes). A trainer whose parameters are on a CUDA device also
keeps n :class:`~areal_fast.sync.cuda_slots.CudaWeightSlot` of the same layout, read by
engines on the same GPU; once the controller has said that no worker reads the host slots
(:attr:`TrainerSlots.host_readers` False), each version is written device to device into the
CUDA slot only. The weights are written in ``dtype`` (the engines'), whatever the dtype of
the trainer's parameters.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from areal_fast.sync.cuda_slots import CudaWeightSlot, slot_gpu
from areal_fast.sync.shared_memory import SharedWeightBuffer, remove_orphaned_buffers
from areal_fast.sync.slot_broadcast import buffer_checksum

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def cast_weights(named: NamedTensors, dtype: Optional[torch.dtype]) -> Iterator:
    """``named`` with every floating-point tensor cast to ``dtype`` (None: unchanged); an
    integer or bool buffer keeps its dtype."""
    for name, tensor in named:
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


class TrainerSlots:
    """The weight slots of one trainer rank (none on ranks > 0).

    Build with :meth:`start`. Ranks > 0 take part in every gather (FSDP2's ``named_weights``
    is a collective) but keep nothing.

    Attributes
    ----------
    host : list[SharedWeightBuffer]
        The host slots (empty on ranks > 0).
    cuda : list[CudaWeightSlot]
        Their CUDA twins (empty unless the trainer is on a CUDA device and asked for them).
    host_readers : bool
        Whether a worker or a weight link reads the host slots: each version is written
        into them too (True until the controller says otherwise).
    """

    def __init__(self, host: list, cuda: list, dtype: Optional[torch.dtype] = None):
        self.host, self.cuda, self.dtype = host, cuda, dtype
        self.host_readers = True

    @classmethod
    def start(
        cls,
        named_weights: NamedTensors,
        version: int,
        leader: bool,
        cuda_twins: bool = False,
        dtype: Optional[str] = None,
        count: int = 2,
    ) -> "TrainerSlots":
        """Rank 0: ``count`` host slots (first deleting the slots that killed processes left
        on this node), with ``cuda_twins`` and parameters on a CUDA device also ``count`` CUDA
        slots; the start weights go into slot ``version % count`` of each.

        Parameters
        ----------
        named_weights : iterable of (str, Tensor)
            The trainer's full weights (consumed on every rank).
        version : int
            The version they are.
        leader : bool
            This is rank 0 (the only rank that keeps slots).
        cuda_twins : bool
            Keep CUDA slots when the weights are on a CUDA device (``sync.transport`` auto or
            cuda_ipc).
        dtype : str, optional
            The dtype the slots hold (``model.dtype``; None: the weights' own).
        count : int
            The number of slots (at least 2).

        Raises
        ------
        ValueError
            ``count`` < 2.
        OSError
            /dev/shm cannot hold the host slots.
        torch.OutOfMemoryError
            The GPU cannot hold the CUDA slots.
        """
        if count < 2:
            raise ValueError(f"TrainerSlots: count = {count}, at least 2 slots are needed")
        torch_dtype = getattr(torch, dtype) if dtype else None
        if not leader:
            for _ in named_weights:
                pass
            return cls([], [], torch_dtype)
        remove_orphaned_buffers()
        weights = list(cast_weights(named_weights, torch_dtype))
        host = [SharedWeightBuffer.create(iter(weights)) for _ in range(count)]
        host[version % count].write(iter(weights))
        cuda = []
        device = weights[0][1].device if weights else torch.device("cpu")
        if cuda_twins and device.type == "cuda":
            cuda = [CudaWeightSlot.create(buffer.spec, device) for buffer in host]
            cuda[version % count].write(iter(weights))
            cuda[version % count].finish_write()
        return cls(host, cuda, torch_dtype)

    def __bool__(self) -> bool:
        return bool(self.host)

    def __len__(self) -> int:
        """The number of slots (0 on ranks > 0)."""
        return len(self.host)

    def __getitem__(self, slot: int) -> SharedWeightBuffer:
        """Host slot ``slot`` (what weight links send)."""
        return self.host[slot]

    @property
    def specs(self) -> tuple:
        """The slots' WeightBufferSpec, in slot order, each with its CUDA twin's export when there is one
        (what the controller names in every UpdateWeights)."""
        return tuple(c.spec for c in self.cuda) if self.cuda else tuple(h.spec for h in self.host)

    @property
    def update_bytes(self) -> int:
        """Bytes of one published version: the tensors' sizes in the slots' dtype, padding
        excluded (with LoRA: the adapter's alone); 0 on ranks > 0."""
        return sum(e.nbytes for e in self.host[0].spec.entries) if self.host else 0

    @property
    def gpu_uuid(self) -> str:
        """The GPU of the CUDA slots ("" without them)."""
        return slot_gpu(self.cuda[0].spec) if self.cuda else ""

    def publish(self, named_weights: NamedTensors, slot: int) -> None:
        """Write a version into ``slot``: its CUDA twin (device to device) and, while
        :attr:`host_readers`, its host slot; returns once the device copies are done. Ranks
        > 0 only take part in the gather.

        Raises
        ------
        ValueError
            The weights do not match the slots' layout (names, shapes; see
            :meth:`SharedWeightBuffer.write`).
        """
        if not self.host:
            for _ in named_weights:
                pass
            return
        weights = cast_weights(named_weights, self.dtype)
        if not self.cuda:
            self.host[slot].write(weights)
            return
        self.cuda[slot].write(weights)
        self.cuda[slot].finish_write()
        if self.host_readers:  # from the CUDA slot: already in the slots' dtype
            self.host[slot].write(self.cuda[slot].named_tensors())

    def checksum(self, slot: int) -> str:
        """CRC-32 of slot ``slot`` as its readers see it ("" on ranks > 0)."""
        if not self.host:
            return ""
        return buffer_checksum(self.cuda[slot] if self.cuda else self.host[slot])

    def close(self) -> None:
        """Drop the CUDA slots, unmap and delete the host slots."""
        for buffer in [*self.cuda, *self.host]:
            buffer.close()
