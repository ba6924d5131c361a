"""AFGRPOTrainer against TRL's own GRPOTrainer: one real training step, and the loss and
gradients of every supported loss_type on the same prepared batch (fp32, CPU, offline)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from areal_fast.integrations.trl import AFGRPOTrainer, trl_loss_config  # noqa: E402

PROMPTS = ["12+7=", "3*4=", "9-5=", "8+8="]
NUM_GENERATIONS = 4
BATCH = 8  # completions per step: 2 prompts x 4 generations
MAX_COMPLETION = 8


def _reward(completions, **kwargs):
    """Deterministic, varied reward so advantages are non-zero."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _args(tmp_path, name, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        max_steps=1,
        learning_rate=1e-3,
        temperature=0.8,
        seed=7,
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_grad_norm=0.0,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _trainer(cls, model_dir, args, callbacks=None, **config_changes):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS})
    return cls(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=callbacks,
    )


class _GradSnapshot(transformers.TrainerCallback):
    """Copies the gradients just before the optimizer step."""

    grads: dict

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }


def _assert_grads_close(got: dict, want: dict, rtol=1e-4):
    assert got.keys() == want.keys()
    scale = max(g.abs().max().item() for g in want.values())
    assert scale > 1e-4, "reference gradients are all ~0: the comparison would prove nothing"
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= rtol * scale, f"max |grad diff| {worst:.3g} vs max |grad| {scale:.3g}"
    return worst, scale


def test_one_training_step_matches_trl(tiny_model_dir, tmp_path):
    """trainer.train() for one step: same completions, rewards, loss, entropy and gradients."""
    results = {}
    for cls in (GRPOTrainer, AFGRPOTrainer):
        snapshot = _GradSnapshot()
        trainer = _trainer(
            cls,
            tiny_model_dir,
            _args(tmp_path, cls.__name__, loss_type="grpo"),
            callbacks=[snapshot],
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        moved = max((p - before[n]).abs().max().item() for n, p in trainer.model.named_parameters())
        results[cls] = (trainer.state.log_history[0], snapshot.grads, moved)
    (want, want_grads, _), (got, got_grads, moved) = results[GRPOTrainer], results[AFGRPOTrainer]
    assert moved > 0, "the adapter's step did not update the parameters"
    assert got["reward"] == want["reward"] and got["reward_std"] == want["reward_std"]
    assert want["reward_std"] > 0
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-4, abs_tol=1e-6)
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-4)
    assert math.isclose(got["entropy"], want["entropy"], rel_tol=1e-5)
    _assert_grads_close(got_grads, want_grads)


