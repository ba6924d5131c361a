"""GRPO-family loss fused with the LM head: log-probs, entropy, loss and gradients in one pass.

``fused_linear_grpo_loss`` equals ``grpo_loss(linear_logprobs(hidden, weight, labels), ...)``
with the entropy computed in the same pass when ``config.entropy_coef`` ≠ 0, but for
token-level ratios it needs one pass over the vocabulary instead of two: with a token-level
ratio every per-token loss ℓ_t depends on token t alone, and the aggregation is a fixed
weighted sum Σ c_t ℓ_t (:func:`areal_fast.rl.objectives.aggregation_weights`), so each
chunk's dℓ/dlogp and dℓ/dentropy are known as soon as its log-probs are. The chunk's logits
are then overwritten with their gradient (the row epilogue's backward) and pushed through the
two gradient matmuls at once; the autograd backward only scales the stored gradients by the
upstream scalar. Three [chunk, V]-sized matmuls per chunk instead of four, no [T, V] tensor.
Sequence-level ratios (GSPO) couple the tokens of a sequence and take the composed path.
"""

from __future__ import annotations

import torch

from areal_fast.ops import logprobs as lp_ops
from areal_fast.ops.logprob_rows import row_backend
from areal_fast.ops.logprobs import IGNORE_INDEX, linear_logprobs
from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import (
    aggregation_weights,
    check_loss_inputs,
    grpo_loss,
    per_token_advantages,
    token_terms,
)


def _chunk_loss_grads(
    logprobs, entropy, weights, old, advantages, config, prox, ref, engine, impl="torch"
):
    """d(Σ c_t ℓ_t)/d logprobs [C] and /d entropy [C] (None without entropy) for one chunk.

    ``impl == "triton"``: one elementwise Triton launch
    (:func:`areal_fast.kernels.grpo_loss.token_loss_grads`, hand-derived gradient with
    torch's subgradient conventions); otherwise a small autograd through ``token_terms``.
    """
    if impl == "triton":
        from areal_fast.kernels.grpo_loss import token_loss_grads

        out = token_loss_grads(
            logprobs,
            old,
            advantages,
            weights,
            config,
            prox_logprobs=prox,
            ref_logprobs=ref,
            engine_logprobs=engine,
            entropy=entropy,
            with_loss=False,
            clip_hit_dtype=None,
        )
        return out.grad_logprobs, out.grad_entropy
    logprobs = logprobs.detach().requires_grad_(True)
    entropy = None if entropy is None else entropy.detach().requires_grad_(True)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    with torch.enable_grad():
        terms = token_terms(
            logprobs,
            old,
            advantages,
            mask,
            config,
            prox_logprobs=prox,
            ref_logprobs=ref,
            entropy=entropy,
            engine_logprobs=engine,
        )
        inputs = (logprobs,) if entropy is None else (logprobs, entropy)
        grads = torch.autograd.grad((terms.per_token * weights).sum(), inputs, allow_unused=True)
    grad_lp = grads[0] if grads[0] is not None else torch.zeros_like(logprobs)
    grad_ent = None if entropy is None else grads[1]
    return grad_lp.detach(), None if grad_ent is None else grad_ent.detach()


