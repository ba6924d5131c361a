"""The trainer-engine interface the controller drives (single process now, FSDP2 later)."""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from areal_fast.rl.batch import PackedBatch


class TrainEngine(Protocol):
    """What the controller needs from a trainer.

    ``train_step`` takes one policy-version step on a packed batch (one or more optimizer
    updates over micro-batches it forms itself) and returns its metrics; ``version`` counts
    the steps taken; ``named_weights`` yields the parameters
    to send to inference engines; ``save`` writes a loadable checkpoint directory.
    """

    version: int

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One policy-version step on ``batch``; float metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter to send to engines, tied tensors once."""
        ...

    def save(self, path: str) -> None:
        """Write a checkpoint directory that ``from_pretrained`` loads."""
        ...
