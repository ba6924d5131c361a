"""areal_fast log-probs and loss inside TRL's ``GRPOTrainer`` (written against trl 1.16).

:class:`AFGRPOTrainer` is a drop-in subclass of ``trl.GRPOTrainer``: generation, rewards,
advantages, reference model, logging and the training loop stay TRL's; two methods change.

- ``_get_per_token_logps_and_entropies`` runs the model once with ``logits_to_keep=1`` and
  ``output_hidden_states=True`` (so only a [B, 1, V] block of logits is formed), takes the last
  hidden state of the completion positions and computes their log-probs and entropies with
  :func:`areal_fast.linear_logprobs` at TRL's sampling temperature: the [tokens, vocab] logits
  are never materialised.
- ``_compute_loss`` computes the policy loss with :func:`areal_fast.grpo_loss`, configured by
  :func:`trl_loss_config`, and applies TRL's normaliser for the chosen ``loss_type``.

Packing convention: TRL's padded [B, C] completion tensors become B packed sequences of C
positions each (``cu_seqlens = [0, C, 2C, ..., BC]``, int32), padding included; the completion
mask (times the tool mask in multi-turn runs) is the ``loss_mask``, so padding carries no loss
and no gradient. No gather or scatter of the loss inputs is needed.

Example
-------
>>> from areal_fast.integrations.trl import AFGRPOTrainer
>>> trainer = AFGRPOTrainer(model=model, reward_funcs=reward_fn, args=grpo_config,
...                         train_dataset=dataset, processing_class=tokenizer)
>>> trainer.train()
"""

from __future__ import annotations

import inspect
import math

import torch

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError("areal_fast.integrations.trl needs TRL: pip install trl") from exc

from areal_fast.ops.logprobs import linear_logprobs
from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss

__all__ = ["AFGRPOTrainer", "trl_loss_config"]

# TRL loss_type -> areal_fast aggregation of the per-token loss over one micro-batch.
_AGGREGATION = {
    "grpo": "seq_mean_token_mean",  # mean over tokens of each sequence, then over sequences
    "bnpo": "token_mean",  # mean over the micro-batch's tokens
    "dr_grpo": "seq_mean_token_sum",  # token sum / (B * max_completion_length)
    "dapo": "token_sum",  # token sum / tokens of the whole accumulated batch
    "luspo": "seq_mean_token_sum",  # token sum / B (seq_len_norm = 1)
    "cispo": "token_sum",  # as dapo
    "sapo": "seq_mean_token_mean",  # as grpo
}
_NO_EQUIVALENT = {
    "vespo": "weights sequences with a Gamma function of the sequence ratio",
}
# vllm_importance_sampling_mode -> the LossConfig option of its engine/trainer weight
_VLLM_MODES = ("token_truncate", "token_mask")
_MULTIMODAL_OK = ("token_type_ids", "mm_token_type_ids")


