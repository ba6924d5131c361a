"""Per-token weights that correct for the sampler not being the trained policy.

Two ratios can reach the loss, both constants of the gradient:

* decoupled PPO (Fu et al. 2025, AReaL, Eq. 5): w = exp(prox − old), the proximal policy over
  the behaviour policy that generated the tokens (``old`` is the engine's log-prob), capped or
  masked at ``behav_weight_cap``;
* the training–inference mismatch (Yao et al. 2025, TIS): k = exp(old − engine), the trainer's
  log-prob of the behaviour version over the engine's, truncated at ``tis_cap``.

The sampler→trainer log-ratio δ that IcePop and sequence-level rejection act on is the second
when engine log-probs are given (TRL, verl) and the first otherwise (this project's trainer,
whose ``old`` log-probs are the engine's own).
"""

from __future__ import annotations

import torch

from areal_fast.ops.segment import segment_sum
from areal_fast.rl.config import LossConfig


def _ratio(mask, numerator, denominator):
    """exp(numerator − denominator) on ``mask``, 1 elsewhere (padding may hold ±inf)."""
    return torch.exp(torch.where(mask, numerator - denominator, 0.0)).detach()


def _band(weight, low: float, high: float):
    """IcePop's double-sided mask (Ling Team 2025, arXiv:2510.18855): weight if low ≤ weight ≤
    high, else 0; returns (weight, outside)."""
    outside = (weight < low) | (weight > high)
    return torch.where(outside, 0.0, weight), outside


def sequence_measure(delta, loss_mask, cu_seqlens, measure: str):
    """Per-sequence measure [B] of the sampler→trainer log-ratio δ over the trained tokens.

    "ratio": exp(mean δ) (geometric mean of the ratio; Geo-RS / MIS, Liu et al. 2025, "When
    Speed Kills Stability"); "k1": mean(−δ); "k2": mean(δ²/2); "k3": mean(e^δ − 1 − δ) (the KL
    estimators of Schulman 2020 for KL(sampler ‖ trainer) from the sampler's tokens). A sequence
    without trained tokens gets exp(0) = 1 ("ratio") or 0.

    Shapes: delta [T] float, loss_mask [T] bool, cu_seqlens [B+1] int32 → [B] float.
    """
    mask = loss_mask.to(delta.dtype)
    delta = torch.where(loss_mask, delta, 0.0)
    if measure == "ratio":
        values = delta
    elif measure == "k1":
        values = -delta
    elif measure == "k2":
        values = 0.5 * delta**2
    else:
        values = torch.expm1(delta) - delta
    check = cu_seqlens.device.type == "cpu"
    count = segment_sum(mask, cu_seqlens, check_offsets=check).clamp(min=1)
    mean = segment_sum(torch.where(loss_mask, values, 0.0), cu_seqlens, check_offsets=check) / count
    return torch.exp(mean) if measure == "ratio" else mean


def _per_token(per_seq, cu_seqlens, num_tokens):
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(per_seq, seqlens, output_size=num_tokens)


def sampler_weights(
    config: LossConfig,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    prox_logprobs: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """The detached weight [T] that multiplies each token's policy-gradient term, and the bool
    [T] of tokens IcePop or sequence rejection set to 0.

    Composition: decoupled w (prox given) × mismatch k (engine given and tis_cap, icepop or
    seq_rejection_mode="clamp"); ``icepop`` bands the δ source's factor (k with engine
    log-probs, else w); ``seq_rejection_mode="clamp"`` replaces it by the clamped per-sequence
    geometric mean; ``seq_rejection_mode="mask"`` zeroes the rejected sequences.

    Parameters
    ----------
    config : LossConfig
    loss_mask : Tensor [T], bool
    old_logprobs : Tensor [T], float
    prox_logprobs, engine_logprobs : Tensor [T], float, optional
    cu_seqlens : Tensor [B+1], int32
        Needed with ``seq_rejection``.

    Returns
    -------
    weight : Tensor [T] float or None
        None when no factor applies.
    rejected : Tensor [T] bool or None
        None unless icepop or seq_rejection is on.

    Raises
    ------
    ValueError
        icepop / seq_rejection with neither engine nor proximal log-probs (no δ).
    """
    on_engine = engine_logprobs is not None and (
        config.tis_cap is not None or config.corrects_sampler
    )
    if config.corrects_sampler and not on_engine and prox_logprobs is None:
        option = "icepop" if config.icepop else "seq_rejection"
        raise ValueError(
            f"config.{option} needs engine_logprobs or prox_logprobs (the sampler→trainer ratio)"
        )
    mask = loss_mask
    w, k = _capped_factors(config, mask, old_logprobs, prox_logprobs, engine_logprobs, on_engine)
    if not config.corrects_sampler:
        return _product(w, k), None
    rejected = torch.zeros_like(mask)
    if config.icepop:  # the δ source's factor: k with engine log-probs, else w
        banded, outside = _band(k if on_engine else w, config.icepop_low, config.icepop_high)
        k, w = (banded, w) if on_engine else (k, banded)
        rejected |= outside & mask
    if config.seq_rejection is not None:
        delta = (
            torch.where(mask, old_logprobs - engine_logprobs, 0.0)
            if on_engine
            else torch.where(mask, prox_logprobs - old_logprobs, 0.0)
        ).detach()
        per_token = _per_token(
            sequence_measure(delta, mask, cu_seqlens, config.seq_rejection),
            cu_seqlens,
            mask.shape[0],
        )
        low = -torch.inf if config.seq_rejection_low is None else config.seq_rejection_low
        if config.seq_rejection_mode == "clamp":
            clamped = per_token.clamp(min=max(low, 0.0), max=config.seq_rejection_high)
            k, w = (clamped, w) if on_engine else (k, clamped)
        else:
            rejected |= ((per_token < low) | (per_token > config.seq_rejection_high)) & mask
    weight = _product(w, k)
    if config.seq_rejection is not None and config.seq_rejection_mode == "mask":
        keep = (~rejected).to(old_logprobs.dtype)
        weight = keep if weight is None else torch.where(rejected, 0.0, weight)
    return weight, rejected


def _capped_factors(config: LossConfig, mask, old, prox, engine, on_engine: bool):
    """(w, k): the decoupled weight exp(prox − old) capped as ``behav_weight_cap`` says (None
    without prox) and the engine weight exp(old − engine) truncated at ``tis_cap`` (None
    unless ``on_engine``)."""
    w = None if prox is None else _ratio(mask, prox, old)
    if w is not None and config.behav_weight_cap is not None:
        cap = config.behav_weight_cap
        w = torch.where(w > cap, 0.0, w) if config.behav_weight_mode == "mask" else w.clamp(max=cap)
    k = _ratio(mask, old, engine) if on_engine else None
    if k is not None and config.tis_cap is not None:
        k = k.clamp(max=config.tis_cap)
    return w, k


def _product(*factors):
    """The product of the factors that are not None (None when all are)."""
    out = None
    for factor in factors:
        if factor is not None:
            out = factor if out is None else out * factor
    return out
