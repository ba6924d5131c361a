"""The synchronous in-process RL loop: generate → score → train → update weights.

A reference: ``areal-fast train`` runs the asynchronous controller
(:mod:`areal_fast.controller.async_loop`), which at max_head_offpolicyness = 0 trains exactly
as this loop does for the same seed (tested).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from areal_fast.controller.metrics import MetricsLog, rollout_metrics
from areal_fast.controller.rollout import MathRollout, ProblemStream
from areal_fast.rl.advantages import group_advantages
from areal_fast.rl.batch import pack_trajectories
from areal_fast.rollout.engine import SamplingParams
from areal_fast.sync.inprocess import push_weights
from areal_fast.train.engine import TrainEngine


@dataclass
class LoopSettings:
    """What the loop itself needs to know (the rest lives in the components)."""

    total_steps: int
    batch_size: int
    sampling: SamplingParams
    adv_mode: str = "grpo"


def train_loop(rollout: MathRollout, trainer: TrainEngine, stream: ProblemStream,
               settings: LoopSettings, log: MetricsLog, show_progress: bool = True) -> None:
    """Run ``settings.total_steps`` synchronous GRPO steps.

    Each step: sample ``batch_size`` problems × ``sampling.n`` completions with the current
    engine weights, compute group advantages, pack without padding, take one optimizer step,
    then push the new weights to the engine (its version becomes step + 1). Metrics of each
    step are appended to ``log``.
    """
    bar = tqdm(range(settings.total_steps), desc="train", disable=not show_progress)
    for step in bar:
        step_start = time.perf_counter()
        result = rollout.run(stream.next_batch(settings.batch_size), settings.sampling)
        trajs = result.trajectories
        advantages = group_advantages(torch.tensor([t.reward for t in trajs]),
                                      group_ids=torch.tensor([t.group_id for t in trajs]),
                                      mode=settings.adv_mode)
        batch = pack_trajectories(trajs, advantages)
        train_start = time.perf_counter()
        stats = trainer.train_step(batch)
        train_seconds = time.perf_counter() - train_start
        sync = push_weights(trainer.named_weights(), rollout.engine, version=step + 1)
        record = {"step": step + 1, **rollout_metrics(trajs), **stats,
                  "gen_tokens_per_s": result.num_generated_tokens / result.seconds,
                  "train_tokens_per_s": batch.num_tokens / train_seconds,
                  "gen_seconds": result.seconds, "train_seconds": train_seconds,
                  "sync_seconds": sync.seconds, "policy_version": rollout.engine.version,
                  "step_seconds": time.perf_counter() - step_start}
        log.append(record)
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}")

