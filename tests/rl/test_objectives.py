"""grpo_loss against a straightforward per-sequence, per-token Python reference."""

import math

import pytest
import torch

from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss


def _reference(logp, old, adv_seq, mask, lengths, cfg, prox=None, ref=None, ent=None, eng=None):
    """Loops over sequences and tokens in float64; returns the scalar loss."""
    hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    seq_losses, seq_counts, total, count, start = [], [], 0.0, 0, 0
    for s, n in enumerate(lengths):
        toks = range(start, start + n)
        base = prox if prox is not None else old
        m_toks = [t for t in toks if mask[t]]
        seq_lr = sum(logp[t] - base[t] for t in m_toks) / max(len(m_toks), 1)
        s_sum = 0.0
        for t in m_toks:
            a = adv_seq[s]
            r = math.exp(seq_lr if cfg.ratio_level == "sequence" else logp[t] - base[t])
            pg = max(-a * r, -a * min(max(r, 1 - cfg.eps_clip), 1 + hi))
            if cfg.dual_clip_c is not None and a < 0:
                pg = min(pg, -cfg.dual_clip_c * a)
            if prox is not None:
                w = math.exp(prox[t] - old[t])
                if cfg.behav_weight_cap is not None:
                    if cfg.behav_weight_mode == "mask":
                        w = 0.0 if w > cfg.behav_weight_cap else w
                    else:
                        w = min(w, cfg.behav_weight_cap)
                pg *= w
            if eng is not None and cfg.tis_cap is not None:
                pg *= min(math.exp(old[t] - eng[t]), cfg.tis_cap)
            loss = pg
            if ref is not None:
                d = logp[t] - ref[t]
                kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[cfg.kl_estimator]
                loss += cfg.kl_coef * kl
            if ent is not None:
                loss -= cfg.entropy_coef * ent[t]
            s_sum += loss
        seq_losses.append(s_sum)
        seq_counts.append(len(m_toks))
        total += s_sum
        count += len(m_toks)
        start += n
    if cfg.aggregation == "token_mean":
        return total / max(count, 1)
    if cfg.aggregation == "token_sum":
        return total
    if cfg.aggregation == "seq_mean_token_sum":
        return sum(seq_losses) / (len(lengths) * cfg.seq_len_norm)
    means = [loss / c for loss, c in zip(seq_losses, seq_counts) if c > 0]
    return sum(means) / max(len(means), 1)