@pytest.fixture(scope="module")
def prepared(tiny_model_dir, tmp_path_factory):
    """One generated and scored batch, with an off-policy 'old' policy and a reference policy.

    Row 1's completion is cut short and row 2's is fully masked (as mask_truncated_completions
    does), so per-sequence normalisers and empty sequences are exercised.
    """
    tmp = tmp_path_factory.mktemp("trl-prepared")
    trainer = _trainer(GRPOTrainer, tiny_model_dir, _args(tmp, "gen"))
    trainer.model.train()
    rows = [
        {"prompt": p} for p in PROMPTS[: BATCH // NUM_GENERATIONS] for _ in range(NUM_GENERATIONS)
    ]
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(rows)
    mask = inputs["completion_mask"].clone()
    mask[1, 3:] = 0
    mask[2, :] = 0
    inputs["completion_mask"] = mask
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], mask], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, am, mask.shape[1]
        )
    gen = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=gen)
    inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=gen)
    inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + 0.4 * torch.randn(
        logps.shape, generator=gen
    )
    inputs["sampling_per_token_logps"][0, 0] = float("nan")  # a token the engine did not score
    inputs["num_items_in_batch"] = mask.sum()
    assert inputs["advantages"].abs().max() > 0
    return inputs


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "luspo-gspo": dict(
        loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4
    ),
    "grpo-gspo-kl-delta-entropy": dict(
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=0.01,
        beta=0.04,
        use_bias_correction_kl=False,
        delta=1.05,
        entropy_coef=0.01,
    ),
    "bnpo-kl-token-advantages": dict(
        loss_type="bnpo", beta=0.1, use_bias_correction_kl=False, epsilon=0.1
    ),
    "dapo-vllm-tis": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.25),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.5, sapo_temperature_neg=3.0),
    "grpo-vllm-icepop": dict(loss_type="grpo"),
}
# TRL's vLLM importance-sampling correction per case: (mode, clip_min, clip_max)
VLLM_IS = {
    "dapo-vllm-tis": ("token_truncate", None, 1.2),
    "grpo-vllm-icepop": ("token_mask", 0.7, 1.4),
}


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 2
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {
        n: p.grad.detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_match_trl(case, prepared, tiny_model_dir, tmp_path):
    inputs = dict(prepared)
    if case == "bnpo-kl-token-advantages":  # per-token advantages [B, C]
        ramp = torch.linspace(0.5, 1.5, inputs["completion_ids"].shape[1])
        inputs["advantages"] = inputs["advantages"][:, None] * ramp
    trainers = {}
    for cls in (GRPOTrainer, AFGRPOTrainer):
        trainers[cls] = _trainer(cls, tiny_model_dir, _args(tmp_path, cls.__name__, **CASES[case]))
    if case in VLLM_IS:
        # vLLM is not installed here: switch TRL's importance-sampling correction on after
        # construction and give TRL the ratio it would have computed (TRL's own formulas).
        mode, clip_min, clip_max = VLLM_IS[case]
        args = copy.copy(trainers[AFGRPOTrainer].args)
        args.use_vllm, args.vllm_importance_sampling_mode = True, mode
        args.vllm_importance_sampling_clip_min = clip_min
        args.vllm_importance_sampling_clip_max = clip_max
        trainers[AFGRPOTrainer].af_loss_config = trl_loss_config(args)
        trl = trainers[GRPOTrainer]
        trl.use_vllm, trl.vllm_importance_sampling_correction = True, True
        diff = inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]
        ratio = torch.exp(torch.nan_to_num(diff * inputs["completion_mask"], nan=0.0))
        if mode == "token_truncate":
            assert trainers[AFGRPOTrainer].af_loss_config.tis_cap == clip_max
            inputs["importance_sampling_ratio"] = ratio.clamp(max=clip_max)
        else:
            assert trainers[AFGRPOTrainer].af_loss_config.icepop
            outside = (ratio < clip_min) | (ratio > clip_max)
            assert 0 < float(outside.float().mean()) < 1, "the band masks nothing or all"
            inputs["importance_sampling_ratio"] = ratio.masked_fill(outside, 0.0)
    want_loss, want_grads = _loss_and_grads(trainers[GRPOTrainer], inputs)
    got_loss, got_grads = _loss_and_grads(trainers[AFGRPOTrainer], inputs)
    assert torch.isfinite(got_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-7)
    _assert_grads_close(got_grads, want_grads)
    metrics = trainers[AFGRPOTrainer]._metrics["train"]
    clip_metric = {"cispo": "cispo_clip_ratio", "sapo": "entropy"}.get(
        CASES[case]["loss_type"], "clip_ratio/region_mean"
    )
    assert metrics[clip_metric][-1] > 0, "no token was clipped: weak test"
    for name in (
        "cispo_clip_ratio",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "kl",
    ):
        want = trainers[GRPOTrainer]._metrics["train"].get(name)
        if want:
            assert metrics[name][-1] == pytest.approx(want[-1], rel=1e-4, abs=1e-7), name


