"""The trainer's fused loss step equals the composed reference step (float64), and is used.

Each scenario builds two engines on the same float64 tiny model, one with the fused loss
(the default) and one with ``fused_loss=False`` (linear_logprobs + grpo_loss), and compares
the accumulated gradients of every parameter, every logged statistic and, after a whole
train_step, the updated weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl import fused_loss as loss_ops
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.rl.config import LossConfig
from areal_fast.train import torch_engine
from areal_fast.train.config import ActorConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine

VERSION = 3  # the engines' version; token versions lie in [0, VERSION]

SCENARIOS = {
    "ppo-token_mean": dict(loss=LossConfig()),
    "ppo-seq_mean-entropy-kl": dict(
        loss=LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01, kl_coef=0.1)
    ),
    "recompute-token_mean-cap": dict(
        loss=LossConfig(behav_weight_cap=1.5), use_decoupled_loss=True
    ),
    "recompute-2-minibatches-seq_mean-entropy-kl": dict(
        loss=LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.02, kl_coef=0.05),
        use_decoupled_loss=True,
        ppo_n_minibatches=2,
    ),
    "loglinear-token_mean-kl-entropy-clamp": dict(
        loss=LossConfig(
            kl_coef=0.05,
            kl_estimator="k3",
            entropy_coef=0.02,
            behav_weight_cap=2.0,
            behav_weight_mode="clamp",
        ),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    ),
    "loglinear-seq_mean-mask": dict(
        loss=LossConfig(aggregation="seq_mean_token_mean", behav_weight_cap=1.5),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    ),
    "gspo-recompute": dict(loss=LossConfig(ratio_level="sequence"), use_decoupled_loss=True),
    "cispo-icepop-recompute": dict(
        loss=LossConfig(surrogate="cispo", icepop=True, icepop_low=0.8, icepop_high=1.25),
        use_decoupled_loss=True,
    ),
    "sapo-icepop-loglinear": dict(
        loss=LossConfig(surrogate="sapo", icepop=True, icepop_low=0.8, icepop_high=1.25),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    ),
    "m2po-recompute": dict(
        # a threshold that masks about half the tokens (the behaviour log-probs are random):
        # at 0.01 an unlucky seed masked every token and left no gradient to compare
        loss=LossConfig(surrogate="m2po", m2po_threshold=0.5),
        use_decoupled_loss=True,
    ),
    "geo-rejection-loglinear": dict(
        loss=LossConfig(seq_rejection="ratio", seq_rejection_low=0.8, seq_rejection_high=1.25),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    ),
}


def _batch(vocab: int, seed: int, num: int = 8):
    """Random trajectories (behaviour log-probs near the tiny model's, per-token versions in
    [0, VERSION]) packed with random advantages."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(num):
        p = int(torch.randint(2, 7, (1,), generator=g))
        c = int(torch.randint(2, 11, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        behav = (-2.5 * torch.rand(c, generator=g) - 4.0).tolist()
        versions = torch.randint(0, VERSION + 1, (c,), generator=g).sort().values.tolist()
        trajs.append(Trajectory(ids[:p], ids[p:], behav, versions, "stop", group_id=i // 2))
    return pack_trajectories(trajs, torch.randn(num, generator=g))


def _engine(model_dir, fields: dict, fused: bool, seed: int, lr: float = 1e-3):
    model = load_causal_lm(str(model_dir)).double()
    ref = None
    if fields["loss"].kl_coef > 0:
        ref = load_causal_lm(str(model_dir)).double()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # a reference that differs from the policy, same in both
            for p in ref.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    actor = ActorConfig(
        optim=OptimizerConfig(lr=lr),
        max_tokens_per_mb=24,
        keep_groups=False,
        **{"use_decoupled_loss": False, **fields},
    )
    return TorchTrainEngine(
        model,
        actor,
        temperature=0.9,
        ref_model=ref,
        initial_version=VERSION,
        fused_loss=fused,
    )


def _assert_stats_equal(got: dict, want: dict, what: str):
    assert set(got) == set(want), what
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (what, key)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fused_step_equals_composed_in_float64(tiny_model_dir, name, fresh_seed):
    fields = SCENARIOS[name]
    seed = fresh_seed % 1000
    fused, composed = (_engine(tiny_model_dir, fields, f, seed) for f in (True, False))
    batch = _batch(fused.model.config.vocab_size, seed)

    got, want = fused.accumulate_gradients(batch), composed.accumulate_gradients(batch)
    assert got["num_micro_batches"] > 2
    _assert_stats_equal(got, want, f"{name} accumulate_gradients (seed {seed})")
    for key in ("entropy_mean", "behav_logprob_abs_diff"):
        assert key in got and got[key] > 0
    if fields.get("use_decoupled_loss"):
        assert {"behav_weight_mean", "behav_weight_masked_fraction"} <= set(got)
    if fields["loss"].behav_weight_cap is not None and fields["loss"].behav_weight_mode == "mask":
        assert 0 < got["behav_weight_masked_fraction"] < 1  # the cap is in play
    if fields["loss"].corrects_sampler:
        assert 0 < got["rejected_fraction"] < 1  # IcePop's band or the rejection is in play
    named = dict(composed.model.named_parameters())
    for pname, param in fused.model.named_parameters():
        ref = named[pname].grad
        scale = float(ref.abs().max())
        assert scale > 0, pname
        err = float((param.grad - ref).abs().max()) / scale
        assert err < 1e-10, f"{name} grad {pname}: rel err {err:.1e} (seed {seed})"

    fused, composed = (_engine(tiny_model_dir, fields, f, seed) for f in (True, False))
    got, want = fused.train_step(batch), composed.train_step(batch)
    _assert_stats_equal(got, want, f"{name} train_step (seed {seed})")
    for a, b in zip(fused.model.parameters(), composed.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_trainer_calls_the_fused_loss(tiny_model_dir, monkeypatch, fresh_seed):
    """The default engine computes every micro-batch's loss with fused_linear_grpo_loss
    (gathered LM-head weight, trained positions and the micro-batch weight as upstream
    gradient); ``fused_loss=False`` reaches the composed reference instead."""
    fused_calls, composed_calls = [], []
    original_fused, original_loss = torch_engine.fused_linear_grpo_loss, torch_engine.grpo_loss

    def fused_spy(hidden, weight, *args, **kwargs):
        fused_calls.append((weight, kwargs))
        return original_fused(hidden, weight, *args, **kwargs)

    def loss_spy(*args, **kwargs):
        composed_calls.append(kwargs)
        return original_loss(*args, **kwargs)

    monkeypatch.setattr(torch_engine, "fused_linear_grpo_loss", fused_spy)
    monkeypatch.setattr(torch_engine, "grpo_loss", loss_spy)
    fields = dict(loss=LossConfig(), use_decoupled_loss=True)
    engine = _engine(tiny_model_dir, fields, True, 0)
    assert engine.fused_loss is True
    batch = _batch(engine.model.config.vocab_size, fresh_seed % 1000)
    stats = engine.accumulate_gradients(batch)
    count = int(stats["num_micro_batches"])
    assert len(fused_calls) == count > 1 and not composed_calls
    head = engine.model.get_output_embeddings().weight
    for weight, kwargs in fused_calls:
        assert weight is head
        assert kwargs["with_entropy"] and kwargs["return_per_token"]
        assert kwargs["prox_fn"] is not None and kwargs["trained_positions"] is not None
    # token_mean: the micro-batch weights are their shares of the trained tokens
    assert sum(kwargs["upstream_grad"] for _, kwargs in fused_calls) == pytest.approx(1.0)

    reference = _engine(tiny_model_dir, fields, False, 0)
    reference.accumulate_gradients(batch)
    assert len(composed_calls) == count and len(fused_calls) == count


def test_recompute_pass_matches_the_fused_forward(tiny_model_dir, monkeypatch, fresh_seed):
    """The no-grad pass gives the gradient pass's log-probs bitwise (float32, CPU kernels)."""
    seen = []
    original = loss_ops.grpo_loss

    def spy(logprobs, *args, **kwargs):
        seen.append(logprobs.clone())
        return original(logprobs, *args, **kwargs)

    monkeypatch.setattr(loss_ops, "grpo_loss", spy)
    model = load_causal_lm(str(tiny_model_dir))
    actor = ActorConfig(max_tokens_per_mb=40, keep_groups=False, use_decoupled_loss=False)
    engine = TorchTrainEngine(model, actor, temperature=0.9)
    batch = _batch(model.config.vocab_size, fresh_seed % 1000)
    recomputed = engine.recompute_logprobs(batch)
    engine.accumulate_gradients(batch)
    got = torch.zeros_like(recomputed)
    for part, logprobs in zip(engine._micro_batch_parts(batch), seen):
        index = torch_engine._token_index(batch.cu_seqlens, part)
        got[index] = logprobs.float()
    assert torch.equal(got[batch.loss_mask], recomputed[batch.loss_mask])


def test_fused_loss_flag_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="fused_loss"):
        TorchTrainEngine(
            load_causal_lm(str(tiny_model_dir)), ActorConfig(), temperature=1.0, fused_loss=1
        )


# ---------------------------------------------------------------------------------------
# CUDA: fused equals composed, and the micro-batch loop never synchronises with the host
# ---------------------------------------------------------------------------------------

CUDA_SCENARIOS = {
    "recompute-token_mean": dict(loss=LossConfig(behav_weight_cap=5.0), use_decoupled_loss=True),
    "loglinear-seq_mean-kl-entropy": dict(
        loss=LossConfig(aggregation="seq_mean_token_mean", kl_coef=0.05, entropy_coef=0.01),
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
    ),
    "ppo-2-minibatches-token_sum": dict(
        loss=LossConfig(aggregation="token_sum"), use_decoupled_loss=True, ppo_n_minibatches=2
    ),
}


def _cuda_engine(model_dir, fields, fused, dtype):
    model = load_causal_lm(str(model_dir)).to("cuda", dtype)
    ref = load_causal_lm(str(model_dir)).to("cuda", dtype) if fields["loss"].kl_coef else None
    actor = ActorConfig(max_tokens_per_mb=24, keep_groups=False, **fields)
    return TorchTrainEngine(
        model, actor, temperature=0.9, ref_model=ref, initial_version=VERSION, fused_loss=fused
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CUDA_SCENARIOS))
def test_cuda_fused_equals_composed(tiny_model_dir, name, fresh_seed):
    fields = CUDA_SCENARIOS[name]
    engines = [_cuda_engine(tiny_model_dir, fields, f, torch.float32) for f in (True, False)]
    batch = _batch(engines[0].model.config.vocab_size, fresh_seed % 1000)
    got, want = (e.accumulate_gradients(batch) for e in engines)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(engines[0].model.parameters(), engines[1].model.parameters()):
        err = float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp(min=1e-12))
        assert err < 1e-3, err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CUDA_SCENARIOS))
