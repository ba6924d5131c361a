"""GRPO-family policy objectives on packed sequences (torch reference implementation)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from areal_fast.ops.segment import segment_sum
from areal_fast.rl.config import LossConfig
from areal_fast.rl.corrections import sampler_weights
from areal_fast.rl.surrogates import surrogate_term


def _segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """:func:`areal_fast.ops.segment.segment_sum`, its offset checks on CPU tensors only
    (on GPUs they are a device→host synchronisation; offsets are checked on entry)."""
    return segment_sum(values, cu_seqlens, check_offsets=cu_seqlens.device.type == "cpu")


def _check_packed(name: str, tensor: torch.Tensor | None, num_tokens: int) -> None:
    if tensor is not None and tensor.shape != (num_tokens,):
        raise ValueError(f"{name} must be [T={num_tokens}], got {tuple(tensor.shape)}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 [B+1] tensor, got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device.type != "cpu":
        return  # the value checks would be a device→host synchronisation
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at T={num_tokens}, got "
            f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def check_loss_inputs(
    num_tokens: int,
    old_logprobs,
    loss_mask,
    cu_seqlens,
    config,
    *,
    prox_logprobs=None,
    ref_logprobs=None,
    engine_logprobs=None,
    entropy=None,
    entropy_needed=False,
) -> None:
    """Shape/dtype checks shared by the loss entry points (ValueError naming the tensor)."""
    _check_cu_seqlens(cu_seqlens, num_tokens)
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("loss_mask", loss_mask),
        ("prox_logprobs", prox_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("engine_logprobs", engine_logprobs),
    ):
        _check_packed(name, tensor, num_tokens)
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool, got {loss_mask.dtype}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("config.kl_coef > 0 needs ref_logprobs")
    if entropy_needed and entropy is None:
        raise ValueError("config.entropy_coef > 0 needs entropy")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str):
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman 2020).

    k1 = logp − ref; k2 = ½ (logp − ref)²; k3 = exp(ref − logp) − (ref − logp) − 1.
    Shapes: [T] in, [T] out; float32.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator = {estimator!r} is not one of ('k1', 'k2', 'k3')")


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: LossConfig,
    *,
    prox_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
):
    """Clipped policy-gradient loss of the GRPO family on packed sequences.

    With base = prox_logprobs if given else old_logprobs and r = exp(logprobs − base)
    (GSPO, ratio_level="sequence": r = exp(masked mean over the sequence of logprobs − base)):
    pg = max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high)) (PPO, Schulman et al. 2017,
    Eq. 7); dual clip for A < 0: pg = min(pg, −c·A) (Ye et al. 2020); decoupled PPO (AReaL,
    Fu et al. 2025, Eq. 5): pg ← w·pg, w = exp(prox − old) detached, masked or clamped at
    behav_weight_cap; TIS: pg ← min(exp(old − engine), tis_cap)·pg. ``config.surrogate``
    replaces the clipped term by CISPO, SAPO or M2PO (:mod:`areal_fast.rl.surrogates`);
    IcePop and sequence-level rejection reshape the weights
    (:mod:`areal_fast.rl.corrections`). Per-token loss
    ℓ = pg + kl_coef·KL_est(logprobs, ref) − entropy_coef·entropy, aggregated over
    loss_mask as config.aggregation says.

    Parameters
    ----------
    logprobs : Tensor [T], float32
        Current-policy log-probs of the packed tokens (differentiable).
    old_logprobs : Tensor [T], float32
        Behaviour log-probs (the policy that generated the tokens).
    advantages : Tensor [T] or [B], float32
        Per token, or per sequence (broadcast through ``cu_seqlens``).
    loss_mask : Tensor [T], bool
        True on tokens that are trained on.
    cu_seqlens : Tensor [B+1], int32
        Sequence boundaries, starting at 0 and ending at T (values checked for CPU tensors
        only: on GPUs the check would be a device→host synchronisation).
    config : LossConfig
    prox_logprobs, ref_logprobs, entropy, engine_logprobs : Tensor [T], optional
        Proximal-policy log-probs (decoupled PPO), reference-policy log-probs (KL), entropy
        of the current policy (entropy bonus, differentiable), inference-engine log-probs
        (TIS, IcePop, sequence rejection).

    Returns
    -------
    loss : Tensor [], float32
        Differentiable scalar; 0 (with an intact graph) when no token is masked in.
    stats : dict[str, Tensor]
        ``clip_fraction``, ``ratio_mean``, ``approx_kl`` (k3 of logprobs vs base),
        ``entropy_mean`` (when entropy is given), ``kl`` (when ref_logprobs is given),
        ``rejected_fraction`` (IcePop / sequence rejection), ``num_tokens``; scalar tensors,
        no host synchronisation (M2PO's mask takes one).

    Raises
    ------
    ValueError
        A tensor of the wrong shape or dtype (named), or a missing tensor the config needs
        (icepop / seq_rejection without engine or proximal log-probs).
    """
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be [T], got shape {tuple(logprobs.shape)}")
    num_tokens = logprobs.shape[0]
    check_loss_inputs(
        num_tokens,
        old_logprobs,
        loss_mask,
        cu_seqlens,
        config,
        prox_logprobs=prox_logprobs,
        ref_logprobs=ref_logprobs,
        engine_logprobs=engine_logprobs,
        entropy=entropy,
        entropy_needed=config.entropy_coef > 0,
    )

    advantages = per_token_advantages(advantages, cu_seqlens, num_tokens)
    terms = token_terms(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        config,
        cu_seqlens=cu_seqlens,
        prox_logprobs=prox_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        engine_logprobs=engine_logprobs,
    )
    mask = loss_mask.to(logprobs.dtype)
    loss = _aggregate(terms.per_token, mask, cu_seqlens, config)
    return loss, terms.stats(mask)


def per_token_advantages(
    advantages: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Advantages as [T]: returned as is when [T], broadcast through cu_seqlens when [B].

    Raises
    ------
    ValueError
        ``advantages`` is neither [T] nor [B].
    """
    num_seqs = cu_seqlens.numel() - 1
    if advantages.shape == (num_seqs,) and num_seqs != num_tokens:
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        return torch.repeat_interleave(advantages, seqlens, output_size=num_tokens)
    if advantages.shape != (num_tokens,):
        raise ValueError(
            f"advantages must be [T={num_tokens}] or [B={num_seqs}], got {tuple(advantages.shape)}"
        )
    return advantages


class TokenTerms(NamedTuple):
    """Per-token pieces of the GRPO-family loss, all [T] (see :func:`token_terms`)."""

    per_token: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    clip_hit: torch.Tensor
    kl: torch.Tensor | None
    entropy: torch.Tensor | None
    rejected: torch.Tensor | None = None

    def stats(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Masked-mean statistics (tensors; no host synchronisation)."""
        stats = {}
        if self.kl is not None:
            stats["kl"] = _masked_mean(self.kl.detach(), mask)
        if self.entropy is not None:
            stats["entropy_mean"] = _masked_mean(self.entropy.detach(), mask)
        with torch.no_grad():
            stats["clip_fraction"] = _masked_mean(self.clip_hit.to(mask.dtype), mask)
            stats["ratio_mean"] = _masked_mean(self.ratio, mask)
            stats["approx_kl"] = _masked_mean(kl_estimate(self.log_ratio, 0.0, "k3"), mask)
            stats["num_tokens"] = mask.sum()
            if self.rejected is not None:
                stats["rejected_fraction"] = _masked_mean(self.rejected.to(mask.dtype), mask)
        return stats


def token_terms(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    config: LossConfig,
    *,
    cu_seqlens=None,
    prox_logprobs=None,
    ref_logprobs=None,
    entropy=None,
    engine_logprobs=None,
) -> TokenTerms:
    """The per-token loss ℓ [T] of :func:`grpo_loss` before aggregation, and its pieces.

    ``advantages`` is per token [T]. ``cu_seqlens`` is needed only for
    ``ratio_level="sequence"`` and ``seq_rejection``; without those and M2PO
    (``config.couples_tokens``) every ℓ_t depends on token t alone, which is what lets the
    fused loss process tokens chunk by chunk.
    """
    base = (prox_logprobs if prox_logprobs is not None else old_logprobs).detach()
    # masked-out positions (padding) may hold anything, even -inf: keep them out of exp()
    log_ratio = torch.where(loss_mask, logprobs - base, 0.0)
    if config.ratio_level == "sequence":
        mask = loss_mask.to(logprobs.dtype)
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq_tokens = _segment_sum(mask, cu_seqlens).clamp(min=1)
        seq_log_ratio = _segment_sum(log_ratio, cu_seqlens) / seq_tokens
        log_ratio = torch.repeat_interleave(seq_log_ratio, seqlens, output_size=logprobs.shape[0])
    ratio = torch.exp(log_ratio)
    pg, clip_hit = surrogate_term(logprobs, ratio, advantages, loss_mask, config, old_logprobs)
    weight, rejected = sampler_weights(
        config,
        loss_mask,
        old_logprobs,
        prox_logprobs=prox_logprobs,
        engine_logprobs=engine_logprobs,
        cu_seqlens=cu_seqlens,
    )
    if weight is not None:
        pg = weight * pg
    per_token, kl = pg, None
    if ref_logprobs is not None:
        kl = kl_estimate(
            logprobs, torch.where(loss_mask, ref_logprobs, logprobs).detach(), config.kl_estimator
        )
        per_token = per_token + config.kl_coef * kl
    if entropy is not None:
        per_token = per_token - config.entropy_coef * entropy
    return TokenTerms(per_token, ratio, log_ratio, clip_hit, kl, entropy, rejected)


def aggregation_weights(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: LossConfig,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights c [T] (``dtype``) with Σ_t c_t ℓ_t equal to the aggregated loss.

    token_mean: m_t / Σm; token_sum: m_t; seq_mean_token_sum: m_t / (B · seq_len_norm);
    seq_mean_token_mean: m_t / (n_s · number of sequences with any masked token).
    """
    mask = loss_mask.to(dtype)
    if config.aggregation == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if config.aggregation == "token_sum":
        return mask
    num_seqs = cu_seqlens.numel() - 1
    if config.aggregation == "seq_mean_token_sum":
        return mask / (max(num_seqs, 1) * config.seq_len_norm)
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_tokens = _segment_sum(mask, cu_seqlens)
    seqs_with_tokens = (seq_tokens > 0).sum().clamp(min=1)
    per_seq = 1.0 / (seq_tokens.clamp(min=1) * seqs_with_tokens)
    return mask * torch.repeat_interleave(per_seq, seqlens, output_size=mask.shape[0])


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, values, 0.0).sum() / mask.sum().clamp(min=1)


def _aggregate(per_token, mask, cu_seqlens, config: LossConfig) -> torch.Tensor:
    """Reduce the per-token loss [T] to a scalar as ``config.aggregation`` says."""
    masked = torch.where(mask > 0, per_token, 0.0)
    if config.aggregation == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if config.aggregation == "token_sum":
        return masked.sum()
    seq_loss = _segment_sum(masked, cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    if config.aggregation == "seq_mean_token_sum":
        return seq_loss.sum() / (max(num_seqs, 1) * config.seq_len_norm)
    seq_tokens = _segment_sum(mask, cu_seqlens)
    has_tokens = seq_tokens > 0
    per_seq = torch.where(has_tokens, seq_loss / seq_tokens.clamp(min=1), 0.0)
    return per_seq.sum() / has_tokens.sum().clamp(min=1)
