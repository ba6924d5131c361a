"""Adapter-only weight updates: what travels, and the HF engine's merged weights."""

from __future__ import annotations

import pytest
import torch

from areal_fast.models.loading import load_causal_lm, load_tokenizer
from areal_fast.rollout.engine import SamplingParams
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.sync.shared_memory import SharedWeightBuffer
from areal_fast.sync.trainer_slots import TrainerSlots
from areal_fast.train.config import ActorConfig
from areal_fast.train.lora import LoraConfig, apply_lora, lora_layers
from areal_fast.train.torch_engine import TorchTrainEngine

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def _trainer(model_dir, lora=LORA):
    model = load_causal_lm(str(model_dir))
    return TorchTrainEngine(model, ActorConfig(lora=lora), temperature=1.0)


def _set_adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """Random A and B (B is 0 after peft's init); returns the adapter state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}


def _peft_merged(model_dir, adapter_state: dict, lora=LORA):
    """A fresh model with the same adapter, merged by peft's merge_and_unload."""
    model = apply_lora(load_causal_lm(str(model_dir)), lora)
    missing = model.load_state_dict(adapter_state, strict=False)
    assert not missing.unexpected_keys
    return model.areal_peft_model.merge_and_unload().eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]


def test_weight_update_carries_the_adapter_only(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    _set_adapters(trainer.model, 0)
    sent = list(trainer.named_weights())
    layers = dict(lora_layers(trainer.model))
    rank = LORA.rank
    expected = sum(4 * rank * (m.in_features + m.out_features) for m in layers.values())
    assert sum(t.numel() * t.element_size() for _, t in sent) == expected
    full = sum(p.numel() * 4 for p in load_causal_lm(str(tiny_model_dir)).parameters())
    assert expected < full / 4

    slots = TrainerSlots.start(iter(sent), 0, leader=True)
    try:
        slots.publish(trainer.named_weights(), 1)
        entries = slots[1].spec.entries
        assert {e.name for e in entries} == {name for name, _ in sent}
        assert sum(e.nbytes for e in entries) == expected
        # what a rollout worker installs from the slot (controller.rollout_weights)
        engine = HFEngine(load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)))
        reader = SharedWeightBuffer.attach(slots[1].spec)
        engine.update_weights(reader.named_tensors(), 1)
        reader.close()
        assert engine.version == 1
    finally:
        slots.close()


def test_engine_after_adapter_updates_equals_peft_merge(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    tok = load_tokenizer(str(tiny_model_dir))
    engine = HFEngine(load_causal_lm(str(tiny_model_dir)), tok, max_batch_size=4)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    ids = torch.tensor(tok("the cat sat on the mat")["input_ids"] * 2)
    prompts = [ids[:5].tolist(), ids[3:9].tolist()]
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    for version, seed in ((1, 11), (2, 12)):  # a second version does not add to the first
        adapter = _set_adapters(trainer.model, seed)
        engine.update_weights(trainer.named_weights(), version)
        merged = _peft_merged(tiny_model_dir, adapter)
        got, want = _logits(engine.model, ids), _logits(merged, ids)
        assert (got - want).abs().max() < 1e-5
        assert (got - _logits(load_causal_lm(str(tiny_model_dir)), ids)).abs().max() > 1e-2
        reference = HFEngine(merged, tok, max_batch_size=4)
        assert [t.completion_ids for t in engine.generate(prompts, greedy)] == [
            t.completion_ids for t in reference.generate(prompts, greedy)
        ]
    # the weights an adapter never touches are the base's, bit for bit
    adapted = {f"{n}.weight" for n, _ in lora_layers(trainer.model)}
    for name, value in engine.model.state_dict().items():
        if name not in adapted:
            assert torch.equal(value, base[name]), name


def test_smaller_adapter_restores_the_base_of_dropped_modules(tiny_model_dir):
    engine = HFEngine(load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)))
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    big = _trainer(tiny_model_dir)
    _set_adapters(big.model, 1)
    engine.update_weights(big.named_weights(), 1)
    small = _trainer(tiny_model_dir, LoraConfig(rank=2, target_modules=["q_proj"]))
    _set_adapters(small.model, 2)
    engine.update_weights(small.named_weights(), 2)
    for name, value in engine.model.state_dict().items():
        if "q_proj" not in name:
            assert torch.equal(value, base[name]), name


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.pop("model.layers.0.self_attn.q_proj.lora_B"), "lora_B is missing"),
        (
            lambda d: d.update({"model.layers.0.mlp.nope.lora_A": torch.zeros(4, 48)}),
            "no such module",
        ),
        (
            lambda d: d.update({"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 47)}),
            "do not make the weight",
        ),
    ],
)
def test_bad_adapter_update_changes_nothing(tiny_model_dir, change, needle):
    trainer = _trainer(tiny_model_dir)
    _set_adapters(trainer.model, 5)
    engine = HFEngine(load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    update = dict(trainer.named_weights())
    change(update)
    with pytest.raises(ValueError, match=needle):
        engine.update_weights(update.items(), 1)
    assert engine.version == 0
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, before[name]), name
