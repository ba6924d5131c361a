"""Per-token policy-gradient terms of the GRPO family (``LossConfig.surrogate``).

Each function takes the packed per-token tensors, all [T] float (the ratio's log already
masked to 0 outside ``loss_mask``), and returns ``(pg, hit)``: the per-token term pg [T]
(differentiable through ``logprobs`` / ``ratio``) and a bool [T] ``hit`` reported as the
``clip_fraction`` statistic (clipped, or masked out by M2PO). Weights (decoupled PPO, TIS,
IcePop, sequence rejection) multiply pg afterwards (:mod:`areal_fast.rl.corrections`).
"""

from __future__ import annotations

import torch

from areal_fast.rl.config import LossConfig


def clip_term(ratio, advantages, config: LossConfig):
    """PPO clip (Schulman et al. 2017, Eq. 7) with the optional dual clip (Ye et al. 2020, Eq. 5).

    pg = max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high)); for A < 0 and dual_clip_c = c:
    pg ← min(pg, −c·A). hit = −A·clip(r) > −A·r.
    """
    clipped = ratio.clamp(1 - config.eps_clip, 1 + config.clip_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)
    hit = -advantages * clipped > -advantages * ratio
    if config.dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -config.dual_clip_c * advantages), pg)
    return pg, hit


def cispo_term(logprobs, ratio, advantages, config: LossConfig):
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, the CISPO objective): pg = −sg(clip(r, 1 − ε, 1 + ε_h))·A·logp.

    The gradient is −clip(r)·A·∇logp for every token, clipped or not (the clipped weight is a
    constant); hit = r outside [1 − ε, 1 + ε_h]. Same per-token value as verl 0.9's "cispo"
    and, with eps_clip = 1, TRL 1.16's ``loss_type="cispo"``.
    """
    low, high = 1 - config.eps_clip, 1 + config.clip_high
    weight = ratio.detach().clamp(low, high)
    hit = (ratio < low) | (ratio > high)
    return -weight * advantages * logprobs, hit.detach()


def sapo_term(ratio, advantages, config: LossConfig):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a soft gate.

    pg = −A·f_τ(r), f_τ(r) = σ(τ·(r − 1))·4/τ with τ = sapo_tau_pos where A > 0 and
    sapo_tau_neg elsewhere; df/dr = 4σ(1 − σ), 1 at r = 1 (the unclipped gradient there).
    Nothing is clipped: hit is all False.
    """
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(config.sapo_tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(config.sapo_tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    return -advantages * gate, torch.zeros_like(ratio, dtype=torch.bool)


def m2po_keep(behav_log_ratio, loss_mask, threshold: float) -> torch.Tensor:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv:2510.01161).

    Over the trained tokens, sorted by m_t = (log π/π_behav)² in decreasing order (ties by
    position), drop the fewest leading tokens so that the mean of the rest is below
    ``threshold``; all are dropped when no non-empty rest qualifies.

    Parameters
    ----------
    behav_log_ratio : Tensor [T], float
        log π_θ − log π_behav (detached).
    loss_mask : Tensor [T], bool
    threshold : float
        τ_M2 > 0.

    Returns
    -------
    Tensor [T], bool
        True on the kept trained tokens (False outside ``loss_mask``). One device→host
        synchronisation (the number of trained tokens).
    """
    keep = torch.zeros_like(loss_mask)
    positions = loss_mask.nonzero().squeeze(1)
    if positions.numel() == 0:
        return keep
    moments = behav_log_ratio.detach()[positions].double() ** 2
    order = torch.sort(moments, descending=True, stable=True).indices
    ranked = moments[order]
    suffix_sum = ranked.flip(0).cumsum(0).flip(0)
    count = torch.arange(ranked.numel(), 0, -1, device=ranked.device, dtype=ranked.dtype)
    below = suffix_sum / count < threshold
    dropped = int(below.to(torch.int8).argmax()) if bool(below.any()) else ranked.numel()
    keep[positions[order[dropped:]]] = True
    return keep


def m2po_term(ratio, advantages, behav_log_ratio, loss_mask, config: LossConfig):
    """M2PO (Zheng et al. 2025, arXiv:2510.01161): pg = −M·r·A, no clip; hit = the masked-out tokens.

    M is :func:`m2po_keep` on ``behav_log_ratio`` = logp − old (the behaviour policy).
    """
    keep = m2po_keep(behav_log_ratio, loss_mask, config.m2po_threshold)
    pg = torch.where(keep, -advantages * ratio, 0.0)
    return pg, loss_mask & ~keep


def surrogate_term(logprobs, ratio, advantages, loss_mask, config: LossConfig, old_logprobs):
    """``(pg, hit)`` of ``config.surrogate`` (see the functions above)."""
    if config.surrogate == "clip":
        return clip_term(ratio, advantages, config)
    if config.surrogate == "cispo":  # padding may hold -inf: keep it out of the product
        return cispo_term(torch.where(loss_mask, logprobs, 0.0), ratio, advantages, config)
    if config.surrogate == "sapo":
        return sapo_term(ratio, advantages, config)
    behav = torch.where(loss_mask, logprobs.detach() - old_logprobs, 0.0)
    return m2po_term(ratio, advantages, behav, loss_mask, config)
