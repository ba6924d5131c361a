"""CISPO, SAPO and M2PO (``LossConfig.surrogate``) against references written from each
paper's equation (``loss_reference``, float64, fresh random inputs every run): values and
gradients of ``grpo_loss``, M2PO's mask, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from loss_reference import FAMILY, check_case, inputs, m2po_reference, token_adv

from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss
from areal_fast.rl.surrogates import m2po_keep

SURROGATE_CASES = [name for name, cfg in FAMILY.items() if cfg.surrogate != "clip"]


@pytest.mark.parametrize("name", SURROGATE_CASES)
def test_values_and_gradients_match_the_papers(name, fresh_seed):
    check_case(name, fresh_seed)


def test_m2po_masks_some_tokens(fresh_seed):
    logp, old, _, _, adv, mask, cu = inputs()
    _, stats = grpo_loss(logp, old, adv, mask, cu, FAMILY["m2po"])
    assert 0 < float(stats["clip_fraction"]) < 1, fresh_seed


def test_m2po_mask_is_the_fewest_drops(fresh_seed):
    log_ratio = 0.4 * torch.randn(40, dtype=torch.float64)
    mask = torch.rand(40) > 0.1
    for threshold in (1e-3, 0.02, 0.1, 10.0):
        keep = m2po_keep(log_ratio, mask, threshold)
        want = torch.tensor(m2po_reference(log_ratio, mask, threshold)) > 0
        assert torch.equal(keep, want), (threshold, fresh_seed)
        if keep.any():
            assert float((log_ratio[keep] ** 2).mean()) < threshold
    assert not m2po_keep(log_ratio, torch.zeros(40, dtype=torch.bool), 0.04).any()


def test_sapo_gate_gives_the_unclipped_gradient_on_policy(fresh_seed):
    """At r = 1 SAPO's gradient is −A (df/dr = 1), whatever τ."""
    logp, old, _, _, adv, mask, cu = inputs()
    lp = old.clone().requires_grad_(True)
    cfg = LossConfig(surrogate="sapo", sapo_tau_pos=2.0, sapo_tau_neg=7.0, aggregation="token_sum")
    loss, _ = grpo_loss(lp, old, adv, mask, cu, cfg)
    loss.backward()
    want = torch.where(mask, -token_adv(adv, cu), 0.0)
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(surrogate="ppo"), "surrogate = 'ppo' is not one of"),
        (dict(surrogate="cispo", dual_clip_c=3.0), "dual_clip_c = 3.0 applies to the PPO clip"),
        (dict(surrogate="sapo", ratio_level="sequence"), "surrogate = 'sapo' is defined on"),
        (dict(surrogate="sapo", sapo_tau_neg=0.0), "sapo_tau_neg = 0.0 must be"),
        (dict(surrogate="m2po", m2po_threshold=-1.0), "m2po_threshold = -1.0 must be"),
        (dict(eps_clip=1.0), r"eps_clip = 1.0 must be in \(0, 1\) \(or 1 with surrogate"),
    ],
)
def test_refused_combinations_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LossConfig(**kwargs)
    assert "\n" not in str(info.value)
