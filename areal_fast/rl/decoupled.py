"""Decoupled PPO helpers: proximal log-probs without a forward pass, staleness statistics."""

from __future__ import annotations

import torch


def _check_token_tensors(**tensors: torch.Tensor) -> int:
    """All tensors 1-D of one length T (returned); ValueError naming the first that is not."""
    num_tokens = None
    for name, tensor in tensors.items():
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be [T], got shape {tuple(tensor.shape)}")
        if num_tokens is None:
            num_tokens = tensor.shape[0]
        elif tensor.shape[0] != num_tokens:
            raise ValueError(f"{name} must be [T={num_tokens}], got {tuple(tensor.shape)}")
    return num_tokens


def loglinear_prox_logprobs(
    logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    versions: torch.Tensor,
    prox_version: int,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """Proximal-policy log-probs interpolated between behaviour and current policy.

    Decoupled PPO (Fu et al. 2025, AReaL, Eq. 5) needs log π_prox, the policy at the start
    of the training step. Instead of a forward pass it is approximated, per token, on a
    straight line in log space between the policy that generated the token (version v_b)
    and the policy being trained (version v_θ = prox_version + 1)::

        α    = (v_prox − v_b) / (v_θ − v_b)         v_prox = prox_version
        prox = behav + α · (logprobs − behav)

    so on-policy tokens (v_b = v_prox) get α = 0 and prox = behav; a token k versions stale
    gets α = k / (k + 1). Source: the "loglinear" proximal log-prob approximation of
    inclusionAI/AReaL (docs/algorithms/prox_approx.md).

    Parameters
    ----------
    logprobs : Tensor [T], float
        Current-policy log-probs of the tokens. Not detached here: pass ``logprobs.detach()``
        to use the result as a constant (the proximal policy is never differentiated).
    behav_logprobs : Tensor [T], float
        Behaviour (inference-engine) log-probs of the tokens.
    versions : Tensor [T], integer
        Policy version v_b that generated each token (anything where ``loss_mask`` is False).
    prox_version : int
        Version of the proximal policy (the trainer's version at the start of the step).
    loss_mask : Tensor [T], bool
        True on trained tokens.

    Returns
    -------
    Tensor [T], dtype of ``logprobs``
        The interpolated log-probs on trained tokens; ``behav_logprobs`` elsewhere.

    Raises
    ------
    ValueError
        Tensors not [T] of one length, ``versions`` not integer, ``loss_mask`` not bool, or a
        trained token whose version is negative or greater than ``prox_version``.
    """
    _check_token_tensors(
        logprobs=logprobs, behav_logprobs=behav_logprobs, versions=versions, loss_mask=loss_mask
    )
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise ValueError(f"versions must hold integers, got {versions.dtype}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool, got {loss_mask.dtype}")
    check_token_versions(versions, loss_mask, prox_version)
    staleness = prox_version - versions.to(torch.float64)
    alpha = torch.where(loss_mask, staleness / (staleness + 1), 0.0).to(logprobs.dtype)
    behav = behav_logprobs.to(logprobs.dtype)
    return torch.where(loss_mask, behav + alpha * (logprobs - behav), behav)


def check_token_versions(
    versions: torch.Tensor, loss_mask: torch.Tensor, prox_version: int
) -> None:
    """Check that every trained token's version lies in [0, prox_version].

    Parameters
    ----------
    versions : Tensor [T], integer
    loss_mask : Tensor [T], bool
    prox_version : int

    Raises
    ------
    ValueError
        A trained token's version is negative or greater than ``prox_version``.
    """
    trained = versions[loss_mask]
    if trained.numel() and int(trained.max()) > prox_version:
        raise ValueError(
            f"versions holds {int(trained.max())} on a trained token, newer than "
            f"prox_version = {prox_version}"
        )
    if trained.numel() and int(trained.min()) < 0:
        raise ValueError(
            f"versions holds {int(trained.min())} on a trained token; versions "
            f"of trained tokens must be >= 0"
        )


def staleness_stats(
    versions: torch.Tensor, loss_mask: torch.Tensor, version: int
) -> dict[str, float]:
    """Mean and max of ``version − versions`` over trained tokens.

    Parameters
    ----------
    versions : Tensor [T], integer
        Policy version that generated each token.
    loss_mask : Tensor [T], bool
    version : int
        The trainer's policy version (at the start of the step).

    Returns
    -------
    dict
        ``staleness_mean``, ``staleness_max`` (floats; 0 when no token is trained).
    """
    stale = version - versions[loss_mask].to(torch.float64)
    if stale.numel() == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": float(stale.mean()), "staleness_max": float(stale.max())}


def behav_weight_stats(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float | None,
) -> dict[str, torch.Tensor]:
    """Statistics of the decoupled-PPO behaviour weight w = exp(prox − behav).

    Parameters
    ----------
    prox_logprobs, behav_logprobs : Tensor [T], float32
    loss_mask : Tensor [T], bool
    cap : float or None
        ``LossConfig.behav_weight_cap``.

    Returns
    -------
    dict[str, Tensor]
        ``behav_weight_mean`` (mean of w, before any cap) and
        ``behav_weight_masked_fraction`` (share of tokens with w > cap; 0 when cap is None),
        over trained tokens; scalar tensors.
    """
    with torch.no_grad():
        mask = loss_mask.to(prox_logprobs.dtype)
        count = mask.sum().clamp(min=1)
        weight = torch.exp(torch.where(loss_mask, prox_logprobs - behav_logprobs, 0.0))
        over = weight > cap if cap is not None else torch.zeros_like(loss_mask)
        return {
            "behav_weight_mean": torch.where(loss_mask, weight, 0.0).sum() / count,
            "behav_weight_masked_fraction": (over & loss_mask).to(mask.dtype).sum() / count,
        }
