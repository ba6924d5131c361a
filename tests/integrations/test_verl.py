"""The areal_fast verl policy loss against verl's own "vanilla" policy loss (verl 0.9.1):
values, gradients and metrics on fresh random inputs, for every loss_agg_mode."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from areal_fast.integrations.verl import (
    LOSS_AGG_MODES,
    register_verl_policy_loss,
    verl_loss_config,
    verl_policy_loss,
)
from areal_fast.rl.config import LossConfig


def _import_core_algos():
    """Import verl's policy-loss module, or skip.

    verl's package ``__init__`` imports Ray for its distributed data protocol; the policy-loss
    code under test never uses it. Without Ray installed, a placeholder module stands in for
    the duration of the import only.
    """
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed", allow_module_level=True)
    placeholder = None
    if importlib.util.find_spec("ray") is None:
        placeholder = types.ModuleType("ray")
        placeholder.ObjectRef = type("ObjectRef", (), {})
        sys.modules["ray"] = placeholder
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as exc:
        pytest.skip(
            f"verl.trainer.ppo.core_algos cannot be imported: {exc}", allow_module_level=True
        )
    finally:
        if placeholder is not None and sys.modules.get("ray") is placeholder:
            del sys.modules["ray"]


core_algos = _import_core_algos()

GLOBAL_INFO = {
    "dp_size": 2,
    "batch_num_tokens": 57,
    "global_batch_size": 10,
    "loss_scale_factor": 16,
}


def _actor_config(global_batch_info=None, **overrides):
    from verl.workers.config import ActorConfig

    kwargs = dict(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info=dict(global_batch_info or {}),
    )
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


def _inputs(with_weights: bool, rows=6, length=11):
    """Random verl-style padded tensors; row 4 is fully masked, three tokens have |Δ| = 100
    (exp overflows fp32 without verl's clamp of Δ to [-20, 20])."""
    old = -3 * torch.rand(rows, length)
    new = old + 0.3 * torch.randn(rows, length)
    new[0, 0], new[1, 0], new[2, 0] = old[0, 0] + 100, old[1, 0] + 100, old[2, 0] - 100
    advantages = torch.randn(rows, 1).expand(rows, length).clone()
    advantages[0, 0], advantages[1, 0] = -1.0, 1.0
    lengths = torch.randint(1, length + 1, (rows,))
    lengths[4] = 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    weights = None
    if with_weights:
        weights = 2 * torch.rand(rows, length)
        weights[2, :2] = 0.0
    return old, new, advantages, mask, weights


def _run(fn, old, new, advantages, mask, weights, mode, config):
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True], ids=["no-is", "rollout-is"])
@pytest.mark.parametrize("info", [None, GLOBAL_INFO], ids=["local", "global"])
def test_matches_verl_vanilla(mode, with_weights, info, fresh_seed):
    old, new, advantages, mask, weights = _inputs(with_weights)
    config = _actor_config(info, loss_agg_mode=mode)
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    want_loss, want_grad, want_metrics = _run(
        vanilla, old, new, advantages, mask, weights, mode, config
    )
    got_loss, got_grad, got_metrics = _run(
        verl_policy_loss, old, new, advantages, mask, weights, mode, config
    )
    msg = f"seed {fresh_seed}"
    assert want_grad.abs().max() > 1e-3, msg
    # fp32: the loss is a sum of ~60 terms of either sign, summed in another order
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7, msg=msg)
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, msg)


def test_registry_and_dictconfig(fresh_seed):
    """Through verl's registry, with an omegaconf config; different modes give different
    losses, so the comparison above can fail."""
    omegaconf = pytest.importorskip("omegaconf")
    fn = register_verl_policy_loss("areal_fast_test")
    assert core_algos.get_policy_loss_fn("areal_fast_test") is fn
    assert register_verl_policy_loss("areal_fast_test") is not fn  # re-registering replaces
    fn = core_algos.get_policy_loss_fn("areal_fast_test")
    old, new, advantages, mask, weights = _inputs(True)
    config = omegaconf.OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": None,
            "clip_ratio_high": 0.3,
            "clip_ratio_c": 2.5,
            "global_batch_info": {},
        }
    )
    losses = {}
    for mode in LOSS_AGG_MODES:
        want = _run(
            core_algos.get_policy_loss_fn("vanilla"),
            old,
            new,
            advantages,
            mask,
            weights,
            mode,
            config,
        )
        got = _run(fn, old, new, advantages, mask, weights, mode, config)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
        losses[mode] = got[0].item()
    values = sorted(losses.values())
    distinct = 1 + sum(b - a > 1e-4 * abs(b) for a, b in zip(values, values[1:]))
    assert distinct >= 4, losses


