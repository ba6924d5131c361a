"""A stand-in trainer that takes a fixed time per trained token, for controller benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from areal_fast.rl.batch import PackedBatch


class SimulatedTrainEngine:
    """:class:`~areal_fast.train.engine.TrainEngine` that sleeps ``token_seconds`` per trained
    (loss-masked) token and holds one small weight tensor whose value is the version.

    Parameters
    ----------
    token_seconds : float
        Seconds of "training" per trained token (14e-6 in the controller benchmark).
    num_weights : int
        Elements of the stand-in weight tensor.
    """

    def __init__(self, token_seconds: float, num_weights: int = 1024):
        if not token_seconds >= 0:
            raise ValueError(f"token_seconds = {token_seconds} must be >= 0")
        self.token_seconds = token_seconds
        self.version = 0
        self.weight = torch.zeros(num_weights)

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """Sleep for the batch's trained tokens (the trainer worker adds the staleness
        statistics, as for every trainer)."""
        time.sleep(self.token_seconds * int(batch.loss_mask.sum()))
        self.version += 1
        self.weight.fill_(self.version)
        return {"loss": 0.0, "version": float(self.version)}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The one stand-in weight tensor."""
        yield "weight", self.weight

    def save(self, path: str) -> None:
        """Write ``version.txt`` into ``path``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "version.txt").write_text(f"{self.version}\n")


@dataclass
class SimulatedTrainerFactory:
    """Picklable builder of a :class:`SimulatedTrainEngine`."""

    token_seconds: float
    num_weights: int = 1024

    def __call__(self) -> SimulatedTrainEngine:
        return SimulatedTrainEngine(self.token_seconds, self.num_weights)