def test_micro_batch_loop_makes_no_host_sync(tiny_model_dir, name, dtype, monkeypatch):
    """A train step whose micro-batch loops (accumulate_gradients', and the no-grad
    proximal pass with several minibatches) run under ``set_sync_debug_mode("error")``:
    any device→host synchronisation there raises. The documented ones after the loop
    (reading the summed statistics, the gradient norm) run in the default mode."""
    engine = _cuda_engine(tiny_model_dir, CUDA_SCENARIOS[name], True, dtype)
    batch = _batch(engine.model.config.vocab_size, 11)
    engine.train_step(batch)  # warm-up: kernels compiled, caches and pinned buffers made
    parts, reduce_stats = engine._micro_batch_parts, engine._reduce_stats

    def parts_then_strict(b):
        out = parts(b)
        torch.cuda.set_sync_debug_mode("error")
        return out

    def lenient_then_reduce(sums):
        torch.cuda.set_sync_debug_mode("default")
        return reduce_stats(sums)

    monkeypatch.setattr(engine, "_micro_batch_parts", parts_then_strict)
    monkeypatch.setattr(engine, "_reduce_stats", lenient_then_reduce)
    try:
        stats = engine.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats["num_micro_batches"] > 2 and math.isfinite(stats["loss"])
    assert math.isfinite(stats["grad_norm"]) and stats["entropy_mean"] > 0
