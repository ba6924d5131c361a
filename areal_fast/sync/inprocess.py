"""In-process weight sync: the trainer's parameters are copied into an engine's parameters."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class SyncStats:
    """What one weight update moved: bytes (of the source tensors) and wall seconds."""

    num_bytes: int
    seconds: float


def push_weights(named_weights: Iterable[tuple[str, torch.Tensor]], engine,
                 version: int) -> SyncStats:
    """Send ``named_weights`` to ``engine.update_weights`` with ``version``.

    Trainers yield tied parameters once (``named_parameters`` de-duplicates them), so a model
    with tied input/output embeddings sends the shared tensor once.

    Parameters
    ----------
    named_weights : iterable of (str, Tensor)
        The trainer's parameters (``TrainEngine.named_weights()``).
    engine : InferenceEngine
        Receiver; must accept ``update_weights(named_tensors, version)``.
    version : int
        Policy version of the weights sent.

    Returns
    -------
    SyncStats
    """
    start = time.perf_counter()
    named = list(named_weights)
    engine.update_weights(named, version)
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    return SyncStats(num_bytes=num_bytes, seconds=time.perf_counter() - start)
