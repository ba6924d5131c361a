"""``actor.gradient_checkpointing``: the same gradients and loss as without it (float64, fresh
inputs every run, LoRA too), far fewer bytes kept for the backward pass, and no effect on a
pass without gradients."""

from __future__ import annotations

import pytest
import torch
from test_torch_engine import _batch  # noqa: E402 - beside this file

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl.config import LossConfig
from areal_fast.train.activation_checkpointing import checkpoint_decoder_layers
from areal_fast.train.config import ActorConfig
from areal_fast.train.lora import LoraConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine


def _gradients(model_dir, seed: int, checkpointed: bool, lora: LoraConfig):
    """Gradients, statistics and bytes saved for backward of one accumulate_gradients."""
    torch.manual_seed(0)  # the same LoRA A in both runs
    model = load_causal_lm(str(model_dir)).double()
    actor = ActorConfig(
        loss=LossConfig(entropy_coef=0.01),
        optim=OptimizerConfig(),
        max_tokens_per_mb=40,
        keep_groups=False,
        use_decoupled_loss=True,
        lora=lora,
        gradient_checkpointing=checkpointed,
    )
    trainer = TorchTrainEngine(model, actor, temperature=0.9)
    batch = _batch(model.config.vocab_size, seed)
    batch.behav_logprobs = batch.behav_logprobs.double()
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = trainer.accumulate_gradients(batch)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grads, stats, saved[0]


@pytest.mark.parametrize(
    "lora", [LoraConfig(), LoraConfig(rank=4, alpha=8.0)], ids=["full", "lora"]
)
def test_checkpointed_layers_give_the_same_gradients_and_keep_less(
    tiny_model_dir, lora, fresh_seed
):
    seed = fresh_seed % 1000
    plain, plain_stats, plain_saved = _gradients(tiny_model_dir, seed, False, lora)
    ckpt, ckpt_stats, ckpt_saved = _gradients(tiny_model_dir, seed, True, lora)
    assert plain_stats["num_micro_batches"] > 1
    assert torch.allclose(plain, ckpt, rtol=1e-10, atol=1e-12), (plain - ckpt).abs().max()
    for key in ("loss", "entropy_mean"):
        assert ckpt_stats[key] == pytest.approx(plain_stats[key], rel=1e-12)
    # what the backward keeps: the layers' inputs instead of all their intermediates
    assert ckpt_saved < 0.5 * plain_saved, (ckpt_saved, plain_saved)


def test_a_pass_without_gradients_is_not_checkpointed_and_twice_is_once(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    layer = model.get_decoder().layers[0]
    assert checkpoint_decoder_layers(model) == model.config.num_hidden_layers
    wrapped = layer.forward
    assert checkpoint_decoder_layers(model) == model.config.num_hidden_layers
    assert layer.forward is wrapped  # not wrapped twice
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        expected = model(ids).logits
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    assert len(calls) == 1


def test_a_model_without_decoder_layers_is_refused():
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="actor.gradient_checkpointing: NoLayers"):
        checkpoint_decoder_layers(NoLayers())
