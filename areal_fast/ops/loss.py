"""GRPO-family loss fused with the LM head: log-probs, entropy, loss and gradients in one pass.

``fused_linear_grpo_loss`` equals ``grpo_loss(linear_logprobs(hidden, weight, labels), ...)``
with the entropy computed in the same pass when ``config.entropy_coef`` ≠ 0, but for
token-level ratios it needs one pass over the vocabulary instead of two: with a token-level
ratio every per-token loss ℓ_t depends on token t alone, and the aggregation is a fixed
weighted sum Σ c_t ℓ_t (:func:`areal_fast.rl.objectives.aggregation_weights`), so each
chunk's dℓ/dlogp and dℓ/dentropy are known as soon as its log-probs are. The chunk's logits
are then overwritten with their gradient (the row epilogue's backward) and pushed through the
two gradient matmuls at once; the autograd backward only hands the stored gradients over
(scaled in place by the upstream scalar, on the device). Three [chunk, V]-sized matmuls per
chunk instead of four, no [T, V] tensor.
Sequence-level ratios (GSPO) couple the tokens of a sequence and take the composed path.

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
from areal_fast.ops.logits_cache import cache_budget_bytes
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


_FUSED_MAX_ROWS = 4096  # tokens per block at most: larger blocks gain no matmul efficiency


def fused_chunk_rows(num_tokens: int, vocab: int, itemsize: int, device: torch.device) -> int:
    """Tokens per [chunk, V] logits block of the fused pass.

    On the CPU the block may take what ``linear_logprobs`` may keep of its logits
    (``AREAL_FAST_LOGITS_CACHE_MB``, :func:`~areal_fast.ops.logits_cache.cache_budget_bytes`),
    up to 4096 rows: a block of a few hundred rows streams the whole LM head once per chunk
    and runs its matmuls well below the full-size rate there. Elsewhere (budget 0 by
    default) the 64 MiB block of the chunked log-prob path (at least 256 rows).
    """
    rows = lp_ops._chunk_size(num_tokens, vocab, itemsize)
    budget_rows = cache_budget_bytes(device) // max(itemsize * vocab, 1)
    return max(1, min(num_tokens, max(rows, min(budget_rows, _FUSED_MAX_ROWS))))


def fused_forward_backward(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    per_token_inputs,
    weights,
    config,
    impl,
    *,
    want_entropy=None,
    prox_fn=None,
    positions=None,
    head_grads=True,
):
    """One pass: logprobs/entropy/prox [T'] and the gradients of Σ c_t ℓ_t w.r.t. hidden/weight/bias.

    ``per_token_inputs`` = (old, advantages, prox, ref, engine), each [T'] or None, on the
    tokens to process (all trained: no ignore_index labels here). ``want_entropy``: also
    compute the entropy (it enters the loss, and its gradient the pass, only when
    ``config.entropy_coef != 0``, which always computes it). ``prox_fn`` with ``positions``
    [T'] int64 (each token's index in the caller's batch): the proximal log-probs of every
    chunk from its own log-probs, in place of ``per_token_inputs``' prox.

    ``config`` None: the forward alone (the log-probs and entropy of exactly this pass; no
    loss, gradients None). ``head_grads`` False: no weight and bias gradients (a frozen LM
    head, e.g. under LoRA: one [V, H] matmul per chunk less).

    Returns (logprobs, entropy or None, prox or None (from ``prox_fn``), grad_hidden,
    grad_weight, grad_bias).
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = lp_ops._acc_dtype(hidden.dtype)
    rows = row_backend(impl)
    weight_mm = lp_ops._matmul_weight(weight, acc)
    forward_only = config is None
    entropy_in_loss = not forward_only and config.entropy_coef != 0
    logprobs = hidden.new_empty(num_tokens, dtype=acc)
    entropy = torch.empty_like(logprobs) if entropy_in_loss or want_entropy else None
    prox_out = None if prox_fn is None else torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    grad_hidden = grad_weight = grad_bias = None
    if not forward_only:
        grad_hidden = torch.empty_like(hidden)
    if not forward_only and head_grads:
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if bias is not None:
            grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device)
    chunk = fused_chunk_rows(num_tokens, vocab, torch.finfo(acc).bits // 8, hidden.device)
    block = hidden.new_empty(chunk, vocab, dtype=acc)
    inv_temp = 1.0 / temperature
    for start in range(0, num_tokens, chunk):
        sl = slice(start, min(start + chunk, num_tokens))
        hidden_chunk = hidden[sl]
        z = lp_ops._chunk_logits(hidden_chunk, weight_mm, bias, acc, block[: sl.stop - start])
        chunk_entropy = None if entropy is None else entropy[sl]
        rows.forward(z, labels[sl], inv_temp, IGNORE_INDEX, logprobs[sl], chunk_entropy, lse[sl])
        if forward_only:
            continue
        old, adv, prox, ref, engine = (None if t is None else t[sl] for t in per_token_inputs)
        if prox_fn is not None:
            prox = _call_prox_fn(prox_fn, logprobs[sl], positions[sl], prox_out[sl])
        loss_entropy = chunk_entropy if entropy_in_loss else None
        g_lp, g_ent = _chunk_loss_grads(
            logprobs[sl], loss_entropy, weights[sl], old, adv, config, prox, ref, engine, impl
        )
        rows.backward_(z, labels[sl], lse[sl], loss_entropy, g_lp, g_ent, inv_temp, IGNORE_INDEX)
        lp_ops.push_chunk_gradient(
            z, hidden_chunk, weight_mm, acc, sl, grad_hidden, grad_weight, grad_bias
        )
    return logprobs, entropy, prox_out, grad_hidden, grad_weight, grad_bias


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    """The loss value, its gradients computed in the forward; backward hands them over.

    ``forward(hidden, weight, bias, loss, grad_hidden, grad_weight, grad_bias,
    upstream_grad)``: ``grad_*`` are the gradients of ``upstream_grad · loss`` when
    ``upstream_grad`` (a host float) is given, else of ``loss``. The backward returns them
    as they are in the first case (the incoming gradient must equal ``upstream_grad``;
    checked on CPU, where the check is free), and scales them in place by the incoming
    gradient in the second (a device-side multiply: no read-back, no weight-sized
    temporary; the graph can be back-propagated once). No device→host synchronisation
    either way.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, loss, grad_hidden, grad_weight, grad_bias, upstream_grad=None
    ):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.upstream_grad = upstream_grad
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensors
        upstream = ctx.upstream_grad
        if upstream is None:
            grads = [None if g is None else g.mul_(grad_loss) for g in grads]
        elif grad_loss.device.type == "cpu" and not bool(grad_loss == upstream):
            raise RuntimeError(
                f"fused_linear_grpo_loss was given upstream_grad = {upstream}, but its "
                f"backward received {float(grad_loss)}"
            )
        out = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None, None, None


def fused_pass_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    impl: str | None = None,
    trained_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of the trained tokens exactly as :func:`fused_linear_grpo_loss` forms them.

    The forward half of its single pass (same chunks of the trained tokens, same row
    epilogue), without gradient: bitwise equal to ``FusedLossTokens.logprobs`` of a
    token-level call on the same tensors, where :func:`~areal_fast.linear_logprobs` (whose
    CPU path tiles the vocabulary) agrees only to rounding. A trainer's no-grad pass uses it
    so that its log-probs match its gradient pass's (an on-policy ratio is exactly 1).

    Parameters
    ----------
    hidden : Tensor [T, H], float32 | bfloat16 | float16 | float64
    weight : Tensor [V, H], same dtype; ``bias`` [V] optional
    labels : Tensor [T], int64 (read where ``loss_mask``)
    loss_mask : Tensor [T], bool
    temperature : float, > 0
    impl : {"auto", "torch", "native", "triton"}, optional
    trained_positions : Tensor [N] int64, optional
        As in :func:`fused_linear_grpo_loss`.

    Returns
    -------
    Tensor [T], float32 (float64 for float64 inputs)
        0 outside ``loss_mask``; not differentiable.

    Raises
    ------
    ValueError
        Bad shapes, dtypes or devices (named), labels out of range on the CPU.
    """
    lp_ops._validate(hidden, weight, labels, bias, temperature, IGNORE_INDEX, False)
    if loss_mask.shape != labels.shape or loss_mask.dtype != torch.bool:
        raise ValueError(
            f"loss_mask must be [T={labels.shape[0]}] bool, got "
            f"{tuple(loss_mask.shape)} {loss_mask.dtype}"
        )
    train_labels = torch.where(loss_mask, labels, IGNORE_INDEX)
    lp_ops._validate(
        hidden, weight, train_labels, bias, temperature, IGNORE_INDEX, hidden.device.type == "cpu"
    )
    kept = _trained_positions(loss_mask, trained_positions)
    with torch.no_grad():
        kept_lp = fused_forward_backward(
            hidden.detach().index_select(0, kept),
            weight.detach(),
            train_labels[kept],
            None if bias is None else bias.detach(),
            float(temperature),
            None,
            None,
            None,
            lp_ops._choose_impl(impl, hidden),
        )[0]
        return _scatter(kept_lp, kept, hidden.shape[0])


def _trained_positions(loss_mask: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """Ascending positions [N] int64 of ``loss_mask``'s True entries (``given``, checked)."""
    if given is None:
        return loss_mask.nonzero().squeeze(1)  # output size unknown: a sync on GPUs
    if given.dtype != torch.int64 or given.dim() != 1 or given.device != loss_mask.device:
        raise ValueError(
            f"trained_positions must be a 1-D int64 tensor on {loss_mask.device}, got "
            f"{given.dtype} {tuple(given.shape)} on {given.device}"
        )
    if given.device.type == "cpu" and not torch.equal(given, loss_mask.nonzero().squeeze(1)):
        raise ValueError("trained_positions must list the positions where loss_mask is True")
    return given


def _scatter(values, positions, num_tokens):
    """[T] zeros with ``values`` [N] at ``positions`` (None stays None)."""
    if values is None:
        return None
    return values.new_zeros(num_tokens).index_copy_(0, positions, values)


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
    docstring); for ``ratio_level="sequence"`` (GSPO), or when no gradient is needed, it is
    exactly the composition above. Tokens outside ``loss_mask`` never enter the matmuls of
    the single pass.

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
    _check_options(prox_fn, prox_logprobs, upstream_grad)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    want_entropy = config.entropy_coef != 0 or bool(with_entropy)
    train_labels = torch.where(loss_mask, labels, IGNORE_INDEX)
    if config.ratio_level == "sequence" or not needs_grad:
        loss, stats, tokens = _composed(
            hidden,
            weight,
            train_labels,
            bias,
            temperature,
            impl,
            want_entropy,
            (old_logprobs, advantages, loss_mask, cu_seqlens, config),
            (prox_logprobs, ref_logprobs, engine_logprobs),
            prox_fn,
            trained_positions,
        )
        return (loss, stats, tokens) if return_per_token else (loss, stats)
    lp_ops._validate(
        hidden, weight, train_labels, bias, temperature, IGNORE_INDEX, hidden.device.type == "cpu"
    )
    chosen = lp_ops._choose_impl(impl, hidden)
    acc = lp_ops._acc_dtype(hidden.dtype)
    advantages_t = per_token_advantages(advantages, cu_seqlens, num_tokens)
    weights = aggregation_weights(loss_mask, cu_seqlens, config, acc)
    if upstream_grad is not None:
        weights = weights * float(upstream_grad)
    kept = _trained_positions(loss_mask, trained_positions)
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
        kept_lp, kept_ent, kept_prox, kept_grad_hidden, grad_weight, grad_bias = (
            fused_forward_backward(
                hidden.detach().index_select(0, kept),
                weight.detach(),
                train_labels[kept],
                None if bias is None else bias.detach(),
                float(temperature),
                per_token_inputs,
                weights.index_select(0, kept),
                config,
                chosen,
                want_entropy=want_entropy,
                prox_fn=prox_fn,
                positions=kept,
                head_grads=weight.requires_grad or (bias is not None and bias.requires_grad),
            )
        )
        logprobs = _scatter(kept_lp, kept, num_tokens)
        entropy = _scatter(kept_ent, kept, num_tokens)
        if prox_fn is not None:
            prox_logprobs = _scatter(kept_prox, kept, num_tokens)
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
        hidden,
        weight,
        bias,
        loss,
        grad_hidden,
        grad_weight,
        grad_bias,
        None if upstream_grad is None else float(upstream_grad),
    )
    if not return_per_token:
        return loss, stats
    return loss, stats, FusedLossTokens(logprobs, entropy, prox_logprobs)


def _composed(
    hidden,
    weight,
    train_labels,
    bias,
    temperature,
    impl,
    want_entropy,
    loss_args,
    extras,
    prox_fn,
    trained_positions,
):
    """``linear_logprobs`` + ``grpo_loss`` (GSPO and no-grad calls): (loss, stats, tokens)."""
    old_logprobs, advantages, loss_mask, cu_seqlens, config = loss_args
    prox_logprobs, ref_logprobs, engine_logprobs = extras
    out = linear_logprobs(
        hidden,
        weight,
        train_labels,
        temperature=temperature,
        return_entropy=want_entropy,
        bias=bias,
        impl=impl,
    )
    logprobs, entropy = out if want_entropy else (out, None)
    if prox_fn is not None:
        kept = _trained_positions(loss_mask, trained_positions)
        with torch.no_grad():
            kept_lp = logprobs.detach().index_select(0, kept)
            kept_prox = _call_prox_fn(prox_fn, kept_lp, kept, torch.empty_like(kept_lp))
            prox_logprobs = _scatter(kept_prox, kept, logprobs.shape[0])
    loss_entropy = entropy
    if entropy is not None and config.entropy_coef == 0:
        loss_entropy = entropy.detach()  # logged only: no backward through it
    loss, stats = grpo_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        cu_seqlens,
        config,
        prox_logprobs=prox_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=loss_entropy,
        engine_logprobs=engine_logprobs,
    )
    tokens = FusedLossTokens(
        logprobs.detach(),
        None if entropy is None else entropy.detach(),
        None if prox_logprobs is None else prox_logprobs.detach(),
    )
    return loss, stats, tokens