def fused_forward_backward(
    hidden, weight, labels, bias, temperature, per_token_inputs, weights, config, impl
):
    """One pass: logprobs/entropy [T'] and the gradients of Σ c_t ℓ_t w.r.t. hidden/weight/bias.

    ``per_token_inputs`` = (old, advantages, prox, ref, engine), each [T'] or None, on the
    tokens to process (all trained: no ignore_index labels here).
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = lp_ops._acc_dtype(hidden.dtype)
    rows = row_backend(impl)
    weight_mm = lp_ops._matmul_weight(weight, acc)
    want_entropy = config.entropy_coef != 0
    logprobs = hidden.new_empty(num_tokens, dtype=acc)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    lse = torch.empty_like(logprobs)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    grad_bias = None if bias is None else torch.zeros(vocab, dtype=acc, device=weight.device)
    chunk = lp_ops._chunk_size(num_tokens, vocab, torch.finfo(acc).bits // 8)
    block = hidden.new_empty(chunk, vocab, dtype=acc)
    inv_temp = 1.0 / temperature
    for start in range(0, num_tokens, chunk):
        sl = slice(start, min(start + chunk, num_tokens))
        hidden_chunk = hidden[sl]
        z = lp_ops._chunk_logits(hidden_chunk, weight_mm, bias, acc, block[: sl.stop - start])
        chunk_entropy = None if entropy is None else entropy[sl]
        rows.forward(z, labels[sl], inv_temp, IGNORE_INDEX, logprobs[sl], chunk_entropy, lse[sl])
        old, adv, prox, ref, engine = (None if t is None else t[sl] for t in per_token_inputs)
        g_lp, g_ent = _chunk_loss_grads(
            logprobs[sl], chunk_entropy, weights[sl], old, adv, config, prox, ref, engine, impl
        )
        rows.backward_(z, labels[sl], lse[sl], chunk_entropy, g_lp, g_ent, inv_temp, IGNORE_INDEX)
        lp_ops.push_chunk_gradient(
            z, hidden_chunk, weight_mm, acc, sl, grad_hidden, grad_weight, grad_bias
        )
    return logprobs, entropy, grad_hidden, grad_weight, grad_bias


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    """Loss forward that also computes the gradients; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, loss, grad_hidden, grad_weight, grad_bias):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # the usual upstream gradient is exactly 1: hand the stored gradients over as they
        # are (no second weight-sized tensor); the comparison is one host sync per step
        unit = bool(grad_loss == 1)
        grads = [
            None if g is None else (g if unit else g * grad_loss).to(dtype)
            for g, dtype in zip((grad_hidden, grad_weight, grad_bias), ctx.dtypes)
        ]
        return grads[0], grads[1], grads[2], None, None, None, None


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: LossConfig,
    *,
    temperature: float = 1.0,
    prox_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    impl: str | None = None,
):
    """GRPO-family loss straight from the final hidden states, without [T, V] logits.

    Equal (values and gradients, to floating-point rounding) to::

        logprobs, entropy = linear_logprobs(hidden, weight, labels, temperature=temperature,
                                            return_entropy=True, bias=bias)
        grpo_loss(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens, config,
                  prox_logprobs=..., ref_logprobs=..., engine_logprobs=...,
                  entropy=entropy if config.entropy_coef != 0 else None)

    For token-level ratios the loss gradient is formed chunk by chunk inside the single pass
    over the vocabulary (see the module docstring); for ``ratio_level="sequence"`` (GSPO) it
    is exactly the composition above. Tokens outside ``loss_mask`` never enter the matmuls.

    Parameters
    ----------
    hidden : Tensor [T, H], float32 | bfloat16 | float16
        Final hidden states of the packed tokens (the position that predicts ``labels[t]``).
    weight : Tensor [V, H], same dtype as ``hidden``
        LM-head weight. ``bias`` [V] optional.
    labels : Tensor [T], int64
        Next tokens; values at positions outside ``loss_mask`` are not read.
    old_logprobs, advantages, loss_mask, cu_seqlens, config
        As in :func:`areal_fast.grpo_loss`: [T] float32, [T] or [B] float32, [T] bool,
        [B+1] int32, :class:`areal_fast.LossConfig`.
    temperature : float, > 0
        Sampling temperature the log-probs (and entropy) are taken at.
    prox_logprobs, ref_logprobs, engine_logprobs : Tensor [T] float32, optional
        Decoupled-PPO proximal, KL reference and inference-engine log-probs.
    impl : {"auto", "torch", "native", "triton"}, optional
        Row-epilogue implementation, as in :func:`areal_fast.linear_logprobs`.

    Returns
    -------
    loss : Tensor [], float32
        Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    stats : dict[str, Tensor]
        As :func:`areal_fast.grpo_loss` returns them.

    Raises
    ------
    ValueError
        Any bad tensor or option, named, as in ``linear_logprobs`` and ``grpo_loss``.
    """
    lp_ops._validate(hidden, weight, labels, bias, temperature, IGNORE_INDEX, False)
    num_tokens = hidden.shape[0]
    check_loss_inputs(
        num_tokens,
        old_logprobs,
        loss_mask,
        cu_seqlens,
        config,
        prox_logprobs=prox_logprobs,
        ref_logprobs=ref_logprobs,
        engine_logprobs=engine_logprobs,
        entropy_needed=False,
    )
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    want_entropy = config.entropy_coef != 0
    train_labels = torch.where(loss_mask, labels, IGNORE_INDEX)
    if config.ratio_level == "sequence" or not needs_grad:
        logprobs, entropy = (
            linear_logprobs(
                hidden,
                weight,
                train_labels,
                temperature=temperature,
                return_entropy=True,
                bias=bias,
                impl=impl,
            )
            if want_entropy
            else (
                linear_logprobs(
                    hidden, weight, train_labels, temperature=temperature, bias=bias, impl=impl
                ),
                None,
            )
        )
        return grpo_loss(
            logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            cu_seqlens,
            config,
            prox_logprobs=prox_logprobs,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            engine_logprobs=engine_logprobs,
        )
    lp_ops._validate(
        hidden, weight, train_labels, bias, temperature, IGNORE_INDEX, hidden.device.type == "cpu"
    )
    chosen = lp_ops._choose_impl(impl, hidden)
    advantages_t = per_token_advantages(advantages, cu_seqlens, num_tokens)
    weights = aggregation_weights(loss_mask, cu_seqlens, config, lp_ops._acc_dtype(hidden.dtype))
    kept = loss_mask.nonzero().squeeze(1)
    per_token_inputs = tuple(
        None if t is None else t.index_select(0, kept).detach()
        for t in (
            old_logprobs,
            advantages_t,
            prox_logprobs,
            ref_logprobs,
            engine_logprobs if config.tis_cap is not None else None,
        )
    )
    with torch.no_grad():
        kept_lp, kept_ent, kept_grad_hidden, grad_weight, grad_bias = fused_forward_backward(
            hidden.detach().index_select(0, kept),
            weight.detach(),
            train_labels[kept],
            None if bias is None else bias.detach(),
            float(temperature),
            per_token_inputs,
            weights.index_select(0, kept),
            config,
            chosen,
        )
        logprobs = kept_lp.new_zeros(num_tokens).index_copy_(0, kept, kept_lp)
        entropy = (
            None
            if kept_ent is None
            else kept_ent.new_zeros(num_tokens).index_copy_(0, kept, kept_ent)
        )
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, kept, kept_grad_hidden)
        loss, stats = grpo_loss(
            logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            cu_seqlens,
            config,
            prox_logprobs=prox_logprobs,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            engine_logprobs=engine_logprobs,
        )
    loss = FusedLinearGRPOLossFunction.apply(
        hidden, weight, bias, loss, grad_hidden, grad_weight, grad_bias
    )
    return loss, stats
