"""areal_fast's policy loss as a verl policy loss (written against verl 0.9.1).

verl picks the actor's policy loss by name from a registry
(``verl.trainer.ppo.core_algos.register_policy_loss`` / ``get_policy_loss_fn``, selected with
``actor_rollout_ref.actor.policy_loss.loss_mode``). :func:`register_verl_policy_loss` adds
:func:`verl_policy_loss` under a name of your choice:

>>> from areal_fast.integrations.verl import register_verl_policy_loss
>>> register_verl_policy_loss("areal_fast")
>>> # then: actor_rollout_ref.actor.policy_loss.loss_mode=areal_fast

It reproduces verl's ``"vanilla"`` loss (PPO clip with separate low/high ranges, dual clip
``clip_ratio_c`` on negative advantages, log-ratio clamped to [−20, 20], optional rollout
importance weights) with :func:`areal_fast.grpo_loss`, and verl's ``"cispo"`` and ``"sapo"``
losses with a template of ``surrogate="cispo"`` / ``"sapo"``
(``register_verl_policy_loss("af_sapo", LossConfig(surrogate="sapo"))``). IcePop and
sequence-level rejection are verl's own (``algorithm.rollout_correction``): their weights
reach the loss as ``rollout_is_weights``. verl adds the entropy and KL terms
outside the policy loss, so the loss here has neither.

Packing convention: verl's padded [B, L] response tensors become B packed sequences of L
positions each (``cu_seqlens = [0, L, 2L, ..., BL]``, int32), padding included; the response
mask is the ``loss_mask``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss

__all__ = ["register_verl_policy_loss", "verl_loss_config", "verl_policy_loss"]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# verl clamps the log-ratio to this range before exponentiating
_LOG_RATIO_CLAMP = 20.0


def _get(config, key: str, default=None):
    """Read ``key`` from a verl ActorConfig, an omegaconf DictConfig or a plain dict."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def _check_template(template: LossConfig | None) -> LossConfig:
    template = LossConfig() if template is None else template
    for name in ("kl_coef", "entropy_coef"):
        if getattr(template, name) != 0:
            raise ValueError(
                f"config.{name} must be 0: verl adds its own KL and entropy terms "
                f"(actor.use_kl_loss, actor.entropy_coeff)"
            )
    if template.behav_weight_cap is not None:
        raise ValueError("config.behav_weight_cap has no verl input (no proximal log-probs)")
    if template.tis_cap is not None or template.corrects_sampler:
        raise ValueError(
            "config.tis_cap, icepop and seq_rejection must be off: verl passes its rollout "
            "importance weights and rejection (algorithm.rollout_correction) ready-made"
        )
    if template.surrogate not in ("clip", "cispo", "sapo"):
        raise ValueError(
            f"config.surrogate = {template.surrogate!r} has no verl loss; use 'clip', "
            f"'cispo' or 'sapo'"
        )
    return template


