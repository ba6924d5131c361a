"""One pass over the vocabulary: log-probs, entropy and the LM-head gradients of a per-token loss.

A loss whose per-token terms ℓ_t depend on token t alone and whose aggregation is a fixed
weighted sum Σ_t c_t ℓ_t has, for each chunk of tokens, dℓ/dlogp and dℓ/dentropy as soon as
that chunk's log-probs are known. :func:`fused_forward_backward` runs the chunked LM head
once: per chunk it forms the [chunk, V] logits, the row epilogue's log-probs and entropy,
asks the caller's ``chunk_grads`` for those two gradients, overwrites the logits with their
gradient (the row epilogue's backward) and pushes it through the two gradient matmuls at
once. Three [chunk, V]-sized matmuls per chunk instead of four, no [T, V] tensor.
:class:`FusedLinearLossFunction` then hands the stored gradients to autograd.

The GRPO-family loss built on this pass is :func:`areal_fast.rl.fused_loss.fused_linear_grpo_loss`
(the objective is rl's; the pass knows no loss). :func:`fused_pass_logprobs` is the pass's
forward alone, for the no-grad log-probs a trainer must match to its gradient pass.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from areal_fast.ops import logprobs as lp_ops
from areal_fast.ops.logits_cache import cache_budget_bytes
from areal_fast.ops.logprob_rows import row_backend
from areal_fast.ops.logprobs import IGNORE_INDEX

# (chunk slice, logprobs [C], entropy [C] or None) -> (d loss / d logprobs [C], d loss /
# d entropy [C] or None: the entropy is not in the loss)
ChunkGrads = Callable[
    [slice, torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, Optional[torch.Tensor]]
]

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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    impl: str,
    *,
    chunk_grads: ChunkGrads | None = None,
    want_entropy: bool = False,
    head_grads: bool = True,
):
    """One pass: log-probs and entropy [T], and the gradients of the caller's loss w.r.t.
    ``hidden``, ``weight`` and ``bias``.

    Parameters
    ----------
    hidden : Tensor [T, H]; weight : Tensor [V, H]; labels : Tensor [T] int64; bias : [V] or None
        Every token is processed (no ``ignore_index`` labels here: the caller selects them).
    temperature : float, > 0
    impl : str
        A resolved row-epilogue implementation (:mod:`areal_fast.ops.logprob_rows`).
    chunk_grads : ChunkGrads, optional
        Called once per chunk, in order, with the chunk's slice and its log-probs and entropy
        (accumulation dtype, detached; entropy None unless ``want_entropy``); returns the
        loss's gradients w.r.t. them, the entropy's None when the entropy is not in the
        loss. None: the forward alone (no gradients).
    want_entropy : bool
        Compute the entropy in the row epilogue.
    head_grads : bool
        False: no weight and bias gradients (a frozen LM head, e.g. under LoRA: one [V, H]
        matmul per chunk less).

    Returns
    -------
    (logprobs [T], entropy [T] or None, grad_hidden, grad_weight, grad_bias)
        In the accumulation dtype (float32; float64 for float64 inputs); the gradients None
        without ``chunk_grads`` (and weight/bias ones without ``head_grads`` or a bias).
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = lp_ops._acc_dtype(hidden.dtype)
    rows = row_backend(impl)
    weight_mm = lp_ops._matmul_weight(weight, acc)
    logprobs = hidden.new_empty(num_tokens, dtype=acc)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    lse = torch.empty_like(logprobs)
    grad_hidden = grad_weight = grad_bias = None
    if chunk_grads is not None:
        grad_hidden = torch.empty_like(hidden)
    if chunk_grads is not None and head_grads:
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
        if chunk_grads is None:
            continue
        g_lp, g_ent = chunk_grads(sl, logprobs[sl], chunk_entropy)
        loss_entropy = None if g_ent is None else chunk_entropy
        rows.backward_(z, labels[sl], lse[sl], loss_entropy, g_lp, g_ent, inv_temp, IGNORE_INDEX)
        lp_ops.push_chunk_gradient(
            z, hidden_chunk, weight_mm, acc, sl, grad_hidden, grad_weight, grad_bias
        )
    return logprobs, entropy, grad_hidden, grad_weight, grad_bias


class FusedLinearLossFunction(torch.autograd.Function):
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
    """Log-probs of the trained tokens exactly as :func:`~areal_fast.fused_linear_grpo_loss`
    forms them.

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
        As in :func:`~areal_fast.fused_linear_grpo_loss`.

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
    kept = trained_positions_of(loss_mask, trained_positions)
    with torch.no_grad():
        kept_lp = fused_forward_backward(
            hidden.detach().index_select(0, kept),
            weight.detach(),
            train_labels[kept],
            None if bias is None else bias.detach(),
            float(temperature),
            lp_ops._choose_impl(impl, hidden),
        )[0]
        return scatter_tokens(kept_lp, kept, hidden.shape[0])


def trained_positions_of(loss_mask: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """Ascending positions [N] int64 of ``loss_mask``'s True entries (``given``, checked).

    Raises
    ------
    ValueError
        ``given`` is not a 1-D int64 tensor on ``loss_mask``'s device, or (CPU tensors) does
        not list exactly the True positions.
    """
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


def scatter_tokens(values, positions, num_tokens):
    """[T] zeros with ``values`` [N] at ``positions`` [N] int64 (None stays None)."""
    if values is None:
        return None
    return values.new_zeros(num_tokens).index_copy_(0, positions, values)
