"""Per-sequence sums over a packed batch.

``segment_sum(values_T, cu_seqlens_B1)`` returns, for each of the B packed
sequences, the fp32 sum of its tokens' values (e.g. per-sequence loss or
log-prob totals). On CUDA tensors it runs the kernel in
``csrc/cuda/segment_sum.cu`` (one thread block per sequence, fp32
accumulation) when the extension was built with CUDA; elsewhere it uses a
float64 prefix-sum difference in torch. The backward broadcasts each
sequence's gradient to its tokens.
"""

from __future__ import annotations

import functools
import warnings

import torch

from areal_fast._native import load_native

__all__ = ["segment_sum", "segment_sum_forward", "segment_sum_backward", "SegmentSum"]

_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT32_MAX = 2**31 - 1
_cuda_kernel_failed = False


def _check_inputs(values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, check_offsets: bool):
    if not isinstance(values_T, torch.Tensor) or not isinstance(cu_seqlens_B1, torch.Tensor):
        raise TypeError("values_T and cu_seqlens_B1 must be torch tensors")
    if values_T.dtype not in _VALUE_DTYPES:
        raise TypeError(
            f"values_T must be float32, float16, bfloat16 or float64, got {values_T.dtype}"
        )
    if cu_seqlens_B1.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens_B1 must be int32 or int64, got {cu_seqlens_B1.dtype}")
    if values_T.dim() != 1:
        raise ValueError(f"values_T must be 1-D [T], got shape {tuple(values_T.shape)}")
    if cu_seqlens_B1.dim() != 1 or cu_seqlens_B1.numel() == 0:
        raise ValueError(
            f"cu_seqlens_B1 must be 1-D [B + 1] with B >= 0, got shape {tuple(cu_seqlens_B1.shape)}"
        )
    if cu_seqlens_B1.device != values_T.device:
        raise ValueError(
            f"cu_seqlens_B1 is on {cu_seqlens_B1.device} but values_T is on {values_T.device}"
        )
    if values_T.shape[0] > _INT32_MAX:
        raise ValueError(f"values_T has {values_T.shape[0]} tokens, more than int32 offsets allow")
    if not check_offsets:
        return
    cu = cu_seqlens_B1
    first, last = cu[0], cu[-1]
    decreasing = (cu[1:] < cu[:-1]).any()
    first, last, decreasing = torch.stack(
        [first.to(torch.int64), last.to(torch.int64), decreasing.to(torch.int64)]
    ).tolist()  # one device sync for the three checks
    if first != 0:
        raise ValueError(f"cu_seqlens_B1[0] must be 0, got {first}")
    if decreasing:
        raise ValueError("cu_seqlens_B1 must be non-decreasing")
    if last != values_T.shape[0]:
        raise ValueError(
            f"cu_seqlens_B1[-1] = {last} must equal values_T.shape[0] = {values_T.shape[0]}"
        )


@functools.lru_cache(maxsize=None)
def _device_supported(index: int) -> bool:
    # The kernels carry sm_80 / sm_90 code and compute_90 PTX.
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _native_cuda():
    """The extension when it can run the CUDA kernel, else None."""
    if _cuda_kernel_failed:
        return None
    native = load_native()
    if native is None or not getattr(native, "has_cuda", False):
        return None
    return native


