"""Trainer-state checkpoints resume bit-exactly; partial directories fail loudly; the LR
schedule follows its formula."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from fsdp_procs import checkpoint_ranks, global_batch, plain_actor, run_ranks, save_ranks
from safetensors.torch import load_file, save_file

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl.batch import select_sequences
from areal_fast.rl.config import LossConfig
from areal_fast.train.checkpoint import load_train_state, save_train_state
from areal_fast.train.lora import LoraConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine, lr_factor

OPTIM = OptimizerConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1)


def _engine(model_dir, **actor_fields) -> TorchTrainEngine:
    actor_fields.setdefault("max_tokens_per_mb", 40)
    return TorchTrainEngine(
        load_causal_lm(str(model_dir)),
        plain_actor(loss=LossConfig(), optim=OPTIM, **actor_fields),
        temperature=1.0,
        total_steps=4,
    )


def _step(engine, seed: int, k: int) -> dict:
    return engine.train_step(global_batch(engine.model.config.vocab_size, seed + k, engine.version))


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


@pytest.mark.parametrize(
    "extra",
    [{}, dict(use_decoupled_loss=True, ppo_n_minibatches=2)],
    ids=["plain", "decoupled-2-minibatches"],
)
def test_resume_is_bit_exact(tiny_model_dir, tmp_path, seed, extra):
    a = _engine(tiny_model_dir, **extra)
    for k in range(2):
        _step(a, seed, k)
    save_train_state(a, str(tmp_path))
    rng_a = (torch.rand(3), np.random.rand(3), random.random())
    stats_a = _step(a, seed, 2)
    torch.manual_seed(seed)
    b = _engine(tiny_model_dir, **extra)
    load_train_state(b, str(tmp_path))
    rng_b = (torch.rand(3), np.random.rand(3), random.random())
    stats_b = _step(b, seed, 2)
    assert stats_a == stats_b  # every statistic, exactly: loss, grad_norm, lr, version ...
    assert b.version == a.version == 3
    for (name, wa), (_, wb) in zip(a.named_weights(), b.named_weights()):
        assert torch.equal(wa, wb), name
    assert torch.equal(rng_a[0], rng_b[0]) and np.array_equal(rng_a[1], rng_b[1])
    assert rng_a[2] == rng_b[2]


def test_directory_layout(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir)
    directory = tmp_path / "new" / "ckpt"  # created, and nothing but these files written
    save_train_state(engine, str(directory))
    meta = json.loads((directory / "train_state.json").read_text())
    assert meta["version"] == 0 and meta["world_size"] == 1
    assert sorted(meta["files"]) == ["model.safetensors", "optimizer.pt", "rng_rank0.json"]
    assert sorted(os.listdir(directory)) == sorted(meta["files"]) + ["train_state.json"]
    for name, size in meta["files"].items():
        assert (directory / name).stat().st_size == size
    weights = load_file(str(directory / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied to the embedding: stored once
    assert weights["model.embed_tokens.weight"].shape == (engine.model.config.vocab_size, 48)


@pytest.fixture
def saved(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir)
    _step(engine, 5, 0)
    save_train_state(engine, str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _reshape_weight(directory):
    """Rewrite model.safetensors with one tensor of another shape, sizes kept consistent."""
    path = directory / "model.safetensors"
    weights = load_file(str(path))
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(path))
    meta = json.loads((directory / "train_state.json").read_text())
    meta["files"]["model.safetensors"] = path.stat().st_size
    (directory / "train_state.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "train_state.json").unlink(), r"train_state\.json is missing"),
        (lambda d: _truncate(d / "train_state.json"), r"train_state\.json is not readable JSON"),
        (lambda d: _truncate(d / "model.safetensors"), r"model\.safetensors has \d+ bytes"),
        (lambda d: _truncate(d / "optimizer.pt"), r"optimizer\.pt has \d+ bytes"),
        (lambda d: (d / "optimizer.pt").unlink(), r"optimizer\.pt is missing"),
        (lambda d: (d / "rng_rank0.json").unlink(), r"rng_rank0\.json is missing"),
        (_reshape_weight, r"model\.safetensors: weight 'model\.norm\.weight' has shape \(7,\)"),
    ],
    ids=[
        "no-state-json",
        "bad-state-json",
        "short-model",
        "short-optimizer",
        "no-optimizer",
        "no-rng",
        "weight-shape",
    ],
)
def test_damaged_directory_is_one_clear_error(tiny_model_dir, saved, damage, match):
    damage(saved)
    engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match=match) as err:
        load_train_state(engine, str(saved))
    assert "\n" not in str(err.value)
    assert engine.version == 0  # nothing was loaded


def test_other_model_is_rejected_by_name(tiny_model_dir, tiny_qwen_dir, saved):
    engine = _engine(tiny_qwen_dir)  # untied head: lm_head.weight is not in the file
    with pytest.raises(ValueError, match=r"model\.safetensors: weight '.*' is (missing|not in)"):
        load_train_state(engine, str(saved))


def test_optimizer_of_another_model_is_rejected(tiny_model_dir, saved, tmp_path):
    other = TorchTrainEngine(
        load_causal_lm(str(tiny_model_dir)),
        plain_actor(loss=LossConfig(), optim=OPTIM),
        temperature=1.0,
    )
    state = torch.load(saved / "optimizer.pt", weights_only=True)
    state["state"]["model.norm.weight"]["exp_avg"] = torch.zeros(5)
    torch.save(state, saved / "optimizer.pt")
    meta = json.loads((saved / "train_state.json").read_text())
    meta["files"]["optimizer.pt"] = (saved / "optimizer.pt").stat().st_size
    (saved / "train_state.json").write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=r"optimizer\.pt: model\.norm\.weight\.exp_avg has "
        r"shape \(5,\)",
    ):
        load_train_state(other, str(saved))


def test_two_fsdp_ranks_resume_and_load_into_one_process(tiny_model_dir, tmp_path, seed):
    directory = tmp_path / "fsdp"
    reports = run_ranks(
        checkpoint_ranks,
        2,
        (
            str(tiny_model_dir),
            str(directory),
            seed,
            dict(max_tokens_per_mb=40, use_decoupled_loss=True),
        ),
    )
    for report in reports:
        assert report["stats_a"] == report["stats_b"]
        assert report["rng_a"] == report["rng_b"]
        for name, wa in report["weights_a"].items():
            assert np.array_equal(wa, report["weights_b"][name]), name
    assert json.loads((directory / "train_state.json").read_text())["world_size"] == 2
    # the full-state-dict checkpoint of 2 ranks resumes a single process on the whole batch
    single = _engine(tiny_model_dir, use_decoupled_loss=True)
    load_train_state(single, str(directory))
    assert single.version == 2
    stats = _step(single, seed, 2)
    for key, value in reports[0]["stats_a"].items():
        if key != "num_micro_batches":
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_fsdp_ranks_save_a_tied_head_once(tiny_model_dir, tmp_path):
    """The HF checkpoint of 2 ranks names the same tensors as one process's: a tied
    lm_head.weight is written once (as model.embed_tokens.weight), not as a second copy."""
    single = _engine(tiny_model_dir)
    assert single.model.config.tie_word_embeddings
    single.save(str(tmp_path / "single"))
    reports = run_ranks(save_ranks, 2, (str(tiny_model_dir), str(tmp_path / "fsdp")))
    want = load_file(str(tmp_path / "single" / "model.safetensors"))
    got = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    assert "lm_head.weight" not in want
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        assert np.array_equal(reports[0]["weights"][name], tensor.numpy()), name
    size = (tmp_path / "fsdp" / "model.safetensors").stat().st_size
    assert size == (tmp_path / "single" / "model.safetensors").stat().st_size


LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


def test_two_fsdp_ranks_resume_lora_and_load_into_one_process(tiny_model_dir, tmp_path, seed):
    """With actor.lora the checkpoint holds the adapter and its optimizer state only; two
    FSDP ranks resume from it exactly, and so does a single process."""
    directory = tmp_path / "fsdp-lora"
    fields = dict(max_tokens_per_mb=40, use_decoupled_loss=True, lora=LORA)
    reports = run_ranks(checkpoint_ranks, 2, (str(tiny_model_dir), str(directory), seed, fields))
    for report in reports:
        assert report["stats_a"] == report["stats_b"]
        for name, wa in report["weights_a"].items():
            assert ".lora_" in name
            assert np.array_equal(wa, report["weights_b"][name]), name
    saved = load_file(str(directory / "model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    single = _engine(tiny_model_dir, use_decoupled_loss=True, lora=LORA)
    load_train_state(single, str(directory))
    assert single.version == 2
    stats = _step(single, seed, 2)
    for key, value in reports[0]["stats_a"].items():
        if key != "num_micro_batches":
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_fsdp_ranks_save_the_merged_lora_model(tiny_model_dir, tmp_path, seed):
    import transformers

    fields = dict(max_tokens_per_mb=40, lora=LORA, optim=OptimizerConfig(lr=1e-2))
    run_ranks(save_ranks, 2, (str(tiny_model_dir), str(tmp_path / "fsdp"), seed, fields))
    single = TorchTrainEngine(
        load_causal_lm(str(tiny_model_dir)), plain_actor(**fields), temperature=1.0
    )
    single.train_step(global_batch(single.model.config.vocab_size, seed, 0))
    single.save(str(tmp_path / "single"))
    want = load_file(str(tmp_path / "single" / "model.safetensors"))
    got = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert sorted(want) == sorted(base)  # plain names: no base_layer, no adapter
    # the two ranks reduce gradients in another order; Adam's first step, g / (|g| + eps),
    # turns that rounding into a visible change where |g| is near eps, so the merged
    # weights are compared by the change the step made, not element by element
    for name, tensor in want.items():
        step, diff = tensor - base[name], got[name] - tensor
        assert diff.norm() <= 1e-3 * step.norm() + 1e-7, (name, diff.norm(), step.norm())
    assert any(not torch.equal(want[n], base[n]) for n in want if "q_proj" in n)
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp"))
    assert (tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------- LR schedule
def _expected_factor(u: int, schedule: str, warmup: int, total) -> float:
    if u < warmup:
        return (u + 1) / (warmup + 1)
    if schedule == "constant" or total is None:
        return 1.0
    p = min((u - warmup) / (total - warmup), 1.0)
    return 1 - p if schedule == "linear" else (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize(
    "schedule, warmup, total, minibatches",
    [
        ("constant", 0, None, 1),
        ("constant", 2, 5, 1),
        ("linear", 2, 5, 1),
        ("cosine", 1, 3, 2),
        ("linear", 0, None, 1),
    ],
)
def test_lr_follows_the_schedule(tiny_model_dir, schedule, warmup, total, minibatches):
    optim = OptimizerConfig(lr=1e-3, lr_schedule=schedule, warmup_steps=warmup)
    engine = TorchTrainEngine(
        load_causal_lm(str(tiny_model_dir)),
        plain_actor(loss=LossConfig(), optim=optim, ppo_n_minibatches=minibatches),
        temperature=1.0,
        total_steps=total,
    )
    updates = None if total is None else total * minibatches
    vocab = engine.model.config.vocab_size
    for step in range(5):
        batch = select_sequences(global_batch(vocab, step, 0), [0, 1])
        got = engine.train_step(batch)["lr"]
        want = np.mean(
            [
                1e-3 * _expected_factor(step * minibatches + i, schedule, warmup, updates)
                for i in range(minibatches)
            ]
        )
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18), (step, got, want)
        assert lr_factor(step, schedule, warmup, updates) == pytest.approx(
            _expected_factor(step, schedule, warmup, updates), rel=1e-15
        )


def test_default_lr_is_constant_and_untouched(tiny_model_dir):
    engine = TorchTrainEngine(
        load_causal_lm(str(tiny_model_dir)),
        plain_actor(loss=LossConfig(), optim=OptimizerConfig(lr=3e-4)),
        temperature=1.0,
    )
    vocab = engine.model.config.vocab_size
    for step in range(3):
        assert engine.train_step(global_batch(vocab, step, 0))["lr"] == 3e-4
    assert engine.optimizer.param_groups[0]["lr"] == 3e-4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr_schedule="step"), "lr_schedule = 'step'"),
        (dict(warmup_steps=-1), "warmup_steps = -1"),
        (dict(warmup_steps=1.5), "warmup_steps = 1.5"),
    ],
)
def test_schedule_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_total_steps_is_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="total_steps = 0"):
        TorchTrainEngine(
            load_causal_lm(str(tiny_model_dir)),
            plain_actor(loss=LossConfig(), optim=OptimizerConfig()),
            temperature=1.0,
            total_steps=0,
        )