def trl_loss_config(args) -> LossConfig:
    """Map a TRL ``GRPOConfig`` to the :class:`areal_fast.LossConfig` of its policy loss.

    Mirrors ``trl.GRPOTrainer`` (trl 1.16) loss options:

    - ``loss_type="grpo"`` → ``aggregation="seq_mean_token_mean"``
    - ``"bnpo"`` → ``"token_mean"``
    - ``"dr_grpo"`` → ``"seq_mean_token_sum"``, ``seq_len_norm=max_completion_length``
    - ``"dapo"`` → ``"token_sum"`` (the trainer then divides by the token count of the
      accumulated batch, ``num_items_in_batch``)
    - ``"luspo"`` → ``"seq_mean_token_sum"``, ``seq_len_norm=1``
    - ``"cispo"`` → ``surrogate="cispo"``, ``"token_sum"`` (as dapo), ``eps_clip=1`` (no
      lower bound) and ``eps_clip_high=epsilon_high − 1`` (TRL caps the ratio at
      ``epsilon_high``); ``delta`` is not used, as in TRL
    - ``"sapo"`` → ``surrogate="sapo"``, ``"seq_mean_token_mean"`` (as grpo),
      ``sapo_tau_pos`` / ``sapo_tau_neg`` = ``sapo_temperature_pos`` / ``_neg``
    - ``epsilon`` / ``epsilon_high`` → ``eps_clip`` / ``eps_clip_high``
    - ``delta`` (two-sided clip) → ``dual_clip_c=delta`` (identical whenever
      delta > 1 + epsilon_high; smaller values raise)
    - ``importance_sampling_level`` → ``ratio_level`` ("token" | "sequence", GSPO)
    - ``beta`` → ``kl_coef`` with ``kl_estimator="k3"``
    - ``use_vllm`` with ``vllm_importance_sampling_mode="token_truncate"`` →
      ``tis_cap=vllm_importance_sampling_clip_max`` (engine log-probs:
      ``sampling_per_token_logps``); ``"token_mask"`` → ``icepop=True`` with the band
      [``clip_min`` or 0, ``clip_max`` or ∞] (IcePop's double-sided mask)

    ``entropy_coef`` is not part of the returned config: TRL adds its entropy bonus as a token
    mean whatever the loss_type, and :class:`AFGRPOTrainer` does the same outside
    :func:`areal_fast.grpo_loss`.

    Parameters
    ----------
    args : trl.GRPOConfig
        Or any object with the same attributes.

    Returns
    -------
    LossConfig

    Raises
    ------
    ValueError
        One line naming the TRL option that has no areal_fast equivalent or is out of range:
        loss_type "vespo", delta <= 1 + epsilon_high, epsilon_high <= 1 with "cispo",
        importance_sampling_level "sequence" with "cispo" or "sapo", beta != 0 with
        use_bias_correction_kl=True, top_entropy_quantile < 1, off_policy_mask_threshold,
        use_adaptive_entropy, vLLM importance sampling modes "sequence_*" or
        "token_truncate" with clip_min, epsilon outside (0, 1).
    """
    loss_type = args.loss_type
    if loss_type in _NO_EQUIVALENT:
        raise ValueError(
            f"loss_type = {loss_type!r} has no areal_fast equivalent (it "
            f"{_NO_EQUIVALENT[loss_type]}); use one of {tuple(_AGGREGATION)}"
        )
    if loss_type not in _AGGREGATION:
        raise ValueError(f"loss_type = {loss_type!r} is not one of {tuple(_AGGREGATION)}")
    eps = float(args.epsilon)
    if not 0 < eps < 1:
        raise ValueError(f"epsilon = {eps} must be in (0, 1)")
    eps_high = eps if args.epsilon_high is None else float(args.epsilon_high)
    if eps_high <= 0:
        raise ValueError(f"epsilon_high = {eps_high} must be > 0")
    delta = getattr(args, "delta", None)
    if loss_type in ("cispo", "sapo"):
        delta = None  # TRL applies delta to the PPO clip only
    if delta is not None and not delta > 1 + eps_high:
        # TRL's two-sided clip caps the unclipped ratio at delta for every advantage sign; it
        # equals the dual clip (which acts on negative advantages only) when delta > 1 + eps_high.
        raise ValueError(f"delta = {delta} must be > 1 + epsilon_high = {1 + eps_high}")
    level = getattr(args, "importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level = {level!r} is not one of ('token', 'sequence')"
        )
    if level == "sequence" and loss_type in ("cispo", "sapo"):
        raise ValueError(
            f"importance_sampling_level = 'sequence' with loss_type = {loss_type!r} has no "
            f"areal_fast equivalent; use 'token'"
        )
    if loss_type == "cispo" and not eps_high > 1:
        raise ValueError(
            f"epsilon_high = {eps_high} must be > 1 with loss_type = 'cispo' (TRL caps the "
            f"ratio at epsilon_high; 5.0 is TRL's recommendation)"
        )
    beta = float(args.beta)
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(f"beta = {beta} must be a finite number >= 0")
    if beta != 0 and getattr(args, "use_bias_correction_kl", False):
        raise ValueError(
            "use_bias_correction_kl = True (KL weighted by the importance ratio) "
            "has no areal_fast equivalent; set it to False or beta = 0"
        )
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError(
            f"top_entropy_quantile = {args.top_entropy_quantile} has no "
            f"areal_fast equivalent; use 1.0"
        )
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        raise ValueError(
            f"off_policy_mask_threshold = {args.off_policy_mask_threshold} has "
            f"no areal_fast equivalent; use None"
        )
    if getattr(args, "use_adaptive_entropy", False):
        raise ValueError(
            "use_adaptive_entropy = True has no areal_fast equivalent; use a fixed entropy_coef"
        )
    engine_options = _engine_weight_options(args)
    seq_len_norm = None
    if loss_type == "dr_grpo":
        seq_len_norm = args.max_completion_length
        if seq_len_norm is None or not seq_len_norm > 0:
            raise ValueError(
                f"max_completion_length = {seq_len_norm} must be > 0 for loss_type = 'dr_grpo'"
            )
        seq_len_norm = float(seq_len_norm)
    elif loss_type == "luspo":
        seq_len_norm = 1.0
    surrogate = {"cispo": "cispo", "sapo": "sapo"}.get(loss_type, "clip")
    return LossConfig(
        eps_clip=1.0 if surrogate == "cispo" else eps,
        eps_clip_high=eps_high - 1 if surrogate == "cispo" else eps_high,
        dual_clip_c=None if delta is None else float(delta),
        ratio_level=level,
        aggregation=_AGGREGATION[loss_type],
        seq_len_norm=seq_len_norm,
        kl_coef=beta,
        kl_estimator="k3",
        surrogate=surrogate,
        sapo_tau_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
        sapo_tau_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
        **engine_options,
    )