def test_logprobs_and_entropy_match_trl(prepared, tiny_qwen_dir, tmp_path):
    """Untied LM head (Qwen2): per-token log-probs and entropies agree with TRL's fused head."""
    out, head_outputs = {}, []
    for cls in (GRPOTrainer, AFGRPOTrainer):
        trainer = _trainer(cls, tiny_qwen_dir, _args(tmp_path, cls.__name__))
        if cls is AFGRPOTrainer:
            trainer.model.get_output_embeddings().register_forward_hook(
                lambda module, args, output: head_outputs.append(tuple(output.shape))
            )
        ids = torch.cat([prepared["prompt_ids"], prepared["completion_ids"]], 1)
        am = torch.cat([prepared["prompt_mask"], prepared["completion_mask"]], 1)
        with torch.no_grad():
            out[cls] = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                ids,
                am,
                prepared["completion_ids"].shape[1],
                batch_size=3,
                compute_entropy=True,
            )[:2]
    for got, want in zip(out[AFGRPOTrainer], out[GRPOTrainer]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert (out[AFGRPOTrainer][0][2] == 0).all()  # fully masked row
    # the model's own LM head only ever scored the last position: no [B, L, V] logits
    assert head_outputs and all(shape[1] == 1 for shape in head_outputs), head_outputs


def test_logit_scale_and_softcap(prepared, tiny_model_dir, tmp_path):
    """A config logit scale (Cohere-style) is folded into the temperature as TRL applies it;
    final-logit soft-capping is refused at construction."""
    out = {}
    for cls in (GRPOTrainer, AFGRPOTrainer):
        trainer = _trainer(cls, tiny_model_dir, _args(tmp_path, cls.__name__), logit_scale=0.5)
        ids = torch.cat([prepared["prompt_ids"], prepared["completion_ids"]], 1)
        am = torch.cat([prepared["prompt_mask"], prepared["completion_mask"]], 1)
        with torch.no_grad():
            out[cls] = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, am, prepared["completion_ids"].shape[1]
            )[0]
    torch.testing.assert_close(out[AFGRPOTrainer], out[GRPOTrainer], rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        _trainer(
            AFGRPOTrainer, tiny_model_dir, _args(tmp_path, "softcap"), final_logit_softcapping=30.0
        )


def test_loss_types_differ(prepared, tiny_model_dir, tmp_path):
    """The comparison above can fail: each loss_type gives its own value on the same batch."""
    losses = {}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        trainer = _trainer(
            AFGRPOTrainer, tiny_model_dir, _args(tmp_path, loss_type, loss_type=loss_type)
        )
        inputs = dict(prepared)
        if loss_type == "dapo":  # as if the accumulation window held three such micro-batches
            inputs["num_items_in_batch"] = 3 * inputs["num_items_in_batch"]
        losses[loss_type] = _loss_and_grads(trainer, inputs)[0].item()
    values = sorted(losses.values())
    assert all(b - a > 1e-4 * abs(b) for a, b in zip(values, values[1:])), losses


def _base_args(tmp_path):
    return _args(tmp_path, "cfg")


def test_loss_config_mapping(tmp_path):
    base = _base_args(tmp_path)

    def cfg(**changes):
        args = copy.copy(base)
        for key, value in changes.items():
            setattr(args, key, value)
        return trl_loss_config(args)

    assert cfg(loss_type="grpo").aggregation == "seq_mean_token_mean"
    assert cfg(loss_type="bnpo").aggregation == "token_mean"
    assert cfg(loss_type="dapo").aggregation == "token_sum"
    dr = cfg(loss_type="dr_grpo")
    assert (dr.aggregation, dr.seq_len_norm) == ("seq_mean_token_sum", MAX_COMPLETION)
    lu = cfg(loss_type="luspo", importance_sampling_level="sequence")
    assert (lu.aggregation, lu.seq_len_norm, lu.ratio_level) == (
        "seq_mean_token_sum",
        1.0,
        "sequence",
    )
    c = cfg(epsilon=0.1, epsilon_high=0.3, delta=2.0, beta=0.05, use_bias_correction_kl=False)
    assert (c.eps_clip, c.clip_high, c.dual_clip_c, c.kl_coef, c.kl_estimator) == (
        0.1,
        0.3,
        2.0,
        0.05,
        "k3",
    )
    assert c.tis_cap is None and c.entropy_coef == 0
    ci = cfg(loss_type="cispo", epsilon_high=5.0, delta=2.0)
    assert (ci.surrogate, ci.aggregation, ci.eps_clip, ci.clip_high, ci.dual_clip_c) == (
        "cispo",
        "token_sum",
        1.0,
        4.0,
        None,
    )
    sa = cfg(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    assert (sa.surrogate, sa.aggregation, sa.sapo_tau_pos, sa.sapo_tau_neg) == (
        "sapo",
        "seq_mean_token_mean",
        0.5,
        2.0,
    )
    mask = cfg(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=3.0,
    )
    assert (mask.icepop, mask.icepop_low, mask.icepop_high, mask.tis_cap) == (True, 0.0, 3.0, None)


@pytest.mark.parametrize(
    "changes, option",
    [
        (dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high = 0.28 must be > 1"),
        (
            dict(loss_type="sapo", importance_sampling_level="sequence"),
            "importance_sampling_level = 'sequence' with loss_type = 'sapo'",
        ),
        (dict(loss_type="vespo"), "loss_type"),
        (dict(loss_type="nope"), "loss_type"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(delta=1.1, epsilon_high=0.28), "delta"),
        (dict(beta=0.1, use_bias_correction_kl=True), "use_bias_correction_kl"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy"),
        (
            dict(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="sequence_mask",
            ),
            "vllm_importance_sampling_mode",
        ),
        (
            dict(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_min=0.5,
            ),
            "vllm_importance_sampling_clip_min",
        ),
        (
            dict(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_mask",
                vllm_importance_sampling_clip_min=2.0,
                vllm_importance_sampling_clip_max=1.5,
            ),
            "vllm_importance_sampling_clip_min = 2.0 must be in",
        ),
    ],
)
def test_unsupported_options_raise(changes, option, tmp_path):
    args = copy.copy(_base_args(tmp_path))
    for key, value in changes.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=option):
        trl_loss_config(args)


def test_trainer_rejects_unsupported_loss_type(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="loss_type = 'vespo'"):
        _trainer(AFGRPOTrainer, tiny_model_dir, _args(tmp_path, "vespo", loss_type="vespo"))
