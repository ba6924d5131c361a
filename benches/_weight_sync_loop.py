"""``bench_weight_sync.py --controller``: weight-update latency inside the running loop.

The real controller (:class:`~areal_fast.controller.async_loop.AsyncController`), real
trainer and rollout worker processes and the real weight paths, with stand-ins for the
model work only: a trainer whose weights have a model's shapes (bf16) and whose step sleeps
``--step-seconds``, and simulated engines that copy every weight byte on each install (an
engine loading its weights). Latency per version is the controller's
``weight_update_latency_seconds``: from the trainer's StepDone (version v complete in its
shared-memory slot) until every rollout worker serves v.

Cases, all on this machine in one run: ``shm`` (workers map the trainer's slots) and
``broadcast`` (``sync.transport=broadcast``: each worker gets every version over its own gloo
link into a node-local buffer, as a worker on another node does) to 1 and 2 workers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from areal_fast.controller.async_loop import AsyncController
from areal_fast.controller.config import RunPlan
from areal_fast.launch.cluster import ClusterSpec, LocalCluster
from areal_fast.rollout.config import RolloutConfig
from areal_fast.rollout.engine import SamplingParams, sample_seed
from areal_fast.rollout.simulated import (
    SimulatedEngine,
    SimulatedEngineConfig,
    sim_decode,
    sim_reward,
)
from areal_fast.sync.config import SyncConfig
from areal_fast.wire.messages import GroupRequest
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

CASES = [("shm", 1), ("broadcast", 1), ("shm", 2), ("broadcast", 2)]


class ShapedTrainEngine:
    """A trainer that holds bf16 weights of ``shapes`` and sleeps ``step_seconds`` a step
    (each step writes the version into every weight)."""

    def __init__(self, shapes, step_seconds: float):
        self.version, self.step_seconds = 0, step_seconds
        self.weights = [(n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in shapes]

    def train_step(self, batch) -> dict:
        time.sleep(self.step_seconds)
        self.version += 1
        for _, tensor in self.weights:
            tensor.fill_(self.version)
        return {"loss": 0.0}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights)

    def save(self, path: str) -> None:
        pass


@dataclass
class ShapedTrainerFactory:
    shapes: list
    step_seconds: float

    def __call__(self) -> ShapedTrainEngine:
        return ShapedTrainEngine(self.shapes, self.step_seconds)


class CopyingEngine(SimulatedEngine):
    """A simulated engine whose install copies every weight into a scratch tensor."""

    def update_weights(self, named_tensors, version: int) -> None:
        scratch = None
        for _, tensor in named_tensors:
            flat = tensor.reshape(-1)
            if scratch is None or scratch.numel() < flat.numel() or scratch.dtype != flat.dtype:
                scratch = torch.empty(flat.numel(), dtype=flat.dtype)
            scratch[: flat.numel()].copy_(flat)
        super().update_weights((), version)


@dataclass
class CopyingEngineFactory:
    config: SimulatedEngineConfig

    def __call__(self):
        return CopyingEngine(self.config), sim_decode


def run_case(shapes, transport: str, workers: int, steps: int, step_seconds: float) -> dict:
    """One loop run; returns the per-version latencies and update times."""
    engine = SimulatedEngineConfig(
        token_seconds=1e-3, max_running=8, median_length=8, max_length=16
    )
    spec = ClusterSpec(
        rollout=RolloutWorkerSpec(CopyingEngineFactory(engine), sim_reward, threads=1),
        trainer=TrainerWorkerSpec(ShapedTrainerFactory(shapes, step_seconds), threads=1),
        num_rollout_workers=workers,
        sync=SyncConfig(transport=transport, timeout=600.0),
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)

    def next_request(group_id: int) -> GroupRequest:
        return GroupRequest(group_id, [1] * 8, params, sample_seed(0, group_id))

    with LocalCluster(spec) as cluster:
        controller = AsyncController(
            cluster.rollout_workers,
            cluster.trainer,
            cluster.weight_buffers,
            next_request,
            RunPlan(total_steps=steps, batch_size=2),
            RolloutConfig(max_head_offpolicyness=1),
            lambda record: None,
        )
        counts = controller.run()
        transports = dict(cluster.transports)
    latency = controller.weights.latency_seconds
    return {
        "transport": transport,
        "workers": workers,
        "paths": transports,
        "latency_seconds": latency,
        "latency_median_s": statistics.median(latency),
        "worker_update_seconds": counts.update_seconds,
    }


def controller_bench(
    models: list[str], model_shapes, steps: int, step_seconds: float, cases=tuple(CASES)
) -> list:
    """Each of ``cases`` ((transport, workers) pairs; default every case) for every model,
    in one run (rows for the JSON and the table)."""
    rows = []
    for model in models:
        shapes = model_shapes(model)
        gbytes = sum(torch.Size(s).numel() for _, s in shapes) * 2 / 1e9
        for transport, workers in cases:
            row = run_case(shapes, transport, workers, steps, step_seconds)
            row.update(model=model, gbytes=gbytes)
            rows.append(row)
            print(
                f"{model} {transport} x{workers}: median latency "
                f"{row['latency_median_s']:.3f} s over {len(row['latency_seconds'])} versions",
                flush=True,
            )
    return rows