@pytest.mark.parametrize("loss_mode", ["cispo", "sapo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("with_weights", [False, True], ids=["no-is", "rollout-is"])
def test_matches_verl_cispo_and_sapo(loss_mode, mode, with_weights, fresh_seed):
    """verl's own "cispo" and "sapo" losses against the adapter with that surrogate (SAPO
    aggregates as "seq-mean-token-mean" whatever loss_agg_mode says, in both)."""
    old, new, advantages, mask, weights = _inputs(with_weights)
    new = old + 0.4 * torch.randn_like(old)  # |Δ| < 20: verl's CISPO value uses log_prob
    config = _actor_config(GLOBAL_INFO, loss_agg_mode=mode, tau_pos=1.5, tau_neg=3.0)
    want = _run(core_algos.get_policy_loss_fn(loss_mode), old, new, advantages, mask, weights,
                mode, config)  # fmt: skip
    register_verl_policy_loss(f"af_{loss_mode}", LossConfig(surrogate=loss_mode))
    got = _run(core_algos.get_policy_loss_fn(f"af_{loss_mode}"), old, new, advantages, mask,
               weights, mode, config)  # fmt: skip
    msg = f"{loss_mode}, seed {fresh_seed}"
    assert want[1].abs().max() > 1e-3, msg
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7, msg=msg)
    if loss_mode == "cispo":
        assert 0 < want[2]["actor/pg_clipfrac"] < 1, msg
    for key, value in want[2].items():
        assert got[2][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, msg)


def test_sequence_ratio_template():
    """A template's ratio_level reaches grpo_loss (GSPO-style sequence ratios)."""
    config = _actor_config(loss_agg_mode="seq-mean-token-mean")
    cfg = verl_loss_config(config, "seq-mean-token-mean", 11, LossConfig(ratio_level="sequence"))
    assert (cfg.ratio_level, cfg.eps_clip, cfg.clip_high, cfg.dual_clip_c) == (
        "sequence",
        0.2,
        0.28,
        3.0,
    )
    old, new, advantages, mask, _ = _inputs(False)
    token = verl_policy_loss(old, new, advantages, mask, "seq-mean-token-mean", config)[0]
    seq = verl_policy_loss(
        old,
        new,
        advantages,
        mask,
        "seq-mean-token-mean",
        config,
        template=LossConfig(ratio_level="sequence"),
    )[0]
    assert not torch.isclose(token, seq)


@pytest.mark.parametrize(
    "call, option",
    [
        (lambda: register_verl_policy_loss("vanilla"), "name"),
        (lambda: register_verl_policy_loss("x", LossConfig(kl_coef=0.1)), "kl_coef"),
        (lambda: register_verl_policy_loss("x", LossConfig(tis_cap=2.0)), "tis_cap"),
        (lambda: register_verl_policy_loss("x", LossConfig(icepop=True)), "icepop"),
        (lambda: register_verl_policy_loss("x", LossConfig(surrogate="m2po")), "m2po"),
        (lambda: verl_loss_config(_actor_config(), "seq-mean"), "loss_agg_mode"),
        (lambda: verl_loss_config(_actor_config(clip_ratio_c=1.0)), "clip_ratio_c"),
        (lambda: verl_loss_config(_actor_config(clip_ratio_low=1.5)), "clip_ratio_low"),
        (
            lambda: verl_policy_loss(
                *_inputs(False)[:4], "token-mean", _actor_config({"dp_size": 2})
            ),
            "batch_num_tokens",
        ),
        (lambda: verl_policy_loss(*_inputs(False)[:4], "token-mean", None), "config"),
    ],
)
def test_errors_name_the_option(call, option):
    with pytest.raises(ValueError, match=option):
        call()
