"""The GRPO-family loss fused with the LM head: log-probs, entropy, loss and gradients in one pass.

``fused_linear_grpo_loss`` equals ``grpo_loss(linear_logprobs(hidden, weight, labels), ...)``
with the entropy computed in the same pass when ``config.entropy_coef`` ≠ 0, but for
token-level ratios it needs one pass over the vocabulary instead of two: with a token-level
ratio every per-token loss ℓ_t depends on token t alone, and the aggregation is a fixed
weighted sum Σ c_t ℓ_t (:func:`areal_fast.rl.objectives.aggregation_weights`), so each
chunk's dℓ/dlogp and dℓ/dentropy are known as soon as its log-probs are. The pass is ops'
(:func:`areal_fast.ops.fused_pass.fused_forward_backward`, which knows no loss); this module
gives it the objective's per-chunk gradients (:func:`areal_fast.rl.objectives.token_terms`
through autograd, or the Triton kernel :func:`areal_fast.kernels.grpo_loss.token_loss_grads`)
and forms the loss value and statistics with :func:`areal_fast.rl.objectives.grpo_loss`.
Sequence-level ratios (GSPO), M2PO's batch-wide mask and sequence-level rejection couple the
tokens (``LossConfig.couples_tokens``) and take the composed path.

What a trainer logs comes out of the same pass: the entropy (``with_entropy``, also when
it is not in the loss), the per-token log-probs, entropy and proximal log-probs
(``return_per_token``), and decoupled-PPO proximal log-probs formed from each chunk's own
log-probs (``prox_fn``). A caller that knows the upstream gradient on the host
(``upstream_grad``) gets the gradients pre-scaled (the backward then touches nothing), and
one that knows the trained positions (``trained_positions``) spares the pass its only
device→host synchronisation.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from areal_fast.ops import logprobs as lp_ops
from areal_fast.ops.fused_pass import (
    ChunkGrads,
    FusedLinearLossFunction,
    fused_forward_backward,
    scatter_tokens,
    trained_positions_of,
)
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


ProxFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FusedLossTokens(NamedTuple):
    """Per-token outputs of :func:`fused_linear_grpo_loss` (``return_per_token=True``).

    All [T], detached, on the inputs' device, in the accumulation dtype (float32; float64
    for float64 inputs).

    Attributes
    ----------
    logprobs : Tensor [T]
        Current-policy log-probs of the labels at ``temperature``; 0 outside ``loss_mask``.
    entropy : Tensor [T] or None
        Entropy of the same tempered distribution; 0 outside ``loss_mask``. None unless
        ``config.entropy_coef != 0`` or ``with_entropy``.
    prox_logprobs : Tensor [T] or None
        The proximal log-probs the loss used: ``prox_fn``'s values (0 outside
        ``loss_mask``), or ``prox_logprobs`` as given; None with neither.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    prox_logprobs: torch.Tensor | None


def _call_prox_fn(prox_fn: ProxFn, logprobs, positions, out):
    """``out[:] = prox_fn(logprobs, positions)`` after checking the result's shape."""
    value = prox_fn(logprobs, positions)
    if not isinstance(value, torch.Tensor) or value.shape != logprobs.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"prox_fn must return a [{logprobs.shape[0]}] tensor for "
            f"[{logprobs.shape[0]}] log-probs, got {got}"
        )
    if not value.is_floating_point():
        raise ValueError(f"prox_fn must return floating log-probs, got {value.dtype}")
    return out.copy_(value)