def _engine_weight_options(args) -> dict:
    """LossConfig options of TRL's vLLM importance-sampling correction (engine log-probs:
    ``sampling_per_token_logps``): "token_truncate" → ``tis_cap``, "token_mask" → IcePop."""
    if not (
        getattr(args, "use_vllm", False)
        and getattr(args, "vllm_importance_sampling_correction", False)
    ):
        return {}
    mode = args.vllm_importance_sampling_mode
    if mode not in _VLLM_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode = {mode!r} has no areal_fast equivalent "
            f"(sequence weights are products of the token ratios); use one of {_VLLM_MODES}"
        )
    clip_min, clip_max = (
        args.vllm_importance_sampling_clip_min,
        args.vllm_importance_sampling_clip_max,
    )
    high = math.inf if clip_max is None else float(clip_max)
    if not high > 0:
        raise ValueError(f"vllm_importance_sampling_clip_max = {clip_max} must be > 0")
    if mode == "token_mask":
        low = 0.0 if clip_min is None else float(clip_min)
        if not 0 <= low < high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min = {clip_min} must be in [0, clip_max)"
            )
        return {"icepop": True, "icepop_low": low, "icepop_high": high}
    if clip_min is not None:
        raise ValueError(
            f"vllm_importance_sampling_clip_min = {clip_min} has no areal_fast equivalent "
            f"with 'token_truncate'; use None"
        )
    return {"tis_cap": high}


