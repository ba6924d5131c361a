"""The trainer-engine interface the controller drives (single process now, FSDP2 later)."""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from areal_fast.rl.batch import PackedBatch


class TrainEngine(Protocol):
    """What the controller needs from a trainer.

    ``train_step`` runs one optimizer update on a packed batch (splitting it into
    micro-batches itself) and returns float metrics; ``named_weights`` yields the parameters
    to send to inference engines; ``save`` writes a loadable checkpoint directory.
    """

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer update on ``batch``; float metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter to send to engines, tied tensors once."""
        ...

    def save(self, path: str) -> None:
        """Write a checkpoint directory that ``from_pretrained`` loads."""
        ...
