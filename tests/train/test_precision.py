"""Mixed precision (train/precision.py): float32 parameters and gradients, the decoder computing
in bfloat16 like an engine that holds bfloat16 weights (checked on the CPU's autocast; the
same code runs under CUDA's)."""

from __future__ import annotations

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.train.precision import compute_in_dtype


def _hidden(model, ids):
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_decoder_computes_in_bfloat16_over_float32_parameters(
    arch, tiny_model_dir, tiny_qwen_dir
):
    path = str(tiny_model_dir if arch == "llama" else tiny_qwen_dir)
    mixed = load_causal_lm(path, "float32")
    engine = load_causal_lm(path, "bfloat16")  # what an engine of model.dtype holds
    exact = load_causal_lm(path, "float32")
    compute_in_dtype(mixed, torch.bfloat16)
    ids = torch.randint(
        0, mixed.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(3)
    )
    out = mixed.get_decoder()(input_ids=ids, use_cache=False, output_hidden_states=True)
    stream = [h.dtype for h in out.hidden_states[:-1]]  # the residual stream between layers
    assert len(stream) == mixed.config.num_hidden_layers and set(stream) == {torch.bfloat16}
    hidden = out.last_hidden_state  # after the final norm's float32 weight
    assert hidden.dtype == torch.float32 and mixed.areal_compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    with torch.no_grad():
        ref, fp32 = _hidden(engine, ids).float(), _hidden(exact, ids)
    got = hidden.detach().float()
    # it computes like the bfloat16 engine (measured: equal bit for bit on these models,
    # whose norm weights are 1), not like float32 (measured: 0.7 % of the largest value away)
    engine_gap = (ref - fp32).abs().max()
    assert engine_gap > 1e-3 * ref.abs().max()
    assert (got - ref).abs().max() <= 0.1 * engine_gap
    hidden.float().pow(2).sum().backward()
    grads = [p.grad for p in mixed.get_decoder().parameters()]  # the LM head is not used here
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


def test_only_half_precision_compute_dtypes_are_taken(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), "float32")
    with pytest.raises(ValueError, match="float32 is not bfloat16 or float16"):
        compute_in_dtype(model, torch.float32)


def test_a_trainer_step_in_mixed_precision_updates_float32_weights(tiny_model_dir):
    """The whole trainer step (packed attention, chunked log-probs, loss, AdamW) over a
    decoder that computes in bfloat16: the weights stay float32 and move; the recomputed
    log-probs match a bfloat16 model's, as an engine's would."""
    from areal_fast.rl.batch import Trajectory, pack_trajectories
    from areal_fast.rl.config import LossConfig
    from areal_fast.train.config import ActorConfig
    from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine

    gen = torch.Generator().manual_seed(5)
    model = load_causal_lm(str(tiny_model_dir), "float32")
    vocab = model.config.vocab_size
    trajectories = []
    for i in range(6):
        ids = torch.randint(0, vocab, (4 + i + 7,), generator=gen).tolist()
        behav = (-torch.rand(7, generator=gen) * 4).tolist()
        trajectories.append(Trajectory(ids[: 4 + i], ids[4 + i :], behav, [0] * 7, "stop", i // 2))
    batch = pack_trajectories(trajectories, torch.randn(6, generator=gen))
    engine = TorchTrainEngine(  # a bfloat16 model: what the rollout engine computes
        load_causal_lm(str(tiny_model_dir), "bfloat16"), ActorConfig(), temperature=1.0
    )
    compute_in_dtype(model, torch.bfloat16)
    actor = ActorConfig(
        loss=LossConfig(), optim=OptimizerConfig(lr=1e-3), keep_groups=False,
        use_decoupled_loss=False,
    )  # fmt: skip
    trainer = TorchTrainEngine(model, actor, temperature=1.0)
    mask = batch.labels != -100
    ours, theirs = trainer.recompute_logprobs(batch), engine.recompute_logprobs(batch)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours[mask], theirs[mask], atol=0.05), (ours - theirs).abs().max()
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.train_step(batch)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_lm_head_runs_in_the_compute_dtype(tiny_model_dir, monkeypatch):
    """With mixed precision the fused loss and the log-prob pass get bfloat16 hidden states and
    head weight (cast once per micro-batch); the float32 head weight still gets a float32,
    nonzero gradient through the cast."""
    import areal_fast.train.torch_engine as te
    from areal_fast.rl.batch import Trajectory, pack_trajectories
    from areal_fast.train.config import ActorConfig

    gen = torch.Generator().manual_seed(8)
    model = load_causal_lm(str(tiny_model_dir), "float32")
    compute_in_dtype(model, torch.bfloat16)
    vocab = model.config.vocab_size
    trajectories = [
        Trajectory(
            torch.randint(0, vocab, (3,), generator=gen).tolist(),
            torch.randint(0, vocab, (5,), generator=gen).tolist(),
            (-torch.rand(5, generator=gen)).tolist(), [0] * 5, "stop", i // 2,
        )
        for i in range(4)
    ]  # fmt: skip
    batch = pack_trajectories(trajectories, torch.randn(4, generator=gen))
    seen = []
    for name in ("fused_linear_grpo_loss", "fused_pass_logprobs"):
        real = getattr(te, name)

        def spy(hidden, weight, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, hidden.dtype, weight.dtype))
            return _real(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(te, name, spy)
    trainer = te.TorchTrainEngine(
        model, ActorConfig(use_decoupled_loss=False, keep_groups=False), temperature=1.0
    )
    trainer.recompute_logprobs(batch)
    trainer.optimizer.zero_grad()
    trainer.accumulate_gradients(batch)
    names = {name for name, _, _ in seen}
    assert names == {"fused_linear_grpo_loss", "fused_pass_logprobs"}, seen
    assert all(h == torch.bfloat16 and w == torch.bfloat16 for _, h, w in seen), seen
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0