def _logit_scale(config) -> float:
    """Factor the model multiplies its LM-head logits by (1.0 for most models).

    Raises ValueError for final-logit soft-capping (Gemma-2 style), which
    :func:`areal_fast.linear_logprobs` does not compute.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"final_logit_softcapping = {softcap} (model config) has no areal_fast equivalent"
        )
    scale, name = 1.0, "logit_scale"
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(text, name, None)
        if value is not None:
            scale = float(value)
            if name == "logits_scaling" and getattr(text, "model_type", "") != "hyperclovax":
                scale = 1.0 / scale  # Granite / MiniCPM3 divide their logits by it
            break
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"{name} = {scale} (model config) must be a finite number > 0")
    return scale


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


class AFGRPOTrainer(GRPOTrainer):
    """TRL ``GRPOTrainer`` whose log-probs and policy loss are computed by areal_fast.

    Same constructor as ``trl.GRPOTrainer``; after TRL's own set-up the loss options of
    ``args`` are mapped with :func:`trl_loss_config` (stored as ``self.af_loss_config``), so an
    option without an areal_fast equivalent fails at construction.

    Differences from ``GRPOTrainer`` (trl 1.16), none of which change the result beyond
    float rounding:

    - per-token log-probs / entropies: :func:`areal_fast.linear_logprobs` on the final hidden
      states of the completion tokens (packed, padding skipped) and the LM-head weight/bias, at
      ``temperature / logit_scale``; fp32 accumulation whatever the model dtype;
    - policy loss: :func:`areal_fast.grpo_loss` on the packed completions (see the module
      docstring), then TRL's normaliser: ``grpo`` × (non-empty sequences / B) (TRL counts
      fully masked completions in its mean), ``dapo`` ÷ (``num_items_in_batch`` / processes ×
      grad-accumulation / steps_per_generation in training), every other type ÷
      grad-accumulation steps in training;
    - entropy bonus (``entropy_coef``): TRL's token mean of the entropy, subtracted outside
      ``grpo_loss``;
    - logged metrics: ``entropy``, ``kl``, ``clip_ratio/{low,high,region}_mean`` (PPO-clip
      loss types) or ``cispo_clip_ratio`` ("cispo"), ``policy_loss`` (with an entropy bonus),
      ``aux_loss`` (MoE) and the areal_fast extras ``af/approx_kl``, ``af/ratio_mean`` and,
      with "token_mask", ``af/rejected_fraction``; TRL's per-sequence ``clip_ratio/low_min`` and
      ``high_max`` are not logged.

    Notes
    -----
    Written and tested against trl 1.16.0. TRL's ``use_bias_correction_kl`` defaults to True,
    which has no areal_fast equivalent: with ``beta > 0`` set it to False. TRL's ``GRPOConfig``
    turns ``bf16`` on by default; the model forward then runs under autocast as in TRL, and
    the log-probs are computed in fp32 from its hidden states.

    Raises
    ------
    ValueError
        From :func:`trl_loss_config`; for a model with ``final_logit_softcapping``; at the
        first forward, for multimodal inputs (pixel values, image sizes, ...): text models only.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.af_loss_config = trl_loss_config(self.args)
        _logit_scale(self.model.config)  # fail now on a model the log-prob path cannot handle

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Completion log-probs (and entropies) through :func:`areal_fast.linear_logprobs`.

        Parameters
        ----------
        model : torch.nn.Module
            Policy or reference causal LM (possibly wrapped by accelerate / PEFT).
        input_ids : Tensor [B, P + C], int64
            Prompt followed by completion tokens.
        attention_mask : Tensor [B, P + C], int
            1 on real tokens; completion positions with 0 get log-prob and entropy 0.
        logits_to_keep : int
            C, the number of completion positions scored.
        batch_size : int, optional
            Rows per forward pass (all at once when None).
        compute_entropy, compute_aux_loss : bool
            Also return the entropies / the MoE load-balancing loss.
        **multimodal
            ``token_type_ids`` / ``mm_token_type_ids`` are passed to the model; any other
            non-None input (pixel values, ...) raises ValueError.

        Returns
        -------
        logps : Tensor [B, C], float32
        entropies : Tensor [B, C], float32, or None
        aux_loss : Tensor [], or None
        """
        for name, value in multimodal.items():
            if value is not None and name not in _MULTIMODAL_OK:
                raise ValueError(f"{name} is not supported by AFGRPOTrainer (text-only models)")
        unwrapped = self.accelerator.unwrap_model(model)
        head = unwrapped.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head once
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        temperature = self.temperature / _logit_scale(unwrapped.config)
        forward_kwargs = {"output_hidden_states": True, "use_cache": False}
        # PEFT wrappers forward **kwargs to the transformers model, whose signature tells
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        if "logits_to_keep" in inspect.signature(type(base).forward).parameters:
            forward_kwargs["logits_to_keep"] = 1
        if compute_aux_loss:
            forward_kwargs["output_router_logits"] = True
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies, all_aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            ids = input_ids[rows]
            inputs = {"input_ids": ids, "attention_mask": attention_mask[rows], **forward_kwargs}
            for name in _MULTIMODAL_OK:
                if multimodal.get(name) is not None:
                    inputs[name] = multimodal[name][rows]
            with self.accelerator.autocast():
                outputs = model(**inputs)
            # position t's hidden state predicts token t + 1
            hidden = outputs.hidden_states[-1][:, -logits_to_keep - 1 : -1]
            valid = attention_mask[rows, -logits_to_keep:].bool()
            packed = hidden[valid.to(hidden.device)].to(device=weight.device, dtype=weight.dtype)
            labels = ids[:, -logits_to_keep:][valid].to(weight.device)
            logps, entropy = linear_logprobs(
                packed, weight, labels, temperature=temperature, return_entropy=True, bias=bias
            )
            valid = valid.to(logps.device)
            all_logps.append(logps.new_zeros(valid.shape).masked_scatter(valid, logps))
            if compute_entropy:
                all_entropies.append(entropy.new_zeros(valid.shape).masked_scatter(valid, entropy))
            if compute_aux_loss:
                all_aux.append(outputs.aux_loss)
        logps = torch.cat(all_logps)
        entropies = torch.cat(all_entropies) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        """GRPO-family loss of one micro-batch with :func:`areal_fast.grpo_loss`.

        Parameters
        ----------
        model : torch.nn.Module
        inputs : dict
            TRL's prepared batch: ``prompt_ids`` / ``prompt_mask`` [B, P], ``completion_ids`` /
            ``completion_mask`` [B, C], ``advantages`` [B] or [B, C], optional ``tool_mask``,
            ``old_per_token_logps``, ``ref_per_token_logps``, ``sampling_per_token_logps``
            [B, C], and ``num_items_in_batch``.

        Returns
        -------
        Tensor [], differentiable scalar, scaled as TRL scales it for gradient accumulation.
        """
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        num_seqs, length = completion_ids.shape
        mask = completion_mask
        if "tool_mask" in inputs:  # multi-turn: tool-output tokens carry no loss
            mask = completion_mask * inputs["tool_mask"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            length,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"),
        )
        mask = mask.to(logps.dtype)
        advantages = inputs["advantages"]
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps
        config = self.af_loss_config
        ref_logps = inputs["ref_per_token_logps"].reshape(-1) if config.kl_coef > 0 else None
        engine_logps = None
        if config.tis_cap is not None or config.icepop:
            sampling = inputs["sampling_per_token_logps"]
            # tokens the engine could not score (NaN) get no correction, as in TRL
            engine_logps = torch.where(torch.isnan(sampling), old_logps, sampling).reshape(-1)
        cu_seqlens = torch.arange(num_seqs + 1, device=logps.device, dtype=torch.int32) * length
        loss, stats = grpo_loss(
            logps.reshape(-1),
            old_logps.reshape(-1),
            advantages if advantages.dim() == 1 else advantages.reshape(-1),
            mask.reshape(-1) > 0,
            cu_seqlens,
            config,
            ref_logprobs=ref_logps,
            engine_logprobs=engine_logps,
        )

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type in ("dapo", "cispo"):
            normalizer = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            loss = loss / normalizer
            policy_loss = loss.detach()
        else:
            if self.loss_type in ("grpo", "sapo"):  # TRL's mean runs over all B rows
                loss = loss * ((mask.sum(-1) > 0).sum() / num_seqs)
            policy_loss = loss.detach()
            loss = loss / accumulation

        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * _masked_mean(entropies, mask) / accumulation
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(policy_loss).nanmean().item()
            )
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss).mean().item()
            )
        self._log_loss_metrics(
            mode, logps, old_logps, advantages, mask, entropies, ref_logps, stats
        )
        return loss

    def _log_loss_metrics(
        self, mode, logps, old_logps, advantages, mask, entropies, ref_logps, stats
    ):
        """Append TRL-named metrics (global means over processes) to ``self._metrics``."""

        def global_mean(values, weights):
            totals = torch.stack([(values * weights).sum(), weights.sum().to(values.dtype)])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        with torch.no_grad():
            metrics = self._metrics[mode]
            metrics["entropy"].append(global_mean(entropies, mask))
            if ref_logps is not None:
                log_ratio = ref_logps.view_as(logps) - logps
                metrics["kl"].append(global_mean(torch.expm1(log_ratio) - log_ratio, mask))
            config = self.af_loss_config
            log_ratio = torch.where(mask > 0, logps - old_logps, 0.0)
            if config.ratio_level == "sequence":
                log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
                    min=1
                )
            ratio = torch.exp(log_ratio)
            adv = advantages if advantages.dim() == 2 else advantages[:, None]
            if config.surrogate != "clip":
                if config.surrogate == "cispo":  # TRL: ratio above its cap, A > 0
                    hit = ((ratio > 1 + config.clip_high) & (adv > 0)).to(logps.dtype)
                    metrics["cispo_clip_ratio"].append(global_mean(hit, mask))
                return self._log_af_stats(metrics, stats)
            low = ((ratio < 1 - config.eps_clip) & (adv < 0)).to(logps.dtype)
            high = ((ratio > 1 + config.clip_high) & (adv > 0)).to(logps.dtype)
            # one flag per sequence (sequence ratios, sequence advantages): TRL averages them
            # over sequences; otherwise over the masked tokens
            weights = torch.ones_like(low) if low.shape[1] == 1 else mask
            metrics["clip_ratio/low_mean"].append(global_mean(low, weights))
            metrics["clip_ratio/high_mean"].append(global_mean(high, weights))
            metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high), weights))
            self._log_af_stats(metrics, stats)

    def _log_af_stats(self, metrics, stats) -> None:
        """``af/approx_kl``, ``af/ratio_mean`` (and ``af/rejected_fraction`` with IcePop):
        :func:`areal_fast.grpo_loss` statistics, means over processes."""
        for name in ("approx_kl", "ratio_mean", "rejected_fraction"):
            if name in stats:
                value = self.accelerator.reduce(stats[name].detach(), reduction="mean")
                metrics[f"af/{name}"].append(value.item())
