"""Batches and spawned-rank bodies for the FSDP and train-state tests.

Ranks build the same global batches from a seed and train on their own part; only small
reports (stats dicts, numpy weights) cross back to the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from typing import Callable

import numpy as np
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.ops.packing import partition_balanced
from areal_fast.rl.advantages import group_advantages
from areal_fast.rl.batch import PackedBatch, Trajectory, pack_trajectories, select_sequences

NUM_GROUPS, GROUP_SIZE = 6, 2


def plain_actor(**fields):
    """An ``ActorConfig`` for these tests: plain PPO (``use_decoupled_loss`` off) and groups
    free to split (``keep_groups`` off) unless ``fields`` say otherwise."""
    from areal_fast.train.config import ActorConfig

    return ActorConfig(**{"keep_groups": False, "use_decoupled_loss": False, **fields})


def global_batch(vocab: int, seed: int, version: int) -> PackedBatch:
    """``NUM_GROUPS`` GRPO groups of ``GROUP_SIZE`` random sequences (group i is sequences
    2i, 2i+1), token versions in [version − 1, version] (stale for decoupled PPO), GRPO
    advantages from random rewards."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(NUM_GROUPS * GROUP_SIZE):
        p = int(torch.randint(2, 8, (1,), generator=g))
        c = int(torch.randint(2, 14, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        behav = (-torch.rand(c, generator=g) * 3 - 2).tolist()  # near the tiny model's ~ -4
        versions = torch.randint(max(version - 1, 0), version + 1, (c,), generator=g).tolist()
        trajs.append(
            Trajectory(
                ids[:p],
                ids[p:],
                behav,
                versions,
                "stop",
                group_id=i // GROUP_SIZE,
                reward=float(torch.randint(0, 2, (1,), generator=g)),
            )
        )
    rewards = torch.tensor([t.reward for t in trajs])
    return pack_trajectories(trajs, group_advantages(rewards, group_size=GROUP_SIZE))


def rank_parts(step: int) -> list[list[int]]:
    """Uneven sequence indices of rank 0 and rank 1 (whole groups): one group against five
    (rank 0 must pad), two against four (rank 0 re-partitions), then three and three."""
    first = [[0, 1], [0, 1, 2, 3], [0, 1, 4, 5, 8, 9]][step % 3]
    rest = [i for i in range(NUM_GROUPS * GROUP_SIZE) if i not in first]
    return [first, rest]


def local_mb_counts(batch: PackedBatch, step: int, budget: int) -> list[int]:
    """Micro-batch count of each rank's part of step ``step`` before the ranks agree."""
    counts = []
    for part in rank_parts(step):
        sub = select_sequences(batch, part)
        lengths = (sub.cu_seqlens[1:] - sub.cu_seqlens[:-1]).tolist()
        counts.append(len(partition_balanced(lengths, budget)))
    return counts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, world_size: int, args: tuple, timeout: float = 120.0) -> list:
    """Run ``target(rank, world_size, init_method, *args)`` in spawned processes; each
    rank's report (a dict; ``{"trace": ...}`` when it raised)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(
            target=_entry, args=(target, rank, world_size, init_method, queue, args), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    reports: list = [None] * world_size
    deadline = time.monotonic() + timeout
    for _ in range(world_size):
        try:
            rank, report = queue.get(timeout=max(deadline - time.monotonic(), 1))
        except Exception:
            break
        reports[rank] = report
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
        if p.is_alive():
            p.kill()
    for rank, report in enumerate(reports):
        assert report is not None, f"rank {rank} sent no report"
        assert "trace" not in report, f"rank {rank} failed:\n{report['trace']}"
    return reports


def _entry(target, rank, world_size, init_method, queue, args):
    torch.set_num_threads(1)
    try:
        report = target(rank, world_size, init_method, *args)
    except BaseException:  # reported; the test asserts on it
        report = {"trace": traceback.format_exc()}
    queue.put((rank, report))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def weights_numpy(engine) -> dict[str, np.ndarray]:
    """Full weights of any engine as numpy arrays (collective on FSDP)."""
    return {name: t.cpu().numpy().copy() for name, t in engine.named_weights()}


# ---------------------------------------------------------------------------- scenarios
def trainer_factory_args(
    model_path: str, total_steps=None, temperature: float = 1.0, **actor_fields
) -> dict:
    """TorchTrainerFactory arguments of a scenario: the model at ``model_path``, the
    sampling temperature, and :func:`plain_actor` with ``actor_fields``."""
    from areal_fast.models.config import ModelConfig
    from areal_fast.rollout.config import RolloutConfig

    return dict(
        model=ModelConfig(path=model_path),
        actor=plain_actor(**actor_fields),
        rollout=RolloutConfig(temperature=temperature),
        total_steps=total_steps,
    )


def train_ranks(rank, world_size, init_method, factory_kwargs: dict, seed: int, steps: int) -> dict:
    """Build the FSDP engine through TorchTrainerFactory, train ``steps`` steps on this
    rank's parts of the global batches."""
    from areal_fast.launch.factories import TorchTrainerFactory

    factory = TorchTrainerFactory(
        rank=rank,
        world_size=world_size,
        dist_init_method=init_method,
        dist_timeout=60,
        **trainer_factory_args(**factory_kwargs),
    )
    engine = factory()
    vocab = engine.model.config.vocab_size
    stats = []
    for step in range(steps):
        batch = global_batch(vocab, seed + step, engine.version)
        stats.append(engine.train_step(select_sequences(batch, rank_parts(step)[rank])))
    return {
        "stats": stats,
        "weights": weights_numpy(engine),
        "sharded": type(next(engine.model.parameters())).__name__,
    }


def checkpoint_ranks(
    rank, world_size, init_method, model_dir: str, directory: str, seed: int, engine_kwargs: dict
) -> dict:
    """Engine A: 2 steps, save, a 3rd. Engine B (fresh): load, the same 3rd step."""
    from areal_fast.rl.config import LossConfig
    from areal_fast.train.checkpoint import load_train_state, save_train_state
    from areal_fast.train.fsdp import FSDPTrainEngine, init_trainer_group
    from areal_fast.train.torch_engine import OptimizerConfig

    mesh = init_trainer_group(rank, world_size, init_method, "gloo", 60)
    optim = OptimizerConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1)
    actor = plain_actor(loss=LossConfig(), optim=optim, **engine_kwargs)

    def make():
        return FSDPTrainEngine(
            load_causal_lm(model_dir), actor, mesh=mesh, temperature=1.0, total_steps=4
        )

    def step(engine, k):
        batch = global_batch(engine.model.config.vocab_size, seed + k, engine.version)
        return engine.train_step(select_sequences(batch, rank_parts(k)[rank]))

    a = make()
    for k in range(2):
        step(a, k)
    save_train_state(a, directory)
    rng_a = torch.rand(3).tolist()  # the RNG right after the save ...
    stats_a = step(a, 2)
    torch.manual_seed(seed)
    b = make()
    load_train_state(b, directory)
    rng_b = torch.rand(3).tolist()  # ... is restored by the load
    stats_b = step(b, 2)
    return {
        "stats_a": stats_a,
        "stats_b": stats_b,
        "rng_a": rng_a,
        "rng_b": rng_b,
        "weights_a": weights_numpy(a),
        "weights_b": weights_numpy(b),
    }


