"""Triton row epilogues of ``linear_logprobs``: per-token log-prob / entropy / logsumexp
(forward) and the gradient w.r.t. the logits (backward, in place) of one chunk of logits.

The chunk loop in ``areal_fast.ops.logprobs`` forms ``z = hidden_chunk @ weight.T`` ([C, V],
fp32) with torch and hands it to :func:`rows_forward` / :func:`rows_backward_`. Each kernel
runs one program per row and walks the vocabulary in tiles of ``BLOCK_V`` columns, so any V
(odd, or far larger than a tile) is handled with a masked tail.

Numerics (all fp32):

* The forward keeps an online log-sum-exp in the *raw* logit space: the running max ``m`` of
  ``z`` and ``r = Σ_v exp((z_v − m)·inv_temp) − 1``, i.e. the sum with the maximal element's
  exact ``1`` left out, so that ``log s = log1p(r)`` keeps its relative accuracy when one
  token dominates (``r`` ≪ 1). Differences ``z_v − m`` are formed before tempering, so a large
  common offset of the logits cancels exactly. A running ``t = Σ_v exp(d_v)·d_v`` with
  ``d_v = (z_v − m)·inv_temp`` gives the entropy as ``log1p(r) − t / (1 + r)``: no
  ``lse − Σ p·x`` cancellation. Entries with ``exp(d_v) == 0`` (``z_v = −inf``, underflow)
  add exactly 0.
* The backward's label entry uses ``S = Σ_{v≠y} p_v`` in place of ``1 − p_y`` (and
  ``log1p(−S)`` in place of ``x_y − lse`` while ``S < 1/2``), so confident rows
  (``p_y → 1``) keep a relatively accurate gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rows_forward", "rows_backward_"]

_MAX_BLOCK_V = 4096


@triton.jit
def _log1p(x):
    """log(1 + x) for x > −1, relatively accurate for small |x| whatever ``tl.log`` is.

    A degree-6 series below |x| < 1/16 (truncation < 1e-8 relative), ``log(1 + x)`` above.
    """
    small = tl.abs(x) < 0.0625
    series = x * (
        1.0
        + x * (-0.5 + x * (0.3333333333333333 + x * (-0.25 + x * (0.2 - x * 0.16666666666666666))))
    )
    direct = tl.log(tl.where(small, 1.0, 1.0 + x))
    return tl.where(small, series, direct)


@triton.jit
def _linear_logprobs_fwd_kernel(
    z_ptr,
    stride_z,
    labels_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temp,
    ignore_index,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    z_label = tl.load(z_row + tl.where(valid, label, 0)).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)

    m = float("-inf")  # running max of the raw logits z
    r = -1.0  # Σ exp((z − m)·inv_temp) − 1 (the max's own 1 left out); −1 = empty
    t = 0.0  # Σ exp(d)·d with d = (z − m)·inv_temp
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        zt = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(zt, axis=0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite reference
        d = (zt - ref) * inv_temp
        e = tl.exp(d)  # 0 where z = −inf
        top = zt == ref  # entries equal to the max
        n_top = tl.sum(top.to(tl.float32), axis=0)
        rest = tl.sum(tl.where(top, 0.0, e), axis=0)
        moved = m_new > m
        shift = (m - ref) * inv_temp  # ≤ 0; −inf while m is −inf
        alpha = tl.exp(shift)
        if HAS_ENTROPY:
            # Rescale t to the new max: Σ e'·d' = alpha·(t + s·shift), s = 1 + r (0 if empty).
            carried = (1.0 + r) * tl.where(m == float("-inf"), 0.0, shift)
            t = tl.where(moved, alpha * (t + carried), t) + tl.sum(
                e * tl.where(e > 0.0, d, 0.0), axis=0
            )
        # New max: the old max turns into an ordinary entry (alpha) and one new top entry is
        # the implicit 1. Same max: every top entry of the tile is an ordinary 1.
        r = tl.where(moved, alpha * (1.0 + r) + (n_top - 1.0), r + n_top) + rest
        m = m_new

    log_s = _log1p(r)
    tl.store(lse_ptr + row, m * inv_temp + log_s)
    logprob = (z_label - m) * inv_temp - log_s
    tl.store(logprobs_ptr + row, tl.where(valid, logprob, 0.0))
    if HAS_ENTROPY:
        entropy = log_s - t / (1.0 + r)
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))


@triton.jit
def _linear_logprobs_bwd_kernel(
    z_ptr,
    stride_z,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    V,
    inv_temp,
    ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    safe_label = tl.where(valid, label, 0)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    g = tl.where(valid, tl.load(grad_logprobs_ptr + row).to(tl.float32), 0.0)
    if HAS_GRAD_ENTROPY:
        h = tl.where(valid, tl.load(grad_entropy_ptr + row).to(tl.float32), 0.0)
        ent = tl.load(entropy_ptr + row).to(tl.float32)
    # Read before the loop overwrites the row; the loop never stores the label column.
    log_p_label = tl.load(z_row + safe_label).to(tl.float32) * inv_temp - lse
    offs = tl.arange(0, BLOCK_V)
    # Ignored rows read nothing (p = 0 everywhere, so they get zeros). A scalar bound rather
    # than `mask & valid`: the interpreter mistypes a vector & scalar int1.
    read_limit = tl.where(valid, V, 0)

    s_other = 0.0  # S = Σ_{v≠y} p_v
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        in_row = cols < V
        zt = tl.load(z_row + cols, mask=cols < read_limit, other=float("-inf")).to(tl.float32)
        log_p = zt * inv_temp - lse
        p = tl.exp(log_p)
        off_label = cols != safe_label
        s_other += tl.sum(tl.where(off_label & (p > 0.0), p, 0.0), axis=0)
        if HAS_GRAD_ENTROPY:  # log p = −inf only where p = 0: keep 0·(−inf) out
            coef = g + h * (tl.where(p > 0.0, log_p, 0.0) + ent)
        else:
            coef = g
        grad = -p * coef * inv_temp  # p = 0 terms: exactly 0
        tl.store(z_row + cols, grad, mask=in_row & off_label)

    grad_label = g * s_other  # g·(1 − p_y) with 1 − p_y formed as S
    if HAS_GRAD_ENTROPY:
        p_label = tl.exp(log_p_label)
        log_p_acc = tl.where(s_other < 0.5, _log1p(-tl.minimum(s_other, 0.5)), log_p_label)
        grad_label -= h * p_label * tl.where(p_label > 0.0, log_p_acc + ent, 0.0)
    tl.store(z_row + safe_label, tl.where(valid, grad_label * inv_temp, 0.0))


def _launch_config(vocab: int, block_v: int | None, num_warps: int | None) -> tuple[int, int]:
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if num_warps is None:
        num_warps = 4 if block_v <= 1024 else 8
    return block_v, num_warps


def _check_rows(z: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    if z.dim() != 2 or z.dtype != torch.float32:
        raise ValueError(f"z must be a [C, V] float32 tensor, got {tuple(z.shape)} {z.dtype}")
    if z.shape[1] > 1 and z.stride(1) != 1:
        raise ValueError(f"z must have unit stride along V, got strides {z.stride()}")
    if labels.shape != (z.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(
            f"labels must be [C={z.shape[0]}] int64, got {tuple(labels.shape)} {labels.dtype}"
        )
    return z.shape[0], z.shape[1]


def _check_vec(t: torch.Tensor, rows: int, name: str) -> None:
    if t.shape != (rows,) or t.dtype != torch.float32 or (rows > 1 and t.stride(0) != 1):
        raise ValueError(
            f"{name} must be a contiguous [C={rows}] float32 tensor, got "
            f"{tuple(t.shape)} {t.dtype} stride {t.stride()}"
        )


def rows_forward(
    z,
    labels,
    inv_temp: float,
    ignore_index: int,
    logprobs_out,
    entropy_out,
    lse_out,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Log-prob of the label, entropy and logsumexp of each row of a logits chunk.

    With ``x = z · inv_temp`` (tempered logits), ``lse = logsumexp_v(x)`` and
    ``p = exp(x − lse)``, writes for every row ``c``::

        lse_out[c]      = lse                           (every row, ignored ones too)
        logprobs_out[c] = x[labels[c]] − lse            (0 where labels[c] == ignore_index)
        entropy_out[c]  = lse − Σ_v p_v · x_v           (0 where labels[c] == ignore_index)

    Entries with ``p_v == 0`` (e.g. ``x_v = −inf``) contribute 0 to the entropy. One program
    per row walks V in tiles of ``block_v`` with an online log-sum-exp in fp32 (see the
    module docstring for how it stays accurate under large offsets and for confident rows).

    Parameters
    ----------
    z : Tensor [C, V], float32
        Raw (untempered) logits; unit stride along V, any row stride. Not modified.
    labels : Tensor [C], int64
        Label of each row, in ``[0, V)`` or equal to ``ignore_index``.
    inv_temp : float
        ``1 / temperature`` (> 0).
    ignore_index : int
        Label value marking rows whose log-prob and entropy are 0.
    logprobs_out, lse_out : Tensor [C], float32, contiguous
        Written in place (may be views into larger buffers).
    entropy_out : Tensor [C], float32, contiguous, or None
        Written in place; ``None`` skips the entropy work.
    block_v : int, optional
        Vocabulary tile (power of two); default ``min(next_pow2(V), 4096)``.
    num_warps : int, optional
        Warps per program; default 4 for tiles up to 1024 columns, else 8.
    """
    rows, vocab = _check_rows(z, labels)
    _check_vec(logprobs_out, rows, "logprobs_out")
    _check_vec(lse_out, rows, "lse_out")
    if entropy_out is not None:
        _check_vec(entropy_out, rows, "entropy_out")
    if rows == 0:
        return
    block_v, num_warps = _launch_config(vocab, block_v, num_warps)
    has_entropy = entropy_out is not None
    _linear_logprobs_fwd_kernel[(rows,)](
        z,
        z.stride(0),
        labels,
        logprobs_out,
        entropy_out if has_entropy else logprobs_out,  # never dereferenced without entropy
        lse_out,
        vocab,
        float(inv_temp),
        int(ignore_index),
        HAS_ENTROPY=has_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


def rows_backward_(
    z,
    labels,
    lse,
    entropy,
    grad_logprobs,
    grad_entropy,
    inv_temp: float,
    ignore_index: int,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Overwrite a logits chunk with the gradient w.r.t. its raw logits.

    With ``x = z · inv_temp``, ``p = exp(x − lse)``, ``g = grad_logprobs[c]``,
    ``h = grad_entropy[c]`` and ``H = entropy[c]``, row ``c`` becomes ``grad_x · inv_temp``
    where::

        grad_x_v = g · (onehot_v(y) − p_v) − h · p_v · (x_v − lse + H)

    (``y = labels[c]``; terms with ``p_v == 0`` are exactly 0, also for ``x_v = −inf``).
    Rows with ``labels[c] == ignore_index`` become all zeros.

    Accuracy rule for confident rows: the label entry's ``1 − p_y`` is never formed as such
    (it cancels catastrophically when ``p_y ≈ 1``). The kernel accumulates
    ``S = Σ_{v≠y} p_v`` while writing the other entries, then stores the label entry as
    ``(g · S − h · p_y · (log p_y + H)) · inv_temp`` with ``log p_y = log1p(−S)`` while
    ``S < 1/2`` and ``x_y − lse`` otherwise.

    ``p`` is rebuilt from the stored fp32 ``lse``, so its relative accuracy is bounded by
    about ``ulp(|lse|)`` (≈ 1e-3 for logits around 1e4, ≈ 2e-6 around 30).

    Parameters
    ----------
    z : Tensor [C, V], float32
        Raw logits of the chunk (as given to :func:`rows_forward`); unit stride along V, any
        row stride. Overwritten with the gradient w.r.t. the raw logits.
    labels : Tensor [C], int64
    lse : Tensor [C], float32
        ``lse_out`` of :func:`rows_forward`.
    entropy : Tensor [C], float32, or None
        ``entropy_out`` of :func:`rows_forward`; needed when ``grad_entropy`` is given.
    grad_logprobs : Tensor [C], float32
        Upstream gradient of the log-probs.
    grad_entropy : Tensor [C], float32, or None
        Upstream gradient of the entropy; ``None`` counts as zeros (and skips that work).
    inv_temp : float
        ``1 / temperature`` (> 0), as in the forward.
    ignore_index : int
    block_v, num_warps : int, optional
        As in :func:`rows_forward`.
    """
    rows, vocab = _check_rows(z, labels)
    _check_vec(lse, rows, "lse")
    _check_vec(grad_logprobs, rows, "grad_logprobs")
    has_grad_entropy = grad_entropy is not None
    if has_grad_entropy:
        if entropy is None:
            raise ValueError("entropy is required when grad_entropy is given")
        _check_vec(grad_entropy, rows, "grad_entropy")
        _check_vec(entropy, rows, "entropy")
    if rows == 0:
        return
    block_v, num_warps = _launch_config(vocab, block_v, num_warps)
    _linear_logprobs_bwd_kernel[(rows,)](
        z,
        z.stride(0),
        labels,
        lse,
        entropy if has_grad_entropy else lse,  # the stand-ins are never dereferenced
        grad_logprobs,
        grad_entropy if has_grad_entropy else grad_logprobs,
        vocab,
        float(inv_temp),
        int(ignore_index),
        HAS_GRAD_ENTROPY=has_grad_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
