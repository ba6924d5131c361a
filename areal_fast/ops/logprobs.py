"""Token log-probs and entropy through the LM head without materialising [T, V] logits.

``linear_logprobs`` computes, for packed tokens, ``log_softmax((h · Wᵀ + b) / temperature)``
at the label and the entropy of that same distribution, chunk by chunk over tokens: only a
[chunk, V] block of logits exists at any time, in the forward and in the backward (which
recomputes each chunk's logits instead of saving them). Weight and bias gradients accumulate in
fp32 across chunks. This is the torch implementation; fused kernels plug in behind the same
function.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
_CHUNK_BYTES = 256 * 1024 * 1024  # fp32 bytes of one [chunk, V] logits block


def _chunk_size(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk so that one fp32 [chunk, V] block stays within ``_CHUNK_BYTES``."""
    return max(1, min(num_tokens, _CHUNK_BYTES // (4 * vocab)))


def _chunk_logits(hidden, weight, bias, temperature):
    """Tempered logits z = (h·Wᵀ + b) / temperature for one chunk: [C, V].

    ``weight`` is already in the accumulation dtype (fp32, or fp64 for fp64 inputs), so
    half-precision hidden states are upcast per chunk and the logits carry no bf16 rounding.
    """
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias.to(weight.dtype)
    return logits / temperature


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/single precision inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _validate(hidden, weight, labels, bias, temperature, ignore_index):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}], got {tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    valid = labels != ignore_index
    if valid.any():
        picked = labels[valid]
        if int(picked.min()) < 0 or int(picked.max()) >= weight.shape[0]:
            raise ValueError(f"labels hold values outside [0, V={weight.shape[0]}) "
                             f"other than ignore_index")


def linear_logprobs_forward(hidden, weight, labels, bias, temperature, ignore_index):
    """Chunked forward. Returns (logprobs [T] fp32, entropy [T] fp32, logsumexp [T] fp32)."""
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden.dtype)
    weight_acc = weight.to(acc)
    logprobs = hidden.new_zeros(num_tokens, dtype=acc)
    entropy = torch.zeros_like(logprobs)
    lse = torch.zeros_like(logprobs)
    chunk = _chunk_size(num_tokens, vocab)
    for start in range(0, num_tokens, chunk):
        sl = slice(start, start + chunk)
        z = _chunk_logits(hidden[sl], weight_acc, bias, temperature)
        z_lse = torch.logsumexp(z, dim=-1)
        valid = labels[sl] != ignore_index
        safe = torch.where(valid, labels[sl], 0)
        picked = z.gather(1, safe[:, None]).squeeze(1) - z_lse
        probs = torch.softmax(z, dim=-1)
        ent = z_lse - (probs * z).sum(-1)
        logprobs[sl] = torch.where(valid, picked, 0.0)
        entropy[sl] = torch.where(valid, ent, 0.0)
        lse[sl] = z_lse
    return logprobs, entropy, lse


