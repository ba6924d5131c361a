"""References for the loss-family tests, written from each paper's equation (float64, one
token and one sequence at a time), and the packed inputs they run on."""

from __future__ import annotations

import math

import torch

from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss

LENGTHS = [1, 7, 12, 3, 9]
# sampler→trainer log-ratio of each sequence: sequences 1 and 3 sit outside every band and
# rejection bound below, the others inside (plus noise of 0.02)
SHIFTS = [0.0, 0.3, 0.0, -0.3, 0.02]


def inputs(spread=0.3):
    """Packed float64 tensors: per-sequence advantages of both signs, current log-ratios wide
    enough that clips and gates are crossed, sampler→trainer log-ratios δ shifted per
    sequence (``SHIFTS``) so that some sequences are rejected and others kept."""
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    old = -2 * torch.rand(T, dtype=torch.float64) - 0.1
    logp = old + spread * torch.randn(T, dtype=torch.float64)
    shift = torch.repeat_interleave(
        torch.tensor(SHIFTS, dtype=torch.float64), torch.tensor(LENGTHS)
    )
    prox = old + shift + 0.02 * torch.randn(T, dtype=torch.float64)
    engine = old - shift - 0.02 * torch.randn(T, dtype=torch.float64)
    adv = torch.randn(len(LENGTHS), dtype=torch.float64)
    mask = torch.rand(T) > 0.2
    mask[0] = True
    return logp, old, prox, engine, adv, mask, cu


def token_adv(adv, cu):
    return torch.repeat_interleave(adv, (cu[1:] - cu[:-1]).long())


def reference(logp, old, adv, mask, cu, cfg: LossConfig, prox=None, engine=None):
    """Token-mean loss from the papers' formulas, one token and one sequence at a time."""
    A = token_adv(adv, cu)
    base = prox if prox is not None else old
    keep_m2 = m2po_reference(logp.detach() - old, mask, cfg.m2po_threshold)
    seq_weight = _sequence_reference(old, mask, cu, cfg, prox, engine)
    terms = []
    for t in range(logp.shape[0]):
        if not mask[t]:
            continue
        r = torch.exp(logp[t] - base[t])
        if cfg.surrogate == "cispo":  # MiniMax-M1: sg(clip(r))·A·log π, maximised
            clipped = r.detach().clamp(1 - cfg.eps_clip, 1 + cfg.clip_high)
            term = -clipped * A[t] * logp[t]
        elif cfg.surrogate == "sapo":  # SAPO: f(r) = σ(τ(r − 1))·4/τ, maximised f(r)·A
            tau = cfg.sapo_tau_pos if A[t] > 0 else cfg.sapo_tau_neg
            term = -A[t] * torch.sigmoid(tau * (r - 1)) * 4 / tau
        elif cfg.surrogate == "m2po":  # M2PO: M·r·A, maximised
            term = -keep_m2[t] * r * A[t]
        else:
            clipped = r.clamp(1 - cfg.eps_clip, 1 + cfg.clip_high)
            term = torch.maximum(-A[t] * r, -A[t] * clipped)
        terms.append(term * _token_weight(t, old, cfg, prox, engine) * seq_weight[t])
    return torch.stack(terms).sum() / mask.sum()


def _token_weight(t, old, cfg, prox, engine):
    """Decoupled w and the engine ratio k of token t; IcePop (Ring-1T): M(k) = k on
    [α, β], 0 outside, on the sampler→trainer ratio (k with engine log-probs, else w)."""
    on_engine = engine is not None and (cfg.tis_cap is not None or cfg.corrects_sampler)
    w = 1.0 if prox is None else math.exp(float(prox[t] - old[t]))
    k = math.exp(float(old[t] - engine[t])) if on_engine else 1.0
    if cfg.tis_cap is not None and on_engine:
        k = min(k, cfg.tis_cap)
    if cfg.icepop:
        band = lambda x: x if cfg.icepop_low <= x <= cfg.icepop_high else 0.0  # noqa: E731
        k, w = (band(k), w) if on_engine else (k, band(w))
    if cfg.seq_rejection_mode == "clamp" and cfg.seq_rejection is not None:
        return w if on_engine else k  # the source's factor is the sequence weight
    return w * k