def _check_options(prox_fn, prox_logprobs, upstream_grad) -> None:
    if prox_fn is not None and not callable(prox_fn):
        raise TypeError(f"prox_fn must be callable, got {type(prox_fn).__name__}")
    if prox_fn is not None and prox_logprobs is not None:
        raise ValueError("give prox_logprobs or prox_fn, not both")
    if upstream_grad is not None and (
        isinstance(upstream_grad, bool)
        or not isinstance(upstream_grad, (int, float))
        or not math.isfinite(upstream_grad)
    ):
        raise ValueError(f"upstream_grad = {upstream_grad!r} must be a finite number or None")


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
    prox_fn: ProxFn | None = None,
    with_entropy: bool = False,
    return_per_token: bool = False,
    upstream_grad: float | None = None,
    trained_positions: torch.Tensor | None = None,
):
    """GRPO-family loss straight from the final hidden states, without [T, V] logits.

    Equal (values and gradients, to floating-point rounding) to::

        logprobs, entropy = linear_logprobs(hidden, weight, labels, temperature=temperature,
                                            return_entropy=True, bias=bias)
        grpo_loss(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens, config,
                  prox_logprobs=..., ref_logprobs=..., engine_logprobs=...,
                  entropy=entropy if config.entropy_coef != 0 or with_entropy else None)

    (with ``prox_fn``: ``prox_logprobs = prox_fn(logprobs.detach()[kept], kept)`` scattered
    to [T], ``kept`` the trained positions). For token-level ratios the loss gradient is
    formed chunk by chunk inside the single pass over the vocabulary (see the module
    docstring); when tokens are coupled (GSPO, M2PO, ``seq_rejection``), or when no gradient
    is needed, it is exactly the composition above. Tokens outside ``loss_mask`` never enter
    the matmuls of the single pass.

    Parameters
    ----------
    hidden : Tensor [T, H], float32 | bfloat16 | float16 (float64 for reference checks)
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
    prox_fn : callable ``(logprobs [N], positions [N] int64) -> Tensor [N]``, optional
        Decoupled PPO (Fu et al. 2025, AReaL, Eq. 5) with proximal log-probs that are an
        elementwise function of the current ones, formed inside the pass: called under
        ``no_grad`` on detached log-probs of trained tokens only (accumulation dtype),
        with their positions in [0, T) on the same device, once per chunk (so each output
        may depend on its own token alone, and the inputs must not be modified). E.g.
        ``lambda lp, pos: lp`` (the policy being trained is the proximal one: recomputed
        proximal log-probs with one minibatch), or the interpolation of
        :func:`areal_fast.rl.decoupled.loglinear_prox_logprobs` gathered at ``pos``.
        Excludes ``prox_logprobs``.
    with_entropy : bool
        Compute the entropy (``stats["entropy_mean"]``, ``FusedLossTokens.entropy``) even
        when ``config.entropy_coef == 0``, in the same row epilogue; it enters the loss
        only through ``entropy_coef``.
    return_per_token : bool
        Also return a :class:`FusedLossTokens` (per-token log-probs, entropy, proximal
        log-probs, detached).
    upstream_grad : float, optional
        The gradient the caller will back-propagate into ``loss`` (1.0 for
        ``loss.backward()``, w for ``(w * loss).backward()``), when known on the host: the
        pass forms the gradients of ``upstream_grad · loss`` and the backward hands them
        over unscaled. The backward must then receive exactly that gradient (checked on
        CPU only; on GPUs a different one gives wrong gradients silently). None: the
        backward scales the stored gradients in place by what it receives (one elementwise
        pass over each, no synchronisation; back-propagate once). Unused on the composed
        path.
    trained_positions : Tensor [N] int64, optional
        ``loss_mask.nonzero().squeeze(1)`` computed by the caller (e.g. on the host, where
        the batch was packed, and copied over): spares the device→host synchronisation of
        ``nonzero`` on GPUs. Checked against ``loss_mask`` for CPU tensors.

    Returns
    -------
    loss : Tensor [], float32 (float64 for float64 inputs)
        Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    stats : dict[str, Tensor]
        As :func:`areal_fast.grpo_loss` returns them (``entropy_mean`` whenever the entropy
        is computed).
    tokens : FusedLossTokens
        Only with ``return_per_token``.

    Raises
    ------
    ValueError
        Any bad tensor or option, named, as in ``linear_logprobs`` and ``grpo_loss``; both
        ``prox_fn`` and ``prox_logprobs``; a ``prox_fn`` result of the wrong shape; bad
        ``upstream_grad`` or ``trained_positions``.
    TypeError
        ``prox_fn`` is not callable.
    RuntimeError
        (backward, CPU) the incoming gradient differs from ``upstream_grad``.

    Notes
    -----
    No device→host synchronisation on GPUs when ``trained_positions`` is given (label and
    ``cu_seqlens`` value checks run on CPU tensors only).
    """
    lp_ops._validate(hidden, weight, labels, bias, temperature, IGNORE_INDEX, False)
    check_loss_inputs(
        hidden.shape[0],
        old_logprobs,
        loss_mask,
        cu_seqlens,
        config,
        prox_logprobs=prox_logprobs,
        ref_logprobs=ref_logprobs,
        engine_logprobs=engine_logprobs,
        entropy_needed=False,
    )
    _check_options(prox_fn, prox_logprobs, upstream_grad)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    call = _LossCall(
        hidden,
        weight,
        torch.where(loss_mask, labels, IGNORE_INDEX),
        bias,
        temperature,
        impl,
        config.entropy_coef != 0 or bool(with_entropy),
        old_logprobs,
        advantages,
        loss_mask,
        cu_seqlens,
        config,
        prox_logprobs,
        ref_logprobs,
        engine_logprobs,
        prox_fn,
        trained_positions,
        upstream_grad,
    )
    path = _composed if config.couples_tokens or not needs_grad else _fused
    loss, stats, tokens = path(call)
    return (loss, stats, tokens) if return_per_token else (loss, stats)


