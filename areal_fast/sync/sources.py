"""Weight sources: which tensors a trainer sends, under which names, gathered how.

:class:`ModuleSource` walks a module's parameters (tied parameters once); a parameter that is
a DTensor (FSDP2 ``fully_shard``) is gathered with ``full_tensor()``. Gathering is a
collective, so every training rank iterates the same tensors in the same order
(:meth:`ModuleSource.tensors`) and only the sending rank (``sending=True``) packs them:
:class:`FSDP2Source` sets that from the rank. A ``name_map`` hook renames trainer names to the
engine's (or drops a tensor by returning ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

NameMap = Callable[[str], Optional[str]]


@dataclass(frozen=True)
class SourceTensor:
    """One tensor a source sends.

    Attributes
    ----------
    name : str
        Engine-side name (after ``name_map``).
    shape : tuple[int, ...]
        Global (unsharded) shape.
    dtype : torch.dtype
        Trainer dtype (the sender may cast it to a wire dtype).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "device_mesh")


class ModuleSource:
    """The parameters of ``module`` (optionally its buffers), tied parameters sent once.

    Parameters
    ----------
    module : nn.Module
    name_map : callable(str) -> str or None, optional
        Trainer name → engine name; ``None`` drops the tensor.
    include_buffers : bool
        Also send persistent buffers (e.g. BatchNorm statistics); LLMs need none.
    sending : bool
        Whether this rank packs and sends (True on a single-process trainer).

    Raises
    ------
    ValueError
        Two tensors mapped to the same engine name, or a module with nothing to send.

    Attributes
    ----------
    aliases : dict[str, str]
        Engine name of each tied parameter that is not sent → the name that is sent with its
        data (e.g. ``lm_head.weight`` → ``model.embed_tokens.weight`` under
        ``tie_word_embeddings``). Receivers keep them aliased.
    """

    def __init__(
        self,
        module: nn.Module,
        name_map: Optional[NameMap] = None,
        include_buffers: bool = False,
        sending: bool = True,
    ):
        self.module = module
        self.sending = sending
        self.aliases: dict[str, str] = {}
        self._tensors: list[tuple[str, torch.Tensor]] = []
        first_name: dict[int, str] = {}
        named = list(module.named_parameters(remove_duplicate=False))
        if include_buffers:  # persistent ones: those a state_dict holds
            persistent = set(module.state_dict(keep_vars=True))
            named += [
                (n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in persistent
            ]
        seen_engine_names: set[str] = set()
        for name, tensor in named:
            mapped = name_map(name) if name_map else name
            if mapped is None:
                continue
            if id(tensor) in first_name:  # tied: same Parameter object under a second name
                self.aliases[mapped] = first_name[id(tensor)]
                continue
            if mapped in seen_engine_names:
                raise ValueError(f"weight source: two tensors map to engine name {mapped!r}")
            seen_engine_names.add(mapped)
            first_name[id(tensor)] = mapped
            self._tensors.append((mapped, tensor))
        if not self._tensors:
            raise ValueError("weight source: the module has no tensors to send")

    def specs(self) -> list[SourceTensor]:
        """Name, global shape and dtype of every tensor sent, in sending order."""
        return [SourceTensor(name, tuple(t.shape), t.dtype) for name, t in self._tensors]

    def sync_flag(self, go: bool) -> bool:
        """Agree with the other training ranks whether to go on (the sending rank decides).

        A single-process source returns ``go``; :class:`FSDP2Source` broadcasts the sending
        rank's value over the training group, so ranks that only gather stop with it.
        """
        return go

    def tensors(self, indices: Sequence[int]) -> Iterator[torch.Tensor]:
        """The full, contiguous, detached tensors ``indices`` (of :meth:`specs`), in order.

        On FSDP2 every rank must call this with the same indices (``full_tensor()`` is an
        all-gather over the mesh). Yields views of the parameters where possible: the caller
        packs them before the next optimizer step.
        """
        for index in indices:
            tensor = self._tensors[index][1].detach()
            if _is_dtensor(tensor):
                tensor = tensor.full_tensor()
            yield tensor.contiguous()


class FSDP2Source(ModuleSource):
    """A ``fully_shard``-ed module: all ranks gather in lockstep, rank ``send_rank`` sends.

    Parameters
    ----------
    module : nn.Module
        Sharded with ``torch.distributed.fsdp.fully_shard`` (parameters are DTensors).
    name_map : callable, optional
        As in :class:`ModuleSource`.
    send_rank : int
        Rank (in the default group) that sends; default 0.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.

    Source
    ------
    torch.distributed.fsdp.fully_shard (FSDP2) and ``DTensor.full_tensor``.
    """

    def __init__(self, module: nn.Module, name_map: Optional[NameMap] = None, send_rank: int = 0):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("FSDP2Source: torch.distributed is not initialised")
        super().__init__(module, name_map, sending=dist.get_rank() == send_rank)
        self.send_rank = send_rank

    def sync_flag(self, go: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor(
            [1 if go else 0], dtype=torch.int64, device=_group_device(dist.get_backend())
        )
        dist.broadcast(flag, src=self.send_rank)
        return bool(flag.item())


def _group_device(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend
        else torch.device("cpu")
    )