def save_ranks(
    rank, world_size, init_method, model_dir: str, directory: str, seed=None, actor_fields=None
) -> dict:
    """An FSDP engine's HF checkpoint (``engine.save``) written at ``directory``; with
    ``seed``, after one train step (``actor_fields``: of its ActorConfig)."""
    from areal_fast.train.fsdp import FSDPTrainEngine, init_trainer_group

    mesh = init_trainer_group(rank, world_size, init_method, "gloo", 60)
    actor = plain_actor(**(actor_fields or {}))
    engine = FSDPTrainEngine(load_causal_lm(model_dir), actor, mesh=mesh, temperature=1.0)
    if seed is not None:
        batch = global_batch(engine.model.config.vocab_size, seed, engine.version)
        engine.train_step(select_sequences(batch, rank_parts(0)[rank]))
    engine.save(directory)
    return {"weights": weights_numpy(engine)}


def fused_vs_composed_ranks(
    rank, world_size, init_method, model_dir: str, seed: int, actor_fields: dict
) -> dict:
    """On each rank, an FSDP engine with the fused loss and one with the composed reference
    accumulate gradients on this rank's part of one global batch (rank 0 holds one group,
    so it pads); the full gradients, the stats, and what the fused loss was handed."""
    from areal_fast.train import torch_engine
    from areal_fast.train.fsdp import FSDPTrainEngine, init_trainer_group

    mesh = init_trainer_group(rank, world_size, init_method, "gloo", 60)
    heads = []
    original = torch_engine.fused_linear_grpo_loss

    def spy(hidden, weight, *args, **kwargs):
        heads.append((type(weight).__name__, tuple(weight.shape), kwargs["upstream_grad"]))
        return original(hidden, weight, *args, **kwargs)

    torch_engine.fused_linear_grpo_loss = spy
    report = {"heads": heads}
    for fused in (True, False):
        model = load_causal_lm(model_dir)
        ref = None
        if actor_fields["loss"].kl_coef > 0:
            ref = load_causal_lm(model_dir)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        engine = FSDPTrainEngine(
            model,
            plain_actor(**actor_fields),
            mesh=mesh,
            ref_model=ref,
            temperature=0.9,
            initial_version=1,
            fused_loss=fused,
        )
        batch = global_batch(model.config.vocab_size, seed, engine.version)
        stats = engine.accumulate_gradients(select_sequences(batch, rank_parts(0)[rank]))
        grads = {
            name: param.grad.full_tensor().numpy().copy()
            for name, param in engine.model.named_parameters()
        }
        report["fused" if fused else "composed"] = {"stats": stats, "grads": grads}
    report["vocab"] = model.config.vocab_size
    report["hidden"] = model.config.hidden_size
    return report
