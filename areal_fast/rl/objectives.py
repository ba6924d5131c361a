"""GRPO-family policy objectives on packed sequences (torch reference implementation)."""

from __future__ import annotations

import torch

from areal_fast.ops.segment import segment_sum
from areal_fast.rl.config import LossConfig


def _check_packed(name: str, tensor: torch.Tensor | None, num_tokens: int) -> None:
    if tensor is not None and tensor.shape != (num_tokens,):
        raise ValueError(f"{name} must be [T={num_tokens}], got {tuple(tensor.shape)}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 [B+1] tensor, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={num_tokens}, got "
                         f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


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


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, config: LossConfig, *,
              prox_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None,
              engine_logprobs: torch.Tensor | None = None):
    """Clipped policy-gradient loss of the GRPO family on packed sequences.

    With base = prox_logprobs if given else old_logprobs and r = exp(logprobs − base)
    (GSPO, ratio_level="sequence": r = exp(masked mean over the sequence of logprobs − base)):
    pg = max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high)) (PPO, Schulman et al. 2017,
    Eq. 7); dual clip for A < 0: pg = min(pg, −c·A) (Ye et al. 2020); decoupled PPO (AReaL,
    Fu et al. 2025, Eq. 5): pg ← w·pg, w = exp(prox − old) detached, masked or clamped at
    behav_weight_cap; TIS: pg ← min(exp(old − engine), tis_cap)·pg. Per-token loss
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
        Sequence boundaries, starting at 0 and ending at T.
    config : LossConfig
    prox_logprobs, ref_logprobs, entropy, engine_logprobs : Tensor [T], optional
        Proximal-policy log-probs (decoupled PPO), reference-policy log-probs (KL), entropy
        of the current policy (entropy bonus, differentiable), inference-engine log-probs (TIS).

    Returns
    -------
    loss : Tensor [], float32
        Differentiable scalar; 0 (with an intact graph) when no token is masked in.
    stats : dict[str, Tensor]
        ``clip_fraction``, ``ratio_mean``, ``approx_kl`` (k3 of logprobs vs base),
        ``entropy_mean`` (when entropy is given), ``kl`` (when ref_logprobs is given),
        ``num_tokens``; scalar tensors, no host synchronisation.

    Raises
    ------
    ValueError
        A tensor of the wrong shape or dtype (named), or a missing tensor the config needs.
    """
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be [T], got shape {tuple(logprobs.shape)}")
    num_tokens = logprobs.shape[0]
    _check_cu_seqlens(cu_seqlens, num_tokens)
    for name, tensor in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask),
                         ("prox_logprobs", prox_logprobs), ("ref_logprobs", ref_logprobs),
                         ("entropy", entropy), ("engine_logprobs", engine_logprobs)):
        _check_packed(name, tensor, num_tokens)
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool, got {loss_mask.dtype}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("config.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("config.entropy_coef > 0 needs entropy")

    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_index = torch.repeat_interleave(torch.arange(seqlens.numel(), device=seqlens.device),
                                        seqlens)
    num_seqs = seqlens.numel()
    if advantages.shape == (num_seqs,) and num_seqs != num_tokens:
        advantages = advantages[seq_index]
    elif advantages.shape != (num_tokens,):
        raise ValueError(f"advantages must be [T={num_tokens}] or [B={num_seqs}], "
                         f"got {tuple(advantages.shape)}")
    mask = loss_mask.to(logprobs.dtype)
    base = (prox_logprobs if prox_logprobs is not None else old_logprobs).detach()
    # masked-out positions (padding) may hold anything, even -inf: keep them out of exp()
    log_ratio = torch.where(loss_mask, logprobs - base, 0.0)
    if config.ratio_level == "sequence":
        seq_tokens = segment_sum(mask, cu_seqlens).clamp(min=1)
        seq_log_ratio = segment_sum(torch.where(mask > 0, log_ratio, 0.0), cu_seqlens) / seq_tokens
        log_ratio = seq_log_ratio[seq_index]
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - config.eps_clip, 1 + config.clip_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)
    clip_hit = (-advantages * clipped > -advantages * ratio)
    if config.dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -config.dual_clip_c * advantages), pg)
    if prox_logprobs is not None:
        weight = torch.exp(torch.where(loss_mask, prox_logprobs - old_logprobs, 0.0)).detach()
        if config.behav_weight_cap is not None:
            if config.behav_weight_mode == "mask":
                weight = torch.where(weight > config.behav_weight_cap, 0.0, weight)
            else:
                weight = weight.clamp(max=config.behav_weight_cap)
        pg = weight * pg
    if engine_logprobs is not None and config.tis_cap is not None:
        tis = torch.exp(torch.where(loss_mask, old_logprobs - engine_logprobs, 0.0))
        pg = tis.clamp(max=config.tis_cap).detach() * pg
    per_token = pg
    stats = {}
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, torch.where(loss_mask, ref_logprobs, logprobs).detach(),
                         config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = _masked_mean(kl.detach(), mask)
    if entropy is not None:
        per_token = per_token - config.entropy_coef * entropy
        stats["entropy_mean"] = _masked_mean(entropy.detach(), mask)
    loss = _aggregate(per_token, mask, cu_seqlens, config)
    with torch.no_grad():
        stats["clip_fraction"] = _masked_mean(clip_hit.to(mask.dtype), mask)
        stats["ratio_mean"] = _masked_mean(ratio, mask)
        stats["approx_kl"] = _masked_mean(kl_estimate(log_ratio, 0.0, "k3"), mask)
        stats["num_tokens"] = mask.sum()
    return loss, stats


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, values, 0.0).sum() / mask.sum().clamp(min=1)


def _aggregate(per_token, mask, cu_seqlens, config: LossConfig) -> torch.Tensor:
    """Reduce the per-token loss [T] to a scalar as ``config.aggregation`` says."""
    masked = torch.where(mask > 0, per_token, 0.0)
    if config.aggregation == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if config.aggregation == "token_sum":
        return masked.sum()
    seq_loss = segment_sum(masked, cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    if config.aggregation == "seq_mean_token_sum":
        return seq_loss.sum() / (max(num_seqs, 1) * config.seq_len_norm)
    seq_tokens = segment_sum(mask, cu_seqlens)
    has_tokens = seq_tokens > 0
    per_seq = torch.where(has_tokens, seq_loss / seq_tokens.clamp(min=1), 0.0)
    return per_seq.sum() / has_tokens.sum().clamp(min=1)
