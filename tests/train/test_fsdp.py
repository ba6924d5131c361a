"""FSDP2 on 2 gloo ranks equals the single-process trainer on the whole batch.

Each scenario trains 3 steps in two spawned ranks (engines built by TorchTrainerFactory with
``world_size=2``) on uneven parts of the same global batches (one group against five, so
rank 0 pads its micro-batches; two against four, so it re-partitions), and compares every
step's statistics and the final weights with a single-process engine on the whole batches.
Fresh random batches each run (the seed is in the failure message).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from fsdp_procs import (
    fused_vs_composed_ranks,
    global_batch,
    local_mb_counts,
    rank_parts,
    run_ranks,
    train_ranks,
    trainer_factory_args,
)

from areal_fast.launch.factories import TorchTrainerFactory
from areal_fast.models.config import ModelConfig
from areal_fast.rl.batch import select_sequences
from areal_fast.rl.config import LossConfig
from areal_fast.train.config import DistillConfig
from areal_fast.train.fsdp import init_trainer_group
from areal_fast.train.lora import LoraConfig
from areal_fast.train.torch_engine import OptimizerConfig

BUDGET = 40  # tokens per micro-batch; a group is at most 2 x 20 tokens
STEPS = 3
SCENARIOS = {
    # clipping active (grad_clip below the norm): the global norm must be used
    "token_mean-recompute-clip": dict(
        loss=LossConfig(), optim=OptimizerConfig(lr=1e-4, grad_clip=0.05), use_decoupled_loss=True
    ),
    "seq_mean_token_sum-loglinear-groups": dict(
        loss=LossConfig(aggregation="seq_mean_token_sum", seq_len_norm=8.0),
        optim=OptimizerConfig(lr=1e-4),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
        keep_groups=True,
        gradient_checkpointing=True,  # the layers' forward runs again in the backward
    ),
    # two minibatches: compared with a single process whose minibatch i is the union of the
    # ranks' i-th minibatches; KL against a sharded reference model; a decaying LR; beside
    # the reference a sharded distillation teacher (the tiny model itself: its signal is
    # coef · (its log-probs − the batch's random behaviour log-probs))
    "token_sum-kl-distill-minibatches": dict(
        loss=LossConfig(aggregation="token_sum", kl_coef=0.1, entropy_coef=0.01),
        optim=OptimizerConfig(lr=1e-4, lr_schedule="linear", warmup_steps=1),
        use_decoupled_loss=True,
        ppo_n_minibatches=2,
        total_steps=STEPS,
        distill=DistillConfig(teacher_path="the tiny model", coef=0.5),
    ),
    # LoRA adapters sharded with their layers; the weights compared are the adapter's
    "token_mean-lora": dict(
        loss=LossConfig(),
        optim=OptimizerConfig(lr=1e-2),
        use_decoupled_loss=True,
        lora=LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_rank(tiny_model_dir, name):
    seed = random.SystemRandom().randrange(1 << 30)
    kwargs = dict(SCENARIOS[name], model_path=str(tiny_model_dir), max_tokens_per_mb=BUDGET)
    if "distill" in kwargs:
        kwargs["distill"] = dataclasses.replace(kwargs["distill"], teacher_path=str(tiny_model_dir))
    reports = run_ranks(train_ranks, 2, (kwargs, seed, STEPS))
    expected, expected_weights, counts = _single_process(kwargs, seed)
    assert counts[0][1] > counts[0][0], counts  # micro-batch counts differ before agreeing
    assert reports[0]["sharded"] == "DTensor"
    assert reports[0]["stats"] == reports[1]["stats"], "ranks disagree on the stats"
    # a stat's float32 rounding scales with the size of what it sums, not with its value: a
    # token_sum loss of O(1) terms of both signs can cancel to 0.015 in one step and 1.1 in
    # the next, so each stat is compared relative to its largest magnitude over the steps
    scale = {key: max(abs(stats[key]) for stats in expected) for key in expected[0]}
    worst_stat = 0.0
    for step, (got, want) in enumerate(zip(reports[0]["stats"], expected)):
        assert set(got) == set(want)
        for key in sorted(want):
            if key != "num_micro_batches":
                assert abs(got[key] - want[key]) <= 1e-5 * scale[key] + 1e-7, (
                    f"seed {seed} step {step} {key}",
                    got[key],
                    want[key],
                )
                worst_stat = max(worst_stat, abs(got[key] - want[key]) / max(scale[key], 1e-3))
    worst = 0.0
    lr = SCENARIOS[name]["optim"].lr
    for rank in (0, 1):
        for pname, want in expected_weights.items():
            got = reports[rank]["weights"][pname]
            _assert_adam_weights_close(got, want, lr, f"seed {seed} rank {rank} {pname}")
            worst = max(worst, float(np.abs(got - want).max()))
    print(f"{name}: max stat diff (relative) {worst_stat:.1e}, max |weight diff| {worst:.1e}")


def _assert_adam_weights_close(got, want, lr: float, what: str) -> None:
    """Weights after STEPS Adam steps agree to float32 rounding, but for a few elements.

    Adam's step is lr · m̂ / √v̂ whatever the gradient's size, so an element whose gradient is
    a near-total cancellation of larger terms (its float32 rounding a sizeable fraction of it)
    can move by a different fraction of lr in the two runs: LoRA's A matrices (lr 1e-2, a
    zero B at step 1) showed one element of 192 off by 5e-5. Such elements are allowed, at
    most 1 % of a tensor (at least 1) and each within Adam's bound of lr a step; a sharding
    or reduction bug moves far more of them.
    """
    diff = np.abs(got - want)
    tight = diff <= 1e-5 * np.abs(want) + max(1e-6, 1e-3 * lr)
    loose = int((~tight).sum())
    assert loose <= max(1, want.size // 100), (what, f"{loose} of {want.size} elements differ")
    assert float(diff.max()) <= 2 * lr * STEPS, (what, float(diff.max()))


def _single_process(kwargs: dict, seed: int):
    """The reference: one TorchTrainEngine (same factory, world_size 1) on whole batches."""
    engine = TorchTrainerFactory(**trainer_factory_args(**kwargs))()
    stats, counts = [], []
    for step in range(STEPS):
        batch = global_batch(engine.model.config.vocab_size, seed + step, engine.version)
        counts.append(local_mb_counts(batch, step, BUDGET))
        if engine.ppo_n_minibatches > 1:
            engine.minibatch_parts = _union_of_rank_minibatches(engine, batch, step)
        stats.append(engine.train_step(batch))
    weights = {n: t.numpy().copy() for n, t in engine.named_weights()}
    return stats, weights, counts


def _union_of_rank_minibatches(engine, batch, step):
    """minibatch_parts for the single process: minibatch i = the ranks' i-th minibatches."""
    unions = [[] for _ in range(engine.ppo_n_minibatches)]
    for part in rank_parts(step):
        for i, local in enumerate(
            type(engine).minibatch_parts(engine, select_sequences(batch, part))
        ):
            unions[i].extend(part[j] for j in local)
    return lambda _batch: unions


