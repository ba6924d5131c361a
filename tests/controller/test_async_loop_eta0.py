"""η = 0 through the asynchronous controller (worker processes, shard fetches, shared-memory
weights) equals a plain synchronous in-process GRPO loop (written out below) on the tiny
model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_fast.controller.async_loop import AsyncController, RunPlan
from areal_fast.controller.requests import ChatPrompts, MathRequests, ProblemStream, group_seed
from areal_fast.data.rewards import DEFAULT_INSTRUCTION
from areal_fast.data.tasks import load_problems
from areal_fast.launch.cluster import ClusterSpec, LocalCluster
from areal_fast.launch.config import LauncherConfig
from areal_fast.launch.experiment import save_checkpoint
from areal_fast.launch.factories import HFEngineFactory, TorchTrainerFactory
from areal_fast.models.config import ModelConfig
from areal_fast.models.loading import load_causal_lm, load_tokenizer
from areal_fast.rl.advantages import group_advantages
from areal_fast.rl.batch import pack_trajectories
from areal_fast.rl.config import LossConfig
from areal_fast.rollout.config import RolloutConfig
from areal_fast.rollout.engine import SamplingParams
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.train.config import ActorConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

SEED = 7
STEPS, BATCH = 2, 3
TASK_KWARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


def char_parity_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion's character codes sum to an odd number (varies per sample)."""
    return float(sum(map(ord, completion_text)) % 2)


def _components():
    actor = ActorConfig(
        loss=LossConfig(eps_clip=0.2),
        optim=OptimizerConfig(lr=1e-3, grad_clip=1.0),
        max_tokens_per_mb=512,
        keep_groups=False,
        use_decoupled_loss=False,
    )
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    return actor, params


def _reference_loop(engine, trainer, tokenizer, problems, params) -> list[dict]:
    """Synchronous GRPO, one step at a time: sample B groups with the seeds the controller
    uses, score, group advantages, pack, one optimizer step, copy the weights to the engine."""
    stream, prompts, records = (
        ProblemStream(problems, SEED),
        ChatPrompts(tokenizer, DEFAULT_INSTRUCTION),
        [],
    )
    for step in range(STEPS):
        batch = stream.next_batch(BATCH)
        seeds = [group_seed(SEED, step * BATCH + i) for i in range(BATCH)]
        trajs = engine.generate([prompts(p) for p in batch], params, seeds=seeds)
        for traj in trajs:
            text = tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
            traj.reward = char_parity_reward(text, batch[traj.group_id].answer)
            traj.group_id += step * BATCH
        rewards = torch.tensor([t.reward for t in trajs])
        advantages = group_advantages(
            rewards, group_ids=torch.tensor([t.group_id for t in trajs]), mode="grpo"
        )
        stats = trainer.train_step(pack_trajectories(trajs, advantages))
        engine.update_weights(list(trainer.named_weights()), step + 1)
        records.append(
            {
                "step": step + 1,
                **stats,
                "reward_mean": float(rewards.double().mean()),
                "response_length_mean": sum(len(t.completion_ids) for t in trajs) / len(trajs),
            }
        )
    return records


def _sync_run(model_dir: Path, problems):
    actor, params = _components()
    tokenizer = load_tokenizer(str(model_dir))
    policy = load_causal_lm(str(model_dir), "float32", "sdpa", "cpu")
    engine = HFEngine(copy.deepcopy(policy), tokenizer, max_batch_size=64)
    trainer = TorchTrainEngine(policy, actor, temperature=params.temperature)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker processes
    try:
        records = _reference_loop(engine, trainer, tokenizer, problems, params)
    finally:
        torch.set_num_threads(threads)
    return records, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _async_run(model_dir: Path, problems, tmp_path: Path):
    actor, params = _components()
    tokenizer = load_tokenizer(str(model_dir))
    model = ModelConfig(path=str(model_dir))
    rollout = RolloutConfig(temperature=params.temperature, max_batch_size=64)
    spec = ClusterSpec(
        rollout=RolloutWorkerSpec(HFEngineFactory(model, rollout), char_parity_reward, threads=1),
        trainer=TrainerWorkerSpec(
            TorchTrainerFactory(model, actor, rollout, seed=SEED), actor, threads=1
        ),
        num_rollout_workers=1,
        launcher=LauncherConfig(startup_timeout=120),
    )
    requests = MathRequests(
        ProblemStream(problems, SEED), ChatPrompts(tokenizer, DEFAULT_INSTRUCTION), params, SEED
    )
    plan = RunPlan(total_steps=STEPS, batch_size=BATCH)
    rollout_config = RolloutConfig(max_head_offpolicyness=0, max_concurrent_rollouts=BATCH)
    records: list[dict] = []
    checkpoint = tmp_path / "async-checkpoint"
    with LocalCluster(spec) as cluster:
        controller = AsyncController(
            cluster.rollout_workers,
            cluster.trainer,
            cluster.weight_buffers,
            requests,
            plan,
            rollout_config,
            records.append,
        )
        counts = controller.run()
        save_checkpoint(cluster, str(checkpoint), timeout=120)
    return records, counts, load_file(str(checkpoint / "model.safetensors"))


def test_eta_zero_async_equals_sync_loop(tiny_model_dir, tmp_path):
    problems = load_problems(
        "basic_arithmetic", split="train", size=20, seed=0, task_kwargs=TASK_KWARGS
    )
    sync_records, sync_weights = _sync_run(tiny_model_dir, problems)
    async_records, counts, async_weights = _async_run(tiny_model_dir, problems, tmp_path)

    # not vacuous: rewards vary inside groups, so the policy gets a gradient
    assert any(r["grad_norm"] > 0 for r in sync_records)
    assert any(0 < r["reward_mean"] < 1 for r in sync_records)
    assert counts.trained == STEPS * BATCH and counts.interruptions == 0
    assert [r["step"] for r in async_records] == [r["step"] for r in sync_records] == [1, 2]
    for sync, asyn in zip(sync_records, async_records):
        for key in ("loss", "grad_norm", "reward_mean", "response_length_mean"):
            assert asyn[key] == pytest.approx(sync[key], rel=1e-5, abs=1e-9), key
        assert asyn["trained_tokens"] > 0

    initial = load_causal_lm(str(tiny_model_dir), "float32", "sdpa", "cpu").state_dict()
    assert set(async_weights) <= set(sync_weights)
    names = {n for n, _ in load_causal_lm(str(tiny_model_dir)).named_parameters()}
    assert names <= set(async_weights)
    moved = 0.0
    for name, value in async_weights.items():
        torch.testing.assert_close(value, sync_weights[name], rtol=0, atol=1e-6, msg=name)
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-4  # training changed the weights