def _sequence_reference(old, mask, cu, cfg, prox, engine):
    """Per-token factor of sequence-level rejection: the geometric-mean ratio exp(mean δ) or
    the mean k1/k2/k3 estimate of KL(sampler ‖ trainer), δ = log trainer − log sampler."""
    out = [1.0] * old.shape[0]
    if cfg.seq_rejection is None:
        return out
    for s in range(len(cu) - 1):
        tokens = [t for t in range(int(cu[s]), int(cu[s + 1])) if mask[t]]
        if not tokens:
            continue
        if engine is not None:
            deltas = [float(old[t] - engine[t]) for t in tokens]
        else:
            deltas = [float(prox[t] - old[t]) for t in tokens]
        estimate = {
            "ratio": lambda d: d,
            "k1": lambda d: -d,
            "k2": lambda d: d * d / 2,
            "k3": lambda d: math.expm1(d) - d,
        }[cfg.seq_rejection]
        value = sum(estimate(d) for d in deltas) / len(deltas)
        if cfg.seq_rejection == "ratio":
            value = math.exp(value)
        low = -math.inf if cfg.seq_rejection_low is None else cfg.seq_rejection_low
        if cfg.seq_rejection_mode == "clamp":
            factor = min(max(value, max(low, 0.0)), cfg.seq_rejection_high)
        else:
            factor = 1.0 if low <= value <= cfg.seq_rejection_high else 0.0
        for t in tokens:
            out[t] = factor
    return out


def m2po_reference(log_ratio, mask, threshold):
    """M2PO: drop the tokens of largest (log r)² until the mean of the rest is below τ."""
    trained = [t for t in range(log_ratio.shape[0]) if mask[t]]
    ranked = sorted(trained, key=lambda t: -(float(log_ratio[t]) ** 2))
    keep = [0.0] * log_ratio.shape[0]
    for k in range(len(ranked)):
        rest = [float(log_ratio[t]) ** 2 for t in ranked[k:]]
        if sum(rest) / len(rest) < threshold:
            for t in ranked[k:]:
                keep[t] = 1.0
            break
    return keep


FAMILY = {
    "cispo": LossConfig(surrogate="cispo", eps_clip=0.2, eps_clip_high=0.28),
    "cispo-no-lower-bound": LossConfig(surrogate="cispo", eps_clip=1.0, eps_clip_high=0.5),
    "sapo": LossConfig(surrogate="sapo"),
    "sapo-steep": LossConfig(surrogate="sapo", sapo_tau_pos=3.0, sapo_tau_neg=6.0),
    "m2po": LossConfig(surrogate="m2po", m2po_threshold=0.04),
    "icepop-engine": LossConfig(icepop=True, icepop_low=0.8, icepop_high=1.25),
    "icepop-decoupled": LossConfig(icepop=True, icepop_low=0.8, icepop_high=1.25),
    "geo-mask": LossConfig(seq_rejection="ratio", seq_rejection_low=0.9, seq_rejection_high=1.1),
    "geo-clamp": LossConfig(
        seq_rejection="ratio", seq_rejection_mode="clamp", seq_rejection_high=1.05
    ),
    "k1-mask": LossConfig(seq_rejection="k1", seq_rejection_low=-0.05, seq_rejection_high=0.05),
    "k2-mask": LossConfig(seq_rejection="k2", seq_rejection_high=0.03),
    "k3-mask-cispo": LossConfig(surrogate="cispo", seq_rejection="k3", seq_rejection_high=0.03),
    "sapo-icepop-decoupled": LossConfig(surrogate="sapo", icepop=True, icepop_high=1.3),
    "m2po-geo-mask": LossConfig(
        surrogate="m2po", m2po_threshold=0.02, seq_rejection="ratio", seq_rejection_high=1.1
    ),
}
# which log-probs each case passes: engine log-probs (TRL/verl style) or proximal ones (decoupled)
ENGINE_CASES = {"icepop-engine", "geo-clamp", "k2-mask", "k3-mask-cispo"}


def check_case(name: str, fresh_seed: int) -> None:
    """Values and gradients of ``grpo_loss`` for ``FAMILY[name]`` against :func:`reference`."""
    cfg = FAMILY[name]
    logp, old, prox, engine, adv, mask, cu = inputs()
    extra = {"engine_logprobs": engine} if name in ENGINE_CASES else {"prox_logprobs": prox}
    if cfg.surrogate in ("cispo", "sapo", "m2po") and not cfg.corrects_sampler:
        extra = {}
    got_lp = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(got_lp, old, adv, mask, cu, cfg, **extra)
    loss.backward()
    ref_lp = logp.clone().requires_grad_(True)
    want = reference(
        ref_lp, old, adv, mask, cu, cfg, extra.get("prox_logprobs"), extra.get("engine_logprobs")
    )
    want.backward()
    msg = f"{name}, seed {fresh_seed}"
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12, msg=msg)
    torch.testing.assert_close(got_lp.grad, ref_lp.grad, rtol=1e-12, atol=1e-12, msg=msg)
    assert ref_lp.grad.abs().max() > 0, msg
    if cfg.corrects_sampler:
        assert 0 <= float(stats["rejected_fraction"]) <= 1
