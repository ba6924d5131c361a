"""LoRA training: adapter gradients through the packed path, frozen base, adapter-only weights."""

from __future__ import annotations

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss
from areal_fast.train.config import ActorConfig
from areal_fast.train.lora import LoraConfig, lora_layers
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine

TEMPERATURE = 0.9


def _batch(vocab: int, seed: int, num: int = 8):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(num):
        p = int(torch.randint(2, 7, (1,), generator=g))
        c = int(torch.randint(2, 11, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        behav = (-2.5 * torch.rand(c, generator=g) - 4.0).tolist()
        trajs.append(Trajectory(ids[:p], ids[p:], behav, [0] * c, "stop", group_id=i // 2))
    return pack_trajectories(trajs, torch.randn(num, generator=g))


def _randomise_adapters(model, seed: int) -> None:
    """Non-zero B (peft starts it at 0, where A's gradient is 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _engine(model_dir, lora: LoraConfig, dtype=torch.float64, **fields):
    model = load_causal_lm(str(model_dir)).to(dtype)
    actor = ActorConfig(
        optim=OptimizerConfig(lr=1e-2),
        max_tokens_per_mb=24,
        keep_groups=False,
        use_decoupled_loss=False,
        lora=lora,
        **fields,
    )
    return TorchTrainEngine(model, actor, temperature=TEMPERATURE)


def _per_sequence_loss(model, batch, config: LossConfig):
    """Each sequence alone through the HF forward (sdpa, no packing), then grpo_loss."""
    bounds = batch.cu_seqlens.tolist()
    logprobs = []
    for s in range(batch.num_seqs):
        ids = batch.input_ids[bounds[s] : bounds[s + 1]]
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        logp = torch.log_softmax(logits / TEMPERATURE, -1)
        labels = batch.labels[bounds[s] : bounds[s + 1]]
        picked = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
        logprobs.append(torch.where(labels == -100, 0.0, picked))
    loss, _ = grpo_loss(
        torch.cat(logprobs),
        batch.behav_logprobs.double(),
        batch.advantages.double(),
        batch.loss_mask,
        batch.cu_seqlens,
        config,
    )
    return loss


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("fused", [True, False])
def test_adapter_gradient_packed_equals_per_sequence_float64(
    tiny_model_dir, aggregation, fused, fresh_seed
):
    seed = fresh_seed % 1000
    config = LossConfig(aggregation=aggregation)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = _engine(tiny_model_dir, lora, loss=config)
    trainer.fused_loss = fused
    model = trainer.model
    _randomise_adapters(model, seed)
    batch = _batch(model.config.vocab_size, seed)
    stats = trainer.accumulate_gradients(batch)
    assert stats["num_micro_batches"] > 2
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(packed) == 2 * 3 * model.config.num_hidden_layers  # A and B of 3 per layer
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)

    model.zero_grad(set_to_none=True)
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        _per_sequence_loss(model, batch, config).backward()
    finally:
        model.set_attn_implementation(impl)
    for name, param in model.named_parameters():
        if name in packed:
            scale = float(param.grad.abs().max())
            assert scale > 0, name
            err = float((packed[name] - param.grad).abs().max()) / scale
            assert err < 1e-9, (name, err, seed)


def test_train_step_changes_only_the_adapters(tiny_model_dir, fresh_seed):
    lora = LoraConfig(rank=4, alpha=8.0)  # all-linear
    trainer = _engine(tiny_model_dir, lora, dtype=torch.float32)
    model = trainer.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in model.named_parameters() if n in trainable}
    layers = dict(lora_layers(model))
    # every linear layer but the LM head: 7 per llama layer
    assert len(layers) == 7 * model.config.num_hidden_layers
    assert trainer.trainable_parameters == sum(
        p.numel() for n, p in model.named_parameters() if n in trainable
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = trainer.train_step(_batch(model.config.vocab_size, fresh_seed % 1000))
    assert stats["grad_norm"] > 0
    for name, param in model.named_parameters():
        if name in trainable and ".lora_B." in name:  # B starts at 0 and moves
            assert not torch.equal(param, before[name]), name
        elif name not in trainable:
            assert torch.equal(param, before[name]), name


def test_named_weights_are_the_adapter_only(tiny_model_dir):
    lora = LoraConfig(rank=4, alpha=12.0, target_modules=["q_proj", "o_proj"])
    trainer = _engine(tiny_model_dir, lora, dtype=torch.float32)
    _randomise_adapters(trainer.model, 3)
    sent = dict(trainer.named_weights())
    layers = dict(lora_layers(trainer.model))
    assert set(sent) == {f"{n}{s}" for n in layers for s in (".lora_A", ".lora_B")}
    for name, layer in layers.items():
        assert torch.equal(sent[name + ".lora_A"], layer.lora_A["default"].weight)
        want_b = layer.lora_B["default"].weight * 3.0  # alpha / rank
        assert torch.allclose(sent[name + ".lora_B"], want_b)
        assert sent[name + ".lora_A"].shape == (4, layer.in_features)
        assert sent[name + ".lora_B"].shape == (layer.out_features, 4)


@pytest.mark.parametrize(
    "targets, needle",
    [
        (["q_prj"], "'q_prj' names no module of the model"),
        (["lm_head"], "the LM head or embeddings"),
        (["embed_tokens"], "the LM head or embeddings"),
        (["self_attn"], "not a Linear"),
    ],
)
def test_bad_target_modules_name_the_key_and_the_linear_modules(tiny_model_dir, targets, needle):
    with pytest.raises(ValueError) as info:
        _engine(tiny_model_dir, LoraConfig(rank=4, target_modules=targets), dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("actor.lora.target_modules: ") and needle in message
    assert "q_proj, up_proj, v_proj" in message  # the model's linear names, sorted


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"rank": -1}, "lora.rank"),
        ({"alpha": 0.0}, "lora.alpha"),
        ({"dropout": 1.0}, "lora.dropout"),
        ({"target_modules": []}, "lora.target_modules"),
        ({"target_modules": ["all-linear", "q_proj"]}, "stands alone"),
    ],
)
def test_lora_config_validation(fields, needle):
    with pytest.raises(ValueError, match=needle):
        LoraConfig(**fields)


def test_rank_zero_is_full_fine_tuning(tiny_model_dir):
    assert not ActorConfig().lora.enabled and ActorConfig(lora=None).lora == LoraConfig()
    trainer = _engine(tiny_model_dir, LoraConfig(), dtype=torch.float32)
    assert all(p.requires_grad for p in trainer.model.parameters())
    assert [n for n, _ in trainer.named_weights()] == [
        n for n, _ in trainer.model.named_parameters()
    ]


def test_train_state_holds_the_adapter_and_resumes_equal(tiny_model_dir, tmp_path, fresh_seed):
    from safetensors import safe_open

    from areal_fast.train.checkpoint import load_train_state, save_train_state

    seed = fresh_seed % 1000
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"])
    batches = [_batch(100, seed + i) for i in range(3)]
    first = _engine(tiny_model_dir, lora, dtype=torch.float32)
    first.train_step(batches[0])
    save_train_state(first, str(tmp_path / "state"))
    with safe_open(str(tmp_path / "state" / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    trainable = {n for n, p in first.model.named_parameters() if p.requires_grad}
    assert saved == trainable  # the adapter only, not the frozen base
    optim = torch.load(tmp_path / "state" / "optimizer.pt", weights_only=True)
    assert set(optim["state"]) == trainable
    want = [first.train_step(b)["loss"] for b in batches[1:]]

    resumed = _engine(tiny_model_dir, lora, dtype=torch.float32)
    load_train_state(resumed, str(tmp_path / "state"))
    assert resumed.version == 1
    got = [resumed.train_step(b)["loss"] for b in batches[1:]]
    assert got == want
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_save_writes_a_merged_model_and_the_adapter(tiny_model_dir, tmp_path):
    import peft
    import transformers

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    trainer = _engine(tiny_model_dir, lora, dtype=torch.float32)
    _randomise_adapters(trainer.model, 7)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    trainer.model.set_attn_implementation("sdpa")  # a whole sequence, not packed
    with torch.no_grad():
        want = trainer.model(input_ids=ids, use_cache=False).logits
    trainer.save(str(tmp_path / "out"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        got = plain(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max() < 1e-5
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter")).eval()
    with torch.no_grad():
        again = adapted(input_ids=ids, use_cache=False).logits
    assert (again - want).abs().max() < 1e-5