def verl_loss_config(
    actor_config,
    loss_agg_mode: str = "token-mean",
    response_length: int | None = None,
    template: LossConfig | None = None,
) -> LossConfig:
    """Map verl actor options to the :class:`areal_fast.LossConfig` of the policy loss.

    - ``clip_ratio_low`` (or ``clip_ratio``) → ``eps_clip``
    - ``clip_ratio_high`` (or ``clip_ratio``) → ``eps_clip_high``
    - ``clip_ratio_c`` (default 3.0) → ``dual_clip_c`` (PPO clip only: verl's "cispo" and
      "sapo" have no dual clip)
    - ``tau_pos`` / ``tau_neg`` (defaults 1.0 / 1.05) → ``sapo_tau_pos`` / ``sapo_tau_neg``
      (template ``surrogate="sapo"``, whose aggregation is always "seq-mean-token-mean",
      as in verl)
    - ``loss_agg_mode="token-mean"`` → ``aggregation="token_mean"``
    - ``"token-sum"`` → ``"token_sum"``
    - ``"seq-mean-token-mean"`` → ``"seq_mean_token_mean"``
    - ``"seq-mean-token-sum"`` → ``"seq_mean_token_sum"``, ``seq_len_norm=1``
    - ``"seq-mean-token-sum-norm"`` → ``"seq_mean_token_sum"``,
      ``seq_len_norm = global_batch_info["loss_scale_factor"]`` or ``response_length``

    This is the per-micro-batch reduction; :func:`verl_policy_loss` rescales it to verl's
    global-batch normalisers (``global_batch_info``) and to verl's count of non-empty
    sequences where the two differ.

    Parameters
    ----------
    actor_config : verl ActorConfig, omegaconf DictConfig or dict
        The actor section of a verl config (``clip_ratio*``, ``global_batch_info``).
    loss_agg_mode : str
        One of ``LOSS_AGG_MODES``.
    response_length : int, optional
        L, the padded response length (needed by "seq-mean-token-sum-norm" when
        ``global_batch_info`` has no ``loss_scale_factor``).
    template : LossConfig, optional
        Supplies the options verl has no key for (``ratio_level``: "sequence" gives GSPO-style
        sequence ratios). Its kl_coef / entropy_coef must be 0 and its behav_weight_cap /
        tis_cap None.

    Returns
    -------
    LossConfig

    Raises
    ------
    ValueError
        One line naming the option: unknown loss_agg_mode, clip_ratio_low outside (0, 1),
        clip_ratio_high <= 0, clip_ratio_c <= 1, missing response_length, or a template
        option verl cannot feed.
    """
    template = _check_template(template)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode = {loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    if template.surrogate == "sapo":
        loss_agg_mode = "seq-mean-token-mean"
    clip = float(_get(actor_config, "clip_ratio", 0.2))
    low = float(_get(actor_config, "clip_ratio_low", clip))
    high = float(_get(actor_config, "clip_ratio_high", clip))
    dual = float(_get(actor_config, "clip_ratio_c", 3.0))
    if not 0 < low < 1:
        raise ValueError(f"clip_ratio_low = {low} must be in (0, 1)")
    if not high > 0:
        raise ValueError(f"clip_ratio_high = {high} must be > 0")
    if not dual > 1:
        raise ValueError(f"clip_ratio_c = {dual} must be > 1")
    seq_len_norm = None
    if loss_agg_mode == "seq-mean-token-sum":
        seq_len_norm = 1.0
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        info = _get(actor_config, "global_batch_info", {}) or {}
        factor = info.get("loss_scale_factor")
        if factor is None:
            if response_length is None:
                raise ValueError(
                    "response_length is required for loss_agg_mode = "
                    "'seq-mean-token-sum-norm' without loss_scale_factor"
                )
            factor = response_length
        seq_len_norm = float(factor)
        if not seq_len_norm > 0:
            raise ValueError(f"loss_scale_factor = {factor} must be > 0")
    aggregation = {
        "token-mean": "token_mean",
        "token-sum": "token_sum",
        "seq-mean-token-mean": "seq_mean_token_mean",
    }.get(loss_agg_mode, "seq_mean_token_sum")
    return replace(
        template,
        eps_clip=low,
        eps_clip_high=high,
        dual_clip_c=dual if template.surrogate == "clip" else None,
        aggregation=aggregation,
        seq_len_norm=seq_len_norm,
        sapo_tau_pos=float(_get(actor_config, "tau_pos", 1.0)),
        sapo_tau_neg=float(_get(actor_config, "tau_neg", 1.05)),
    )


def _global_scale(loss_agg_mode: str, mask: torch.Tensor, info: dict):
    """Factor from areal_fast's per-micro-batch reduction to verl's aggregation.

    verl divides token sums by the global token count (``batch_num_tokens``) and sequence
    sums by the global number of sequences (``global_batch_size``), times ``dp_size``; without
    them it uses the micro-batch's token count and its number of non-empty sequences (areal_fast
    counts every sequence in "seq_mean_token_sum").
    """
    dp_size = info.get("dp_size") or 1
    num_tokens, num_seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    rows = mask.shape[0]
    nonempty = (mask.sum(-1) > 0).sum()
    if loss_agg_mode == "token-sum":
        return dp_size
    needed = num_tokens if loss_agg_mode == "token-mean" else num_seqs
    if needed is None and dp_size > 1:
        name = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        raise ValueError(f"global_batch_info['{name}'] is required when dp_size = {dp_size} > 1")
    if loss_agg_mode == "token-mean":
        return 1.0 if num_tokens is None else mask.sum() * dp_size / num_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        return 1.0 if num_seqs is None else nonempty * dp_size / num_seqs
    # seq-mean-token-sum(-norm): areal_fast divides by all rows, verl by non-empty ones
    return rows / nonempty.clamp(min=1) if num_seqs is None else rows * dp_size / num_seqs


def verl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    template: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy-loss function computed by :func:`areal_fast.grpo_loss`.

    Same signature and return convention as verl 0.9.1's registered policy losses
    (e.g. ``compute_policy_loss_vanilla``): verl calls it with keyword arguments.

    With Δ = clamp(log_prob − old_log_prob, −20, 20) and r = exp(Δ) (the clamp mirrors verl;
    its gradient is zero outside the range), the per-token loss is the dual-clip PPO loss
    max(−A·r, −A·clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high)), capped at
    −clip_ratio_c·A for A < 0, times ``rollout_is_weights`` when given, aggregated over
    ``response_mask`` as ``loss_agg_mode`` and ``config.global_batch_info`` say.

    Parameters
    ----------
    old_log_prob : Tensor [B, L], float32
        Log-probs of the responses under the policy that generated them.
    log_prob : Tensor [B, L], float32
        Current-policy log-probs (differentiable).
    advantages : Tensor [B, L], float32
    response_mask : Tensor [B, L], bool or 0/1
    loss_agg_mode : str
        "token-mean" | "token-sum" | "seq-mean-token-mean" | "seq-mean-token-sum" |
        "seq-mean-token-sum-norm".
    config : verl ActorConfig or DictConfig
        Actor config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
        ``clip_ratio_c`` and ``global_batch_info`` (``dp_size``, ``batch_num_tokens``,
        ``global_batch_size``, ``loss_scale_factor``; may be empty).
    rollout_is_weights : Tensor [B, L], optional
        Rollout importance weights computed by verl (``policy_loss.rollout_correction``),
        multiplied into the per-token policy loss (passed to ``grpo_loss`` as
        ``engine_logprobs = −log w`` with an infinite TIS cap, which reproduces w).
    template : LossConfig, optional
        Options verl has no key for (see :func:`verl_loss_config`).

    Returns
    -------
    pg_loss : Tensor [], float32
        Differentiable scalar.
    pg_metrics : dict[str, float]
        ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower``, as verl's
        "vanilla" loss reports them.

    Raises
    ------
    ValueError
        ``config`` missing, tensors of different shapes, or an option as in
        :func:`verl_loss_config`.
    """
    if config is None:
        raise ValueError("config (verl actor config) is required")
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, L], got {tuple(log_prob.shape)}")
    for name, tensor in (
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("response_mask", response_mask),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if tensor is not None and tensor.shape != log_prob.shape:
            raise ValueError(
                f"{name} must be {tuple(log_prob.shape)} like log_prob, got {tuple(tensor.shape)}"
            )
    num_seqs, length = log_prob.shape
    loss_config = verl_loss_config(config, loss_agg_mode, length, template)
    if loss_config.surrogate == "sapo":
        loss_agg_mode = "seq-mean-token-mean"  # verl's SAPO ignores loss_agg_mode
    if rollout_is_weights is not None:
        loss_config = replace(loss_config, tis_cap=math.inf)
    mask = response_mask.bool()
    # verl's ratio: exp of the log-ratio clamped to [-20, 20]; grpo_loss sees the clamped
    # log-ratio with old log-prob 0, except CISPO, whose value is −sg(clip(r))·A·log_prob (the
    # clip saturates before the clamp acts)
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    current, behaviour = log_ratio, torch.zeros_like(log_ratio)
    if loss_config.surrogate == "cispo":
        current, behaviour = log_prob, old_log_prob.to(log_prob.dtype)
    engine = (
        None
        if rollout_is_weights is None
        else behaviour - torch.log(rollout_is_weights.detach().to(log_ratio.dtype))
    )
    cu_seqlens = torch.arange(num_seqs + 1, device=log_prob.device, dtype=torch.int32) * length
    loss, stats = grpo_loss(
        current.reshape(-1),
        behaviour.reshape(-1),
        advantages.reshape(-1),
        mask.reshape(-1),
        cu_seqlens,
        loss_config,
        engine_logprobs=None if engine is None else engine.reshape(-1),
    )
    info = dict(_get(config, "global_batch_info", {}) or {})
    loss = loss * _global_scale(loss_agg_mode, mask, info)
    metrics = _verl_metrics(log_ratio, advantages, mask, loss_config, stats)
    return loss, metrics


@torch.no_grad()
def _verl_metrics(log_ratio, advantages, mask, loss_config: LossConfig, stats) -> dict:
    """``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` as verl's loss of
    the same kind reports them (0 where verl reports 0: SAPO's clip fractions, the lower one
    of CISPO)."""
    weights = mask.to(log_ratio.dtype)
    denominator = weights.sum() + 1e-8
    lower = torch.zeros((), dtype=log_ratio.dtype)
    if loss_config.surrogate == "clip":
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - loss_config.eps_clip, 1 + loss_config.clip_high)
        pg_clip = torch.maximum(-advantages * ratio, -advantages * clipped)
        below = (pg_clip > -advantages * loss_config.dual_clip_c) & (advantages < 0)
        lower = (below * weights).sum() / denominator
    return {
        "actor/pg_clipfrac": stats["clip_fraction"].item(),
        "actor/ppo_kl": ((-log_ratio * weights).sum() / denominator).item(),
        "actor/pg_clipfrac_lower": lower.item(),
    }


def register_verl_policy_loss(name: str = "areal_fast", config: LossConfig | None = None):
    """Register :func:`verl_policy_loss` in verl's policy-loss registry under ``name``.

    Select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=<name>``. Registering the
    same name again replaces the earlier areal_fast registration.

    Parameters
    ----------
    name : str
        Registry key; must not be one of verl's own losses ("vanilla", "gspo", ...).
    config : LossConfig, optional
        Template for the options verl has no key for (``ratio_level``); see
        :func:`verl_loss_config`. Checked now.

    Returns
    -------
    callable
        The registered function, with verl's policy-loss signature.

    Raises
    ------
    ImportError
        verl (``verl.trainer.ppo.core_algos``) cannot be imported.
    ValueError
        ``name`` is taken by a loss that is not an areal_fast one, or ``config`` sets an
        option verl cannot feed (kl_coef, entropy_coef, behav_weight_cap, tis_cap).
    """
    from verl.trainer.ppo import core_algos

    template = _check_template(config)
    existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
    if existing is not None and not getattr(existing, "_areal_fast", False):
        raise ValueError(f"name = {name!r} is already a verl policy loss; pick another name")

    def areal_fast_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return verl_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
            template=template,
        )

    areal_fast_policy_loss.__doc__ = verl_policy_loss.__doc__
    areal_fast_policy_loss._areal_fast = True
    return core_algos.register_policy_loss(name)(areal_fast_policy_loss)
