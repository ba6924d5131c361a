"""The adapter folders the vLLM engine loads (areal_fast/rollout/vllm_lora.py), without vLLM:
peft loads each folder back to the trainer's model, and bad updates are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rollout.vllm_lora import VersionedAdapters, check_adapter, vllm_lora_args
from areal_fast.train.config import ActorConfig
from areal_fast.train.lora import LoraConfig, apply_lora, lora_layers
from areal_fast.train.torch_engine import TorchTrainEngine

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def _trainer_with_random_adapter(model_dir, seed: int):
    model = load_causal_lm(str(model_dir))
    trainer = TorchTrainEngine(model, ActorConfig(lora=LORA), temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(trainer.model):
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return trainer


def _peft_merged(model_dir, trainer):
    """The trainer's adapter merged by peft (merge_and_unload) into a fresh plain model (the
    trainer's own model runs packed attention, which needs packed input)."""
    adapter = {k: v for k, v in trainer.model.state_dict().items() if ".lora_" in k}
    model = apply_lora(load_causal_lm(str(model_dir)), LORA)
    assert not model.load_state_dict(adapter, strict=False).unexpected_keys
    return model.areal_peft_model.merge_and_unload().eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0].double()


def test_peft_loads_each_version_folder_to_the_trainers_model(tiny_model_dir, tmp_path):
    from peft import PeftModel

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    trainer = _trainer_with_random_adapter(tiny_model_dir, seed)
    vocab = trainer.model.config.vocab_size
    ids = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(seed))
    want = _logits(_peft_merged(tiny_model_dir, trainer), ids)
    base = _logits(load_causal_lm(str(tiny_model_dir)), ids)
    assert (want - base).abs().max() > 1e-2  # the adapter changes the outputs

    adapters = VersionedAdapters(str(tiny_model_dir), str(tmp_path / "adapters"))
    folder = adapters.write(trainer.named_weights(), 3)
    assert folder.name == "v3"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == LORA.rank
    assert config["target_modules"] == sorted(LORA.target_modules)

    served = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(folder)).eval()
    got = _logits(served, ids)
    assert (got - want).abs().max() < 1e-5, f"seed {seed}"


def test_the_previous_folder_goes_when_a_new_version_is_installed(tiny_model_dir, tmp_path):
    trainer = _trainer_with_random_adapter(tiny_model_dir, 0)
    adapters = VersionedAdapters(str(tiny_model_dir), str(tmp_path / "adapters"))

    class Request:  # the fields of vLLM's LoRARequest the bookkeeping reads
        def __init__(self, folder):
            self.lora_path = str(folder)

    first = Request(adapters.write(trainer.named_weights(), 1))
    assert adapters.installed(first) is None
    second = Request(adapters.write(trainer.named_weights(), 2))
    assert adapters.installed(second) is first
    assert sorted(p.name for p in adapters.root.iterdir()) == ["v2"]
    refused = adapters.write(trainer.named_weights(), 3)  # vLLM did not take it
    adapters.discard(refused)
    adapters.discard(Path(second.lora_path))  # the served folder stays
    assert sorted(p.name for p in adapters.root.iterdir()) == ["v2"]
    assert adapters.installed(None) is second  # full weights: no adapter served
    assert list(adapters.root.iterdir()) == []
    adapters.close()
    assert not adapters.root.exists() and adapters.current is None


def test_bad_adapter_updates_are_named_and_nothing_is_written(tmp_path):
    a, b = torch.zeros(4, 16), torch.zeros(8, 4)
    m = "model.layers.0.self_attn.q_proj"
    assert check_adapter({f"{m}.lora_A": a}) == f"adapter for {m!r}: {m}.lora_B is missing"
    assert "'model.norm.weight' is not an adapter tensor" in check_adapter(
        {f"{m}.lora_A": a, f"{m}.lora_B": b, "model.norm.weight": torch.zeros(16)}
    )
    assert "are not [r, in] and [out, r]" in check_adapter(
        {f"{m}.lora_A": a, f"{m}.lora_B": torch.zeros(8, 3)}
    )
    k = "model.layers.0.self_attn.k_proj"
    assert "ranks differ between modules: [2, 4]" in check_adapter(
        {f"{m}.lora_A": a, f"{m}.lora_B": b, f"{k}.lora_A": a[:2], f"{k}.lora_B": b[:, :2]}
    )
    adapters = VersionedAdapters("base", str(tmp_path / "adapters"))
    with pytest.raises(ValueError, match=r"adapter update v5: adapter for .*lora_B is missing"):
        adapters.write([(f"{m}.lora_A", a)], 5)
    assert not (adapters.root / "v5").exists()


@pytest.mark.parametrize("rank, served", [(1, 1), (4, 8), (16, 16), (17, 32), (512, 512)])
def test_vllm_serves_the_smallest_max_lora_rank_that_holds_the_adapter(rank, served):
    args = vllm_lora_args(rank)
    assert args["enable_lora"] is True and args["max_lora_rank"] == served


def test_a_rank_vllm_cannot_serve_is_refused():
    with pytest.raises(ValueError, match=r"actor.lora.rank = 513: vLLM serves LoRA ranks 1..512"):
        vllm_lora_args(513)
