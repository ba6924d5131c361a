"""Triton kernel of the packed per-token GRPO-family loss (token-level ratios): the weighted
per-token loss, its gradient w.r.t. the log-probs and the entropy, and the clip indicator,
forward and backward in one elementwise launch.

With token-level ratios every per-token loss ℓ_t depends on token t alone and the aggregation
is a fixed weighted sum Σ_t c_t ℓ_t (:func:`areal_fast.rl.objectives.aggregation_weights`),
so one program per tile of ``BLOCK`` tokens forms ℓ_t and dℓ_t/dlogp_t in registers and writes
``c_t·ℓ_t``, ``c_t·dℓ_t/dlogp_t`` and ``c_t·dℓ_t/dentropy_t``. The semantics are those of
:func:`areal_fast.rl.objectives.token_terms` with ``ratio_level="token"`` and every token
trained (the caller has already dropped the masked-out ones):

* base = prox if given else old, r = exp(logp − base), clip(r) = min(max(r, 1 − ε), 1 + ε_h);
* surrogate "clip": pg = max(−A·r, −A·clip(r)) (PPO, Schulman et al. 2017, Eq. 7),
  clip_hit = −A·clip(r) > −A·r; dual clip (Ye et al. 2020, Eq. 5): pg ← min(pg, −c·A) where
  A < 0;
* surrogate "cispo" (MiniMax-M1, arXiv:2506.13585): pg = −clip(r)·A·logp, clip(r) constant,
  so dpg/dlogp = −clip(r)·A; clip_hit = r outside the range;
* surrogate "sapo" (Gao et al. 2025, arXiv:2511.20347): pg = −A·σ(τ(r − 1))·4/τ, τ = τ₊ for
  A > 0 else τ₋, dpg/dlogp = −A·4σ(1 − σ)·r; clip_hit all False;
* decoupled PPO (Fu et al. 2025, AReaL, Eq. 5): pg ← w·pg, w = exp(prox − old) (constant),
  set to 0 above the cap (mode "mask") or clamped to it (mode "clamp");
* truncated importance sampling: pg ← min(exp(old − engine), tis_cap)·pg (constant);
* IcePop (arXiv:2510.18855): the weight of the sampler→trainer ratio (the engine's with engine
  log-probs, else w) is set to 0 outside [icepop_low, icepop_high] instead of capped;
* ℓ = pg + kl_coef·KL_est(logp, ref) − entropy_coef·entropy, KL_est from Schulman (2020):
  k1 = x, k2 = x²/2, k3 = exp(−x) − 1 + x with x = logp − ref (ref constant).

Gradient of the "clip" surrogate (by hand; dr/dlogp = r, and w, tis, ref are constants)::

    dℓ/dlogp = w·tis·s_dual·(−A)·r·(s_a + (1 − s_a)·[1 − ε ≤ r ≤ 1 + ε_h]) + kl_coef·dKL/dlogp
    dKL/dlogp = 1 (k1), x (k2), 1 − exp(−x) (k3);   dℓ/dentropy = −entropy_coef

The subgradients are those torch autograd takes on ``token_terms``: ``clamp`` passes the
gradient on the closed interval [1 − ε, 1 + ε_h] (so the clipped branch carries a zero
gradient outside it), and ``torch.maximum`` / ``torch.minimum`` split it half/half on exact
ties. Hence s_a = 1 if −A·r > −A·clip(r), ½ on a tie, 0 otherwise, and s_dual = 1 if A ≥ 0
or pg < −c·A, ½ on a tie, 0 otherwise. On a clip bound (r = 1 − ε or 1 + ε_h exactly) the two
branches tie and both pass the gradient, which gives the unclipped gradient −A·r; a tie
outside the bounds (−A·r and −A·clip(r) rounding to the same float) passes half of it; when
A = 0 the tie gives exactly 0.

Numerics (fp32): the k3 value e^u − 1 − u and its gradient −(e^u − 1), u = −x, are formed
from a Taylor series for |u| < 1 (truncation < 2e-10 relative), so small log-ratios keep
their relative accuracy instead of cancelling to a few ulps of 1. Only ``tl.exp`` and plain
arithmetic are used (no libdevice), which the Triton interpreter and every recent Triton
version support.

One documented difference from ``token_terms``: with ``kl_coef == 0`` the KL term is left out
altogether (``token_terms`` adds 0·KL, which differs only when the estimate is ±inf/NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["token_loss_grads", "TokenLossGrads"]

_MAX_BLOCK = 1024
_KL_CODES = {"k1": 0, "k2": 1, "k3": 2}
_CAP_CODES = {"mask": 1, "clamp": 2}
_SURROGATE_CODES = {"clip": 0, "cispo": 1, "sapo": 2}


@triton.jit
def _exp_tail2(x):
    """e^x − 1 − x, relatively accurate for small |x| (the k3 estimator's value).

    Σ_{n=2..12} xⁿ/n! below |x| < 1 (truncation < 2e-10 relative), ``(e^x − 1) − x`` above.
    """
    small = tl.abs(x) < 1.0
    s = tl.where(small, x, 0.0)
    poly = 1.0 / 479001600.0
    poly = 1.0 / 39916800.0 + s * poly
    poly = 1.0 / 3628800.0 + s * poly
    poly = 1.0 / 362880.0 + s * poly
    poly = 1.0 / 40320.0 + s * poly
    poly = 1.0 / 5040.0 + s * poly
    poly = 1.0 / 720.0 + s * poly
    poly = 1.0 / 120.0 + s * poly
    poly = 1.0 / 24.0 + s * poly
    poly = 1.0 / 6.0 + s * poly
    poly = 0.5 + s * poly
    direct = (tl.exp(tl.where(small, 0.0, x)) - 1.0) - x
    return tl.where(small, s * s * poly, direct)


@triton.jit
def _expm1(x):
    """e^x − 1, relatively accurate for small |x| whatever ``tl.exp`` is.

    ``x + (e^x − 1 − x)`` from :func:`_exp_tail2` below |x| < 1, ``e^x − 1`` above.
    """
    small = tl.abs(x) < 1.0
    return tl.where(small, x + _exp_tail2(tl.where(small, x, 0.0)), tl.exp(x) - 1.0)


@triton.jit
def _clip_term(ratio, adv, clip_low, clip_high, neg_dual_c, HAS_DUAL: tl.constexpr):
    """PPO clip with the dual clip: (pg, d pg / d logp, clip hit), torch's subgradients."""
    clipped = tl.minimum(tl.maximum(ratio, clip_low), clip_high)
    neg_adv = -adv
    a = neg_adv * ratio
    b = neg_adv * clipped
    pg = tl.where(a >= b, a, b)
    # torch.maximum's subgradient: all to a when a > b, half each on a tie, all to b else;
    # b's share reaches r only where clamp passes it (closed interval).
    share_a = tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))
    in_range = ((ratio >= clip_low) & (ratio <= clip_high)).to(tl.float32)
    grad = neg_adv * ratio * (share_a + (1.0 - share_a) * in_range)  # d pg / d logp
    if HAS_DUAL:  # pg ← min(pg, −c·A) where A < 0, torch.minimum's tie split
        cap = neg_dual_c * adv
        negative = adv < 0.0
        share_pg = tl.where(pg < cap, 1.0, tl.where(pg == cap, 0.5, 0.0))
        grad = tl.where(negative, grad * share_pg, grad)
        pg = tl.where(negative, tl.minimum(pg, cap), pg)
    return pg, grad, b > a


