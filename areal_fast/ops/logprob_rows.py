"""Row epilogues of the chunked log-prob computation: torch, native C++ and Triton.

The chunk loop in :mod:`areal_fast.ops.logprobs` forms the raw LM-head logits z [C, V] of C
tokens with one matmul and hands them to a row epilogue. With x = z · inv_temp, lse =
logsumexp(x) and p = softmax(x), every backend computes exactly this:

- ``forward(z, labels, inv_temp, ignore_index, logprobs_out, entropy_out, lse_out)`` writes
  lse_out = lse, logprobs_out = x[y] − lse and entropy_out = lse − Σ_v p_v x_v (entries with
  p_v = 0, such as x_v = −inf, contribute 0); rows labelled ``ignore_index`` get logprob 0 and
  entropy 0. ``entropy_out`` may be None.
- ``backward_(z, labels, lse, entropy, grad_logprobs, grad_entropy, inv_temp, ignore_index)``
  overwrites z with d(g·logprob + h·entropy)/dz = inv_temp · (g·(onehot(y) − p) −
  h·p ⊙ (x − lse + H)); the label entry's 1 − p_y is formed as Σ_{v≠y} p_v, which keeps its
  relative accuracy when p_y → 1. Ignored rows become zeros. ``entropy``/``grad_entropy`` may
  be None (no entropy term).

Backends: ``torch`` (any device and dtype; the fallback), ``native`` (``areal_fast._C``, CPU
float32, rows kept in L2 with vectorised exp, multi-threaded), ``triton``
(``areal_fast.kernels.linear_logprobs``, CUDA or ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from areal_fast._native import load_native


class RowBackend(NamedTuple):
    """The forward and in-place backward row epilogues of one implementation."""

    forward: Callable[..., None]
    backward_: Callable[..., None]


def torch_rows_forward(z, labels, inv_temp, ignore_index, logprobs_out, entropy_out, lse_out):
    """Row epilogue forward in torch ops (see the module docstring)."""
    shifted = z * inv_temp
    row_max = shifted.amax(1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    shifted.sub_(row_max)  # d = x − max ≤ 0
    exp = shifted.exp()
    # Σ exp(d) − 1 with the entries at the maximum (d = 0, exp = 1) counted apart, so
    # log1p of it stays accurate when one entry dominates the row
    rest = torch.where(shifted < 0, exp, 0.0).sum(1) + ((shifted == 0).sum(1) - 1)
    sum_exp = 1.0 + rest
    log_sum = torch.log1p(rest)
    lse_out.copy_(row_max.squeeze(1) + log_sum)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)[:, None]
    picked = shifted.gather(1, safe).squeeze(1) - log_sum
    logprobs_out.copy_(torch.where(valid, picked, 0.0))
    if entropy_out is not None:
        weighted = torch.where(exp > 0, exp * shifted, 0.0).sum(1)
        entropy_out.copy_(torch.where(valid, log_sum - weighted / sum_exp, 0.0))


def torch_rows_backward_(
    z, labels, lse, entropy, grad_logprobs, grad_entropy, inv_temp, ignore_index
):
    """Row epilogue backward in torch ops, overwriting ``z`` (see the module docstring)."""
    valid = labels != ignore_index
    label_col = torch.where(valid, labels, 0)[:, None]
    dev = z.mul_(inv_temp).sub_(lse[:, None])  # x − lse, in place
    probs = dev.exp()
    g = torch.where(valid, grad_logprobs.to(z.dtype), 0.0)[:, None]
    dev_label = dev.gather(1, label_col)
    p_label = probs.gather(1, label_col)
    probs.scatter_(1, label_col, 0.0)
    others = probs.sum(1, keepdim=True)
    grad = probs * -g
    label_grad = g * others
    if grad_entropy is not None:
        h = torch.where(valid, grad_entropy.to(z.dtype), 0.0)[:, None]
        ent = entropy.to(z.dtype)[:, None]
        grad -= torch.where(probs > 0, probs * (dev + ent), 0.0) * h
        # confident rows: x_y − lse = log1p(−Σ_{v≠y} p_v), accurate where the difference of
        # two nearly equal fp32 numbers is not
        confident = others < 0.5
        dev_label = torch.where(confident, torch.log1p(-others), dev_label)
        p_label = torch.where(confident, 1.0 - others, p_label)
        label_grad -= torch.where(p_label > 0, p_label * (dev_label + ent), 0.0) * h
    grad.scatter_(1, label_col, label_grad)
    z.copy_(torch.where(valid[:, None], grad * inv_temp, 0.0))


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def native_rows_forward(z, labels, inv_temp, ignore_index, logprobs_out, entropy_out, lse_out):
    """Row epilogue forward through ``areal_fast._C`` (CPU, float32)."""
    _check_native(z, labels, logprobs_out, entropy_out, lse_out)
    load_native().logprob_rows_forward(
        z.data_ptr(),
        z.shape[0],
        z.shape[1],
        z.stride(0),
        labels.data_ptr(),
        float(inv_temp),
        int(ignore_index),
        logprobs_out.data_ptr(),
        _address(entropy_out),
        lse_out.data_ptr(),
        torch.get_num_threads(),
    )


def native_rows_backward_(
    z, labels, lse, entropy, grad_logprobs, grad_entropy, inv_temp, ignore_index
):
    """Row epilogue backward through ``areal_fast._C`` (CPU, float32), overwriting ``z``."""
    grad_logprobs = grad_logprobs.to(torch.float32).contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(torch.float32).contiguous()
    _check_native(z, labels, lse, entropy, grad_logprobs, grad_entropy)
    load_native().logprob_rows_backward(
        z.data_ptr(),
        z.shape[0],
        z.shape[1],
        z.stride(0),
        labels.data_ptr(),
        lse.data_ptr(),
        _address(entropy),
        grad_logprobs.data_ptr(),
        _address(grad_entropy),
        float(inv_temp),
        int(ignore_index),
        torch.get_num_threads(),
    )


def _check_native(z, labels, *vectors):
    assert z.device.type == "cpu" and z.dtype == torch.float32 and z.stride(1) == 1
    assert labels.dtype == torch.int64 and labels.is_contiguous()
    for vector in vectors:
        assert vector is None or (
            vector.dtype == torch.float32
            and vector.is_contiguous()
            and vector.shape == (z.shape[0],)
        )


def row_backend(impl: str) -> RowBackend:
    """The row epilogues of ``impl`` ("torch", "native" or "triton", already resolved)."""
    if impl == "native":
        return RowBackend(native_rows_forward, native_rows_backward_)
    if impl == "triton":
        from areal_fast.kernels import linear_logprobs as triton_rows

        return RowBackend(triton_rows.rows_forward, triton_rows.rows_backward_)
    return RowBackend(torch_rows_forward, torch_rows_backward_)