def linear_logprobs_backward(grad_logprobs, grad_entropy, hidden, weight, labels, bias,
                             temperature, ignore_index, lse, entropy):
    """Chunked backward: recompute each chunk's logits; fp32 weight/bias accumulation.

    With z the tempered logits, p = softmax(z), y the label:
    d logp_y / dz = onehot(y) − p;  d H / dz = −p ⊙ (log p + H).
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.zeros_like(hidden)
    acc = _acc_dtype(hidden.dtype)
    weight_acc = weight.to(acc)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    grad_bias = None if bias is None else torch.zeros(vocab, dtype=acc, device=weight.device)
    chunk = _chunk_size(num_tokens, vocab)
    for start in range(0, num_tokens, chunk):
        sl = slice(start, start + chunk)
        valid = labels[sl] != ignore_index
        if not bool(valid.any()):
            continue
        z = _chunk_logits(hidden[sl], weight_acc, bias, temperature)
        logp = z - lse[sl, None]
        probs = logp.exp()
        g_lp = torch.where(valid, grad_logprobs[sl].to(acc), 0.0)
        # d logp_y/dz = onehot(y) − p. The label entry 1 − p_y is formed as Σ_{j≠y} p_j:
        # for confident rows (p_y → 1) that keeps its relative accuracy, where 1 − p_y loses it.
        label_col = torch.where(valid, labels[sl], 0)[:, None]
        grad_z = -probs * g_lp[:, None]
        grad_z.scatter_(1, label_col, 0.0)
        grad_z.scatter_(1, label_col, -grad_z.sum(1, keepdim=True))
        if grad_entropy is not None:
            g_ent = torch.where(valid, grad_entropy[sl].to(acc), 0.0)
            grad_z -= probs * (logp + entropy[sl, None]) * g_ent[:, None]
        grad_logits = grad_z / temperature
        grad_hidden[sl] = (grad_logits @ weight_acc).to(hidden.dtype)
        grad_weight += grad_logits.t() @ hidden[sl].to(acc)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
    grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


class LinearLogprobsFunction(torch.autograd.Function):
    """autograd.Function around the chunked forward/backward launchers."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, temperature, ignore_index):
        logprobs, entropy, lse = linear_logprobs_forward(
            hidden, weight, labels, bias, temperature, ignore_index)
        ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        hidden, weight, labels, bias, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        grad_hidden, grad_weight, grad_bias = linear_logprobs_backward(
            grad_logprobs, grad_entropy, hidden, weight, labels, bias,
            ctx.temperature, ctx.ignore_index, lse, entropy)
        return grad_hidden, grad_weight, None, grad_bias, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    temperature: float = 1.0, return_entropy: bool = False,
                    ignore_index: int = IGNORE_INDEX, bias: torch.Tensor | None = None):
    """Log-prob of each label (and optionally the entropy) under a linear LM head.

    logprobs[t] = log_softmax((hidden[t] · weightᵀ + bias) / temperature)[labels[t]];
    entropy[t] = −Σ_v p_v log p_v of that same tempered distribution. The [T, V] logits are
    never materialised: tokens are processed in chunks of a [chunk, V] fp32 block (≤ 256 MiB),
    and the backward recomputes each chunk's logits. Extra memory is O(T + chunk·V).

    Parameters
    ----------
    hidden : Tensor [T, H], float32 | bfloat16 | float16 (float64 accepted for reference checks)
        Final hidden states of the packed tokens.
    weight : Tensor [V, H], same dtype as ``hidden``
        LM-head (output embedding) weight.
    labels : Tensor [T], int64
        Token whose log-prob is wanted at each position; ``ignore_index`` marks positions
        that give logprob 0 and entropy 0 and receive zero gradient.
    temperature : float, > 0
        Sampling temperature the log-probs are taken at.
    return_entropy : bool
        Also return the entropy.
    ignore_index : int
        Label value to skip (default -100, as in ``torch.nn.functional.cross_entropy``).
    bias : Tensor [V], optional
        LM-head bias.

    Returns
    -------
    Tensor [T] float32, or (Tensor [T] float32, Tensor [T] float32)
        (float64 for float64 inputs). ``logprobs`` (nats), or ``(logprobs, entropy)`` when ``return_entropy``. Both are
        differentiable w.r.t. ``hidden``, ``weight`` and ``bias``; weight gradients accumulate
        in fp32 across chunks.

    Raises
    ------
    ValueError, TypeError
        On shape, dtype or label-range mismatches, naming the offending tensor.

    Notes
    -----
    Gradients: d logp_y/dz = onehot(y) − softmax(z), d H/dz = −p ⊙ (log p + H), with z the
    tempered logits (standard softmax calculus; the same quantities as
    ``torch.nn.functional.cross_entropy`` with ``reduction='none'``, negated).
    """
    _validate(hidden, weight, labels, bias, temperature, ignore_index)
    logprobs, entropy, _ = LinearLogprobsFunction.apply(
        hidden, weight, labels, bias, float(temperature), int(ignore_index))
    return (logprobs, entropy) if return_entropy else logprobs