CONFIGS = [
    LossConfig(),
    LossConfig(eps_clip=0.1, eps_clip_high=0.28),
    LossConfig(dual_clip_c=3.0),
    LossConfig(ratio_level="sequence"),
    LossConfig(aggregation="seq_mean_token_mean"),
    LossConfig(aggregation="seq_mean_token_sum", seq_len_norm=32.0),
    LossConfig(aggregation="token_sum"),
    LossConfig(kl_coef=0.1, kl_estimator="k1"),
    LossConfig(kl_coef=0.1, kl_estimator="k2"),
    LossConfig(kl_coef=0.1, kl_estimator="k3"),
    LossConfig(entropy_coef=0.01),
    LossConfig(behav_weight_cap=1.2, behav_weight_mode="mask"),
    LossConfig(behav_weight_cap=1.2, behav_weight_mode="clamp"),
    LossConfig(tis_cap=2.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(c)[11:70])
def test_matches_reference(cfg, fresh_seed):
    lengths = [5, 1, 9, 3, 12]
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    old = -torch.rand(T, dtype=torch.float64) * 3
    logp = (old + torch.randn(T, dtype=torch.float64) * 0.3).requires_grad_()
    prox = old + torch.randn(T, dtype=torch.float64) * 0.2 if cfg.behav_weight_cap else None
    ref = old + torch.randn(T, dtype=torch.float64) * 0.2 if cfg.kl_coef else None
    ent = torch.rand(T, dtype=torch.float64).requires_grad_() if cfg.entropy_coef else None
    eng = old + torch.randn(T, dtype=torch.float64) * 0.3 if cfg.tis_cap else None
    mask = torch.rand(T) < 0.7
    mask[cu[3] : cu[4]] = False  # a sequence with no trained token
    adv_seq = torch.randn(len(lengths), dtype=torch.float64)
    loss, stats = grpo_loss(
        logp,
        old,
        adv_seq,
        mask,
        cu,
        cfg,
        prox_logprobs=prox,
        ref_logprobs=ref,
        entropy=ent,
        engine_logprobs=eng,
    )
    want = _reference(
        logp.tolist(),
        old.tolist(),
        adv_seq.tolist(),
        mask.tolist(),
        lengths,
        cfg,
        None if prox is None else prox.tolist(),
        None if ref is None else ref.tolist(),
        None if ent is None else ent.tolist(),
        None if eng is None else eng.tolist(),
    )
    assert abs(loss.item() - want) < 1e-9, f"seed {fresh_seed}"
    # per-token advantages give the same loss
    adv_tok = torch.repeat_interleave(adv_seq, torch.tensor(lengths))
    loss_tok, _ = grpo_loss(
        logp,
        old,
        adv_tok,
        mask,
        cu,
        cfg,
        prox_logprobs=prox,
        ref_logprobs=ref,
        entropy=ent,
        engine_logprobs=eng,
    )
    assert abs(loss_tok.item() - want) < 1e-9
    loss.backward()
    assert torch.all(logp.grad[~mask] == 0)
    assert 0 <= stats["clip_fraction"].item() <= 1
    assert stats["num_tokens"].item() == mask.sum().item()


def test_gradient_matches_finite_difference(fresh_seed):
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    old = -torch.rand(10, dtype=torch.float64)
    logp = (old + 0.05 * torch.randn(10, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask = torch.ones(10, dtype=torch.bool)
    cfg = LossConfig(kl_coef=0.0)
    assert torch.autograd.gradcheck(lambda x: grpo_loss(x, old, adv, mask, cu, cfg)[0], (logp,))


def test_no_masked_token_returns_zero_with_graph():
    logp = torch.randn(6, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    loss, _ = grpo_loss(
        logp, logp.detach(), torch.randn(2), torch.zeros(6, dtype=torch.bool), cu, LossConfig()
    )
    loss.backward()
    assert loss.item() == 0 and torch.all(logp.grad == 0)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(behav_weight_cap=2.0),
        LossConfig(tis_cap=2.0),
        LossConfig(kl_coef=0.1),
    ],
)
def test_non_finite_values_at_masked_positions_stay_out(cfg):
    """Padding positions may hold -inf or huge log-ratios; loss and gradients stay finite."""
    logp = torch.tensor([-1.0, 0.0, -0.5, 0.0], requires_grad=True)
    old = torch.tensor([-1.1, float("-inf"), -0.4, -200.0])
    other = torch.tensor([-1.0, float("-inf"), -0.5, 150.0])
    mask = torch.tensor([True, False, True, False])
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    loss, stats = grpo_loss(
        logp,
        old,
        torch.tensor([1.0, -1.0]),
        mask,
        cu,
        cfg,
        prox_logprobs=other if cfg.behav_weight_cap else None,
        engine_logprobs=other if cfg.tis_cap else None,
        ref_logprobs=other if cfg.kl_coef else None,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[1] == 0 and logp.grad[3] == 0
    assert all(torch.isfinite(v) for v in stats.values())


def test_clipping_blocks_gradient_outside_range():
    """A positive-advantage token whose ratio exceeds 1 + eps gets no gradient."""
    old = torch.zeros(2)
    logp = torch.tensor([0.5, 0.05], requires_grad=True)  # ratios 1.65 and 1.05
    cu = torch.tensor([0, 2], dtype=torch.int32)
    loss, stats = grpo_loss(
        logp,
        old,
        torch.tensor([1.0]),
        torch.ones(2, dtype=torch.bool),
        cu,
        LossConfig(eps_clip=0.2),
    )
    loss.backward()
    assert logp.grad[0] == 0 and logp.grad[1] != 0
    assert stats["clip_fraction"].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(aggregation="mean"), "aggregation"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(aggregation="seq_mean_token_sum"), "seq_len_norm"),
        (dict(eps_clip=1.5), "eps_clip"),
        (dict(dual_clip_c=0.5), "dual_clip_c"),
        (dict(dual_clip_c=float("nan")), "dual_clip_c"),
        (dict(eps_clip_high=float("inf")), "eps_clip_high"),
        (dict(tis_cap=float("nan")), "tis_cap"),
        (dict(behav_weight_cap=float("nan")), "behav_weight_cap"),
        (dict(aggregation="seq_mean_token_sum", seq_len_norm=float("inf")), "seq_len_norm"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("cu", torch.tensor([0, 2, 6], dtype=torch.int64), "cu_seqlens"),
        ("cu", torch.tensor([1, 2, 6], dtype=torch.int32), "cu_seqlens"),
        ("cu", torch.tensor([0, 4, 5], dtype=torch.int32), "cu_seqlens"),
        ("adv", torch.randn(3), "advantages"),
        ("mask", torch.ones(6), "loss_mask"),
        ("old", torch.randn(5), "old_logprobs"),
    ],
)
def test_bad_tensors_are_named(field, value, match):
    args = dict(
        logp=torch.randn(6),
        old=torch.randn(6),
        adv=torch.randn(2),
        mask=torch.ones(6, dtype=torch.bool),
        cu=torch.tensor([0, 2, 6], dtype=torch.int32),
    )
    args[field] = value
    with pytest.raises(ValueError, match=match):
        grpo_loss(args["logp"], args["old"], args["adv"], args["mask"], args["cu"], LossConfig())