def _segment_sum_cuda(native, values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    values = values_T.contiguous()
    cu = cu_seqlens_B1.to(torch.int32).contiguous()
    num_segments = cu.shape[0] - 1
    out = torch.empty(num_segments, dtype=torch.float32, device=values.device)
    if num_segments == 0:
        return out
    code = native.SEGMENT_SUM_DTYPE_CODES[str(values.dtype).removeprefix("torch.")]
    with torch.cuda.device(values.device):
        stream = torch.cuda.current_stream(values.device).cuda_stream
        native.segment_sum_cuda(
            values.data_ptr(), code, cu.data_ptr(), num_segments, out.data_ptr(), stream
        )
    return out


def _segment_sum_torch(values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    """Prefix-sum difference; float64 accumulation (float32 where float64 is missing)."""
    acc = torch.float32 if values_T.device.type == "mps" else torch.float64
    prefix = torch.zeros(values_T.shape[0] + 1, dtype=acc, device=values_T.device)
    torch.cumsum(values_T.to(acc), 0, out=prefix[1:])
    cu = cu_seqlens_B1.to(torch.int64)
    out_dtype = torch.float64 if values_T.dtype == torch.float64 else torch.float32
    return (prefix[cu[1:]] - prefix[cu[:-1]]).to(out_dtype)


def segment_sum_forward(values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    """Forward launcher: out[b] = sum(values_T[cu_seqlens_B1[b]:cu_seqlens_B1[b + 1]]).

    Inputs are assumed valid (see :func:`segment_sum`). Returns [B] float32 (float64 for
    float64 input, always through torch).
    """
    global _cuda_kernel_failed
    if values_T.is_cuda and values_T.dtype != torch.float64:
        native = _native_cuda()
        if native is not None and _device_supported(values_T.device.index):
            try:
                return _segment_sum_cuda(native, values_T, cu_seqlens_B1)
            except RuntimeError as exc:
                # E.g. a driver older than the CUDA runtime the wheel was built with.
                _cuda_kernel_failed = True
                warnings.warn(
                    f"areal_fast segment_sum CUDA kernel failed ({exc}); using the "
                    f"torch implementation from now on.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return _segment_sum_torch(values_T, cu_seqlens_B1)


def segment_sum_backward(
    grad_out_B: torch.Tensor, cu_seqlens_B1: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """Backward launcher: grad_values[t] = grad_out[b] for every token t of sequence b.

    Returns [T] in ``dtype`` (the dtype of ``values_T``).
    """
    lengths = (cu_seqlens_B1[1:] - cu_seqlens_B1[:-1]).to(torch.int64)
    grad = torch.repeat_interleave(grad_out_B, lengths, output_size=num_tokens)
    return grad.to(dtype)


class SegmentSum(torch.autograd.Function):
    """Autograd wrapper; differentiable with respect to ``values_T`` only."""

    @staticmethod
    def forward(ctx, values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
        out = segment_sum_forward(values_T, cu_seqlens_B1)
        ctx.save_for_backward(cu_seqlens_B1)
        ctx.num_tokens = values_T.shape[0]
        ctx.values_dtype = values_T.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out_B: torch.Tensor):
        (cu_seqlens_B1,) = ctx.saved_tensors
        grad_values = None
        if ctx.needs_input_grad[0]:
            grad_values = segment_sum_backward(
                grad_out_B, cu_seqlens_B1, ctx.num_tokens, ctx.values_dtype
            )
        return grad_values, None


def segment_sum(
    values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, *, check_offsets: bool = True
) -> torch.Tensor:
    """Sum the values of each packed sequence.

    Parameters
    ----------
    values_T : torch.Tensor, shape [T], float32 | float16 | bfloat16 | float64
        One value per token of B concatenated sequences (float64 is for reference
        checks and always takes the torch path).
    cu_seqlens_B1 : torch.Tensor, shape [B + 1], int32 (int64 accepted)
        Sequence offsets on the device of ``values_T``: ``cu_seqlens_B1[0] = 0``,
        non-decreasing, ``cu_seqlens_B1[-1] = T``. Empty sequences are allowed.
    check_offsets : bool
        Validate the offsets' values (one device sync on CUDA). Pass False
        only for offsets known to be valid: the CUDA kernel does not bounds-check.

    Returns
    -------
    torch.Tensor, shape [B], float32 (float64 for float64 input)
        ``out[b] = sum(values_T[cu_seqlens_B1[b]:cu_seqlens_B1[b + 1]])``,
        accumulated in fp32 on the CUDA path and fp64 in the torch path; 0 for
        an empty sequence. Differentiable w.r.t. ``values_T``: the gradient of
        token t in sequence b is ``grad_out[b]`` (cast to ``values_T.dtype``).

    Raises
    ------
    TypeError
        Unsupported dtype of ``values_T`` or ``cu_seqlens_B1``.
    ValueError
        Wrong ranks, different devices, or offsets that do not start at 0,
        decrease, or do not end at T.
    """
    _check_inputs(values_T, cu_seqlens_B1, check_offsets)
    return SegmentSum.apply(values_T, cu_seqlens_B1)