def test_fused_loss_on_two_ranks_equals_composed(tiny_model_dir):
    """FSDP with the fused loss: it runs inside the registered forward method on the
    gathered LM head (a plain [V, H] tensor, not the DTensor shard), rank 0 pads with
    zero-weight passes, and the reduce-scattered gradients and the global stats equal the
    composed reference's."""
    seed = random.SystemRandom().randrange(1 << 30)
    fields = dict(
        loss=LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01, kl_coef=0.05),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
        max_tokens_per_mb=BUDGET,
    )
    reports = run_ranks(fused_vs_composed_ranks, 2, (str(tiny_model_dir), seed, fields))
    for rank, report in enumerate(reports):
        vocab, hidden = report["vocab"], report["hidden"]
        assert report["heads"], f"rank {rank}: the fused loss was not called"
        assert {(kind, shape) for kind, shape, _ in report["heads"]} == {
            ("Parameter", (vocab, hidden))
        }
        fused, composed = report["fused"], report["composed"]
        assert fused["stats"]["num_micro_batches"] == len(report["heads"])
        assert set(fused["stats"]) == set(composed["stats"])
        for key, want in composed["stats"].items():
            assert fused["stats"][key] == pytest.approx(want, rel=1e-5, abs=1e-7), (seed, key)
        for name, want in composed["grads"].items():
            np.testing.assert_allclose(
                fused["grads"][name],
                want,
                rtol=1e-4,
                atol=1e-6 * float(np.abs(want).max()),
                err_msg=f"seed {seed} rank {rank} {name}",
            )
    assert 0.0 in {upstream for _, _, upstream in reports[0]["heads"]}  # rank 0 padded
    assert reports[0]["fused"]["stats"] == reports[1]["fused"]["stats"]


def test_factory_stays_a_picklable_dataclass(tiny_model_dir):
    import pickle

    factory = TorchTrainerFactory(
        ModelConfig(path=str(tiny_model_dir)),
        total_steps=7,
        rank=1,
        world_size=2,
        dist_init_method="tcp://127.0.0.1:1",
        dist_timeout=5.0,
    )
    assert pickle.loads(pickle.dumps(factory)) == factory
    assert dataclasses.is_dataclass(factory)
    engine = TorchTrainerFactory(ModelConfig(path=str(tiny_model_dir)), total_steps=7)()
    assert engine.total_steps == 7 and not hasattr(engine, "mesh")


@pytest.mark.parametrize(
    "args, match",
    [
        ((2, 2, "tcp://127.0.0.1:1", "gloo", 5.0), r"rank = 2 must be an int in \[0, 2\)"),
        ((0, 0, "tcp://127.0.0.1:1", "gloo", 5.0), "world_size = 0"),
        ((0, 1, "", "gloo", 5.0), "init_method is empty"),
        ((0, 1, "tcp://127.0.0.1:1", "mpi", 5.0), "backend = 'mpi'"),
        ((0, 1, "tcp://127.0.0.1:1", "gloo", 0.0), "timeout_s = 0.0"),
    ],
)
def test_init_trainer_group_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        init_trainer_group(*args)


def test_init_trainer_group_failed_rendezvous_is_one_line():
    from fsdp_procs import free_port

    with pytest.raises(RuntimeError, match="trainer rank 1/2 could not join the gloo group") as err:
        init_trainer_group(1, 2, f"tcp://127.0.0.1:{free_port()}", "gloo", 1.0)
    assert "\n" not in str(err.value)
    assert not torch.distributed.is_initialized()