@triton.jit
def _grpo_token_loss_kernel(
    logprobs_ptr,
    old_ptr,
    adv_ptr,
    weights_ptr,
    prox_ptr,
    ref_ptr,
    engine_ptr,
    entropy_ptr,
    loss_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    clip_hit_ptr,
    n_tokens,
    clip_low,
    clip_high,
    neg_dual_c,
    behav_cap,
    tis_cap,
    kl_coef,
    entropy_coef,
    tau_pos,
    tau_neg,
    band_low,
    band_high,
    SURROGATE: tl.constexpr,
    HAS_PROX: tl.constexpr,
    CAP_MODE: tl.constexpr,
    TIS_MODE: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_EST: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    STORE_LOSS: tl.constexpr,
    STORE_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_tokens
    # Tail lanes load zeros: every expression below stays finite on them.
    logp = tl.load(logprobs_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    c = tl.load(weights_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_PROX:
        prox = tl.load(prox_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        base = prox
    else:
        base = old

    ratio = tl.exp(logp - base)
    if SURROGATE == 0:
        pg, grad, hit = _clip_term(ratio, adv, clip_low, clip_high, neg_dual_c, HAS_DUAL)
    elif SURROGATE == 1:  # CISPO: −sg(clip(r))·A·logp
        clipped = tl.minimum(tl.maximum(ratio, clip_low), clip_high)
        pg = -clipped * adv * logp
        grad = -clipped * adv
        hit = (ratio < clip_low) | (ratio > clip_high)
    else:  # SAPO: −A·σ(τ(r − 1))·4/τ, τ by the sign of A
        tau = tl.where(adv > 0.0, tau_pos, tau_neg)
        gate = 1.0 / (1.0 + tl.exp(-tau * (ratio - 1.0)))
        pg = -adv * gate * (4.0 / tau)
        grad = -adv * (4.0 * gate * (1.0 - gate)) * ratio
        hit = ratio != ratio  # nothing is clipped (all False)
    if HAS_PROX:  # decoupled PPO behaviour weight (a constant)
        w = tl.exp(prox - old)
        if CAP_MODE == 1:
            w = tl.where(w > behav_cap, 0.0, w)
        if CAP_MODE == 2:
            w = tl.minimum(w, behav_cap)
        if CAP_MODE == 3:  # IcePop's band
            w = tl.where((w < band_low) | (w > band_high), 0.0, w)
        pg = w * pg
        grad = w * grad
    if TIS_MODE > 0:  # trainer/engine weight (a constant): truncated, or IcePop's band
        engine = tl.load(engine_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tis = tl.exp(old - engine)
        if TIS_MODE == 1:
            tis = tl.minimum(tis, tis_cap)
        else:
            tis = tl.where((tis < band_low) | (tis > band_high), 0.0, tis)
        pg = tis * pg
        grad = tis * grad

    loss = pg
    if HAS_KL:
        ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = logp - ref
        if KL_EST == 0:
            kl = x
            d_kl = tl.full(x.shape, 1.0, tl.float32)
        elif KL_EST == 1:
            kl = 0.5 * x * x
            d_kl = x
        else:
            kl = _exp_tail2(-x)  # e^{−x} − 1 + x
            d_kl = -_expm1(-x)  # 1 − e^{−x}
        loss = loss + kl_coef * kl
        grad = grad + kl_coef * d_kl
    if HAS_ENTROPY:
        ent = tl.load(entropy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        loss = loss - entropy_coef * ent
        tl.store(grad_ent_ptr + offs, c * -entropy_coef, mask=inside)

    tl.store(grad_lp_ptr + offs, c * grad, mask=inside)
    if STORE_LOSS:
        tl.store(loss_ptr + offs, c * loss, mask=inside)
    if STORE_CLIP:
        tl.store(clip_hit_ptr + offs, hit.to(clip_hit_ptr.dtype.element_ty), mask=inside)


class TokenLossGrads(NamedTuple):
    """Outputs of :func:`token_loss_grads`, each [C] on the inputs' device."""

    loss: torch.Tensor | None
    grad_logprobs: torch.Tensor
    grad_entropy: torch.Tensor | None
    clip_hit: torch.Tensor | None


def _check_vec(t: torch.Tensor, rows: int, device: torch.device, name: str) -> torch.Tensor:
    if t.shape != (rows,) or not t.is_floating_point() or t.device != device:
        raise ValueError(
            f"{name} must be a floating [C={rows}] tensor on {device}, got "
            f"{tuple(t.shape)} {t.dtype} on {t.device}"
        )
    return t.detach().contiguous()


def token_loss_grads(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config,
    *,
    prox_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    with_loss: bool = True,
    clip_hit_dtype: torch.dtype | None = torch.int8,
    block: int | None = None,
    num_warps: int | None = None,
) -> TokenLossGrads:
    """Weighted per-token GRPO-family loss and its gradients, forward and backward at once.

    For each of the C tokens (all trained), with ℓ_t the per-token loss of
    :func:`areal_fast.rl.objectives.token_terms` (``ratio_level="token"``; see the module
    docstring for the formulas and the subgradient conventions), writes::

        loss[t]          = c_t · ℓ_t
        grad_logprobs[t] = c_t · dℓ_t / dlogprobs_t
        grad_entropy[t]  = c_t · dℓ_t / dentropy_t = −c_t · entropy_coef   (entropy given)
        clip_hit[t]      = −A_t·clip(r_t) > −A_t·r_t

    so that Σ_t loss[t] is the aggregated loss when ``weights`` are the aggregation weights.

    Parameters
    ----------
    logprobs : Tensor [C], float
        Current-policy log-probs (read as fp32; the gradient is taken w.r.t. them).
    old_logprobs : Tensor [C], float
        Behaviour log-probs.
    advantages : Tensor [C], float
        Per-token advantages A_t.
    weights : Tensor [C], float
        Aggregation weights c_t (``aggregation_weights`` on the kept tokens).
    config : LossConfig
        Per-token losses only (``config.couples_tokens`` False: token-level ratios, no M2PO,
        no seq_rejection). Uses eps_clip, clip_high, dual_clip_c, surrogate ("clip",
        "cispo", "sapo" with sapo_tau_pos/neg), behav_weight_cap/behav_weight_mode, tis_cap,
        icepop (icepop_low/high), kl_coef/kl_estimator, entropy_coef.
    prox_logprobs : Tensor [C], optional
        Proximal-policy log-probs: the ratio's base and w = exp(prox − old) (decoupled PPO).
    ref_logprobs : Tensor [C], optional
        Reference-policy log-probs of the KL term (left out when ``kl_coef == 0``).
    engine_logprobs : Tensor [C], optional
        Inference-engine log-probs; the TIS factor applies when ``config.tis_cap`` is set,
        IcePop's band when ``config.icepop`` is.
    entropy : Tensor [C], optional
        Current-policy entropy; gives the ``−entropy_coef·entropy`` term and ``grad_entropy``.
    with_loss : bool
        Also write ``loss`` (else it is None).
    clip_hit_dtype : torch.dtype or None
        dtype of ``clip_hit`` (e.g. int8 or float32); None skips it.
    block : int, optional
        Tokens per program (power of two); default ``min(next_pow2(C), 1024)``.
    num_warps : int, optional
        Warps per program; default 4.

    Returns
    -------
    TokenLossGrads
        ``loss`` [C] float32 or None, ``grad_logprobs`` [C] float32, ``grad_entropy`` [C]
        float32 (None without ``entropy``), ``clip_hit`` [C] ``clip_hit_dtype`` or None.

    Raises
    ------
    ValueError
        Coupled tokens (see ``config``), a tensor of the wrong shape/dtype/device (named), a
        missing ``ref_logprobs`` while ``kl_coef > 0``, icepop with neither engine nor
        proximal log-probs, or a bad ``block``.
    """
    if config.couples_tokens:
        raise ValueError(
            "token_loss_grads needs per-token losses: ratio_level='token', surrogate other "
            f"than 'm2po', no seq_rejection (got {config.ratio_level!r}, "
            f"{config.surrogate!r}, {config.seq_rejection!r})"
        )
    if logprobs.dim() != 1 or not logprobs.is_floating_point():
        raise ValueError(
            f"logprobs must be a floating [C] tensor, got {tuple(logprobs.shape)} {logprobs.dtype}"
        )
    rows, device = logprobs.shape[0], logprobs.device
    logprobs = logprobs.detach().contiguous()
    old = _check_vec(old_logprobs, rows, device, "old_logprobs")
    adv = _check_vec(advantages, rows, device, "advantages")
    weights = _check_vec(weights, rows, device, "weights")
    opt = {}
    for name, t in (
        ("prox_logprobs", prox_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("engine_logprobs", engine_logprobs),
        ("entropy", entropy),
    ):
        opt[name] = None if t is None else _check_vec(t, rows, device, name)
    if config.kl_coef > 0 and opt["ref_logprobs"] is None:
        raise ValueError("config.kl_coef > 0 needs ref_logprobs")
    if block is None:
        block = min(triton.next_power_of_2(max(rows, 1)), _MAX_BLOCK)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")

    f32 = dict(dtype=torch.float32, device=device)
    grad_lp = torch.empty(rows, **f32)
    has_entropy = opt["entropy"] is not None
    grad_ent = torch.empty(rows, **f32) if has_entropy else None
    loss = torch.empty(rows, **f32) if with_loss else None
    clip_hit = (
        None if clip_hit_dtype is None else torch.empty(rows, dtype=clip_hit_dtype, device=device)
    )
    if rows == 0:
        return TokenLossGrads(loss, grad_lp, grad_ent, clip_hit)

    has_prox = opt["prox_logprobs"] is not None
    on_engine = opt["engine_logprobs"] is not None and (config.tis_cap is not None or config.icepop)
    if config.icepop and not (on_engine or has_prox):
        raise ValueError("config.icepop needs engine_logprobs or prox_logprobs")
    tis_mode = (2 if config.icepop else 1) if on_engine else 0
    has_kl = opt["ref_logprobs"] is not None and config.kl_coef != 0
    cap_mode = 0
    if has_prox and config.icepop and not on_engine:
        cap_mode = 3
    elif has_prox and config.behav_weight_cap is not None:
        cap_mode = _CAP_CODES[config.behav_weight_mode]
    has_dual = config.dual_clip_c is not None
    # Absent tensors get a stand-in pointer that the disabled branches never dereference.
    stand_in = grad_lp
    _grpo_token_loss_kernel[(triton.cdiv(rows, block),)](
        logprobs,
        old,
        adv,
        weights,
        opt["prox_logprobs"] if has_prox else stand_in,
        opt["ref_logprobs"] if has_kl else stand_in,
        opt["engine_logprobs"] if on_engine else stand_in,
        opt["entropy"] if has_entropy else stand_in,
        loss if with_loss else stand_in,
        grad_lp,
        grad_ent if has_entropy else stand_in,
        clip_hit if clip_hit is not None else stand_in,
        rows,
        float(1.0 - config.eps_clip),
        float(1.0 + config.clip_high),
        float(-config.dual_clip_c) if has_dual else 0.0,
        float(config.behav_weight_cap) if cap_mode in (1, 2) else 0.0,
        float(config.tis_cap) if tis_mode == 1 else 0.0,
        float(config.kl_coef),
        float(config.entropy_coef),
        float(config.sapo_tau_pos),
        float(config.sapo_tau_neg),
        float(config.icepop_low),
        float(config.icepop_high),
        SURROGATE=_SURROGATE_CODES[config.surrogate],
        HAS_PROX=has_prox,
        CAP_MODE=cap_mode,
        TIS_MODE=tis_mode,
        HAS_DUAL=has_dual,
        HAS_KL=has_kl,
        KL_EST=_KL_CODES[config.kl_estimator],
        HAS_ENTROPY=has_entropy,
        STORE_LOSS=with_loss,
        STORE_CLIP=clip_hit is not None,
        BLOCK=block,
        num_warps=4 if num_warps is None else num_warps,
    )
    return TokenLossGrads(loss, grad_lp, grad_ent, clip_hit)