class _LossCall(NamedTuple):
    """One call's inputs as both paths take them (``train_labels``: ``labels`` with
    ``ignore_index`` outside ``loss_mask``; ``want_entropy``: the entropy is computed)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    train_labels: torch.Tensor
    bias: torch.Tensor | None
    temperature: float
    impl: str | None
    want_entropy: bool
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    config: LossConfig
    prox_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    engine_logprobs: torch.Tensor | None
    prox_fn: ProxFn | None
    trained_positions: torch.Tensor | None
    upstream_grad: float | None

    def loss(self, logprobs, entropy, prox_logprobs):
        """:func:`~areal_fast.rl.objectives.grpo_loss` of these log-probs: (loss, stats)."""
        return grpo_loss(
            logprobs,
            self.old_logprobs,
            self.advantages,
            self.loss_mask,
            self.cu_seqlens,
            self.config,
            prox_logprobs=prox_logprobs,
            ref_logprobs=self.ref_logprobs,
            entropy=entropy,
            engine_logprobs=self.engine_logprobs,
        )


def _fused(c: _LossCall):
    """The single pass (token-level ratios, a gradient wanted): (loss, stats, tokens)."""
    hidden, weight, bias, config = c.hidden, c.weight, c.bias, c.config
    lp_ops._validate(
        hidden, weight, c.train_labels, bias, c.temperature, IGNORE_INDEX,
        hidden.device.type == "cpu",
    )  # fmt: skip
    num_tokens = hidden.shape[0]
    chosen = lp_ops._choose_impl(c.impl, hidden)
    acc = lp_ops._acc_dtype(hidden.dtype)
    advantages_t = per_token_advantages(c.advantages, c.cu_seqlens, num_tokens)
    weights = aggregation_weights(c.loss_mask, c.cu_seqlens, config, acc)
    if c.upstream_grad is not None:
        weights = weights * float(c.upstream_grad)
    kept = trained_positions_of(c.loss_mask, c.trained_positions)
    uses_engine = config.tis_cap is not None or config.corrects_sampler
    engine_lp = c.engine_logprobs if uses_engine else None
    per_token_inputs = tuple(
        None if t is None else t.index_select(0, kept).detach()
        for t in (c.old_logprobs, advantages_t, c.prox_logprobs, c.ref_logprobs, engine_lp)
    )
    prox_out = None if c.prox_fn is None else hidden.new_empty(kept.shape[0], dtype=acc)
    chunk_grads: ChunkGrads = _grpo_chunk_grads(
        per_token_inputs, weights.index_select(0, kept), config, chosen, c.prox_fn, kept, prox_out
    )
    with torch.no_grad():
        kept_lp, kept_ent, kept_grad_hidden, grad_weight, grad_bias = fused_forward_backward(
            hidden.detach().index_select(0, kept),
            weight.detach(),
            c.train_labels[kept],
            None if bias is None else bias.detach(),
            float(c.temperature),
            chosen,
            chunk_grads=chunk_grads,
            want_entropy=c.want_entropy,
            head_grads=weight.requires_grad or (bias is not None and bias.requires_grad),
        )
        logprobs = scatter_tokens(kept_lp, kept, num_tokens)
        entropy = scatter_tokens(kept_ent, kept, num_tokens)
        prox_logprobs = c.prox_logprobs
        if c.prox_fn is not None:
            prox_logprobs = scatter_tokens(prox_out, kept, num_tokens)
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, kept, kept_grad_hidden)
        loss, stats = c.loss(logprobs, entropy, prox_logprobs)
    loss = FusedLinearLossFunction.apply(
        hidden,
        weight,
        bias,
        loss,
        grad_hidden,
        grad_weight,
        grad_bias,
        None if c.upstream_grad is None else float(c.upstream_grad),
    )
    return loss, stats, FusedLossTokens(logprobs, entropy, prox_logprobs)


def _grpo_chunk_grads(per_token_inputs, weights, config, impl, prox_fn, positions, prox_out):
    """The fused pass's ``chunk_grads`` for this loss: per chunk, the proximal log-probs of
    ``prox_fn`` (written into ``prox_out``) and d(Σ c_t ℓ_t)/d logprobs, /d entropy.

    ``per_token_inputs`` = (old, advantages, prox, ref, engine), each [N] or None, and
    ``weights`` [N] (c_t), on the trained tokens; ``positions`` [N] their indices in the batch.
    """
    entropy_in_loss = config.entropy_coef != 0

    def chunk_grads(sl, logprobs, entropy):
        old, adv, prox, ref, engine = (None if t is None else t[sl] for t in per_token_inputs)
        if prox_fn is not None:
            prox = _call_prox_fn(prox_fn, logprobs, positions[sl], prox_out[sl])
        loss_entropy = entropy if entropy_in_loss else None
        g_lp, g_ent = _chunk_loss_grads(
            logprobs, loss_entropy, weights[sl], old, adv, config, prox, ref, engine, impl
        )
        return g_lp, None if loss_entropy is None else g_ent

    return chunk_grads


def _composed(c: _LossCall):
    """``linear_logprobs`` + ``grpo_loss`` (coupled tokens, no-grad calls): (loss, stats, tokens)."""
    out = linear_logprobs(
        c.hidden,
        c.weight,
        c.train_labels,
        temperature=c.temperature,
        return_entropy=c.want_entropy,
        bias=c.bias,
        impl=c.impl,
    )
    logprobs, entropy = out if c.want_entropy else (out, None)
    prox_logprobs = c.prox_logprobs
    if c.prox_fn is not None:
        kept = trained_positions_of(c.loss_mask, c.trained_positions)
        with torch.no_grad():
            kept_lp = logprobs.detach().index_select(0, kept)
            kept_prox = _call_prox_fn(c.prox_fn, kept_lp, kept, torch.empty_like(kept_lp))
            prox_logprobs = scatter_tokens(kept_prox, kept, logprobs.shape[0])
    loss_entropy = entropy
    if entropy is not None and c.config.entropy_coef == 0:
        loss_entropy = entropy.detach()  # logged only: no backward through it
    loss, stats = c.loss(logprobs, loss_entropy, prox_logprobs)
    tokens = FusedLossTokens(
        logprobs.detach(),
        None if entropy is None else entropy.detach(),
        None if prox_logprobs is None else prox_logprobs.detach(),
    )
    return loss, stats, tokens
