"""Tests for areal_fast.ops.segment.segment_sum against a float64 reference.

The CPU cases run the torch implementation; the CUDA cases (skipped without a GPU)
run the native kernel when areal_fast._C was built with CUDA. Values are fresh random
numbers every run (seed in the failure message).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from types import SimpleNamespace

import pytest
import torch

from areal_fast.ops import segment
from areal_fast.ops.segment import segment_sum

try:
    _C = importlib.import_module("areal_fast._C")
except ImportError:
    _C = None

DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
)
# (dtype, rtol, atol) for comparing with a float64 sum of the same (rounded) inputs.
DTYPES = [(torch.float32, 1e-5, 1e-4), (torch.float16, 1e-5, 1e-3), (torch.bfloat16, 1e-5, 1e-3)]
LENGTH_CASES = [
    [1],
    [0],
    [5, 0, 123, 1, 0],
    [1003, 7, 0, 0, 4097, 31, 256, 257],
    [0, 0, 0],
    [],
    [70001, 3],
]


def _reference(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """float64 sum of each segment, one plain slice at a time."""
    out, start = [], 0
    v = values.detach().cpu().double()
    for n in lengths:
        out.append(v[start : start + n].sum())
        start += n
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def _cu(lengths: list[int], device, dtype=torch.int32) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return cu.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, rtol, atol", DTYPES)
@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=lambda ls: f"B{len(ls)}_T{sum(ls)}")
def test_forward_matches_float64_reference(device, dtype, rtol, atol, lengths, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    values = torch.randn(sum(lengths), generator=gen).to(dtype).to(device)
    out = segment_sum(values, _cu(lengths, device))
    assert out.dtype == torch.float32
    assert out.shape == (len(lengths),)
    assert out.device == values.device
    expected = _reference(values, lengths)
    tol = atol * max(1.0, max(lengths, default=1) ** 0.5)
    torch.testing.assert_close(
        out.cpu().double(), expected, rtol=rtol, atol=tol, msg=lambda m: f"{m} (seed {fresh_seed})"
    )
    for b, n in enumerate(lengths):
        if n == 0:
            assert out[b].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradient_matches_float64_reference(device, dtype, fresh_seed):
    lengths = [3, 0, 17, 1, 250, 0, 9]
    gen = torch.Generator().manual_seed(fresh_seed)
    base = torch.randn(sum(lengths), generator=gen)
    values = base.to(dtype).to(device).requires_grad_(True)
    grad_out = torch.randn(len(lengths), generator=gen)

    out = segment_sum(values, _cu(lengths, device))
    (out * grad_out.to(device)).sum().backward()

    ref_values = values.detach().cpu().double().requires_grad_(True)
    ref_out = torch.stack([s.sum() for s in torch.split(ref_values, lengths)])
    (ref_out * grad_out.double()).sum().backward()

    assert values.grad.dtype == dtype
    assert values.grad.shape == values.shape
    torch.testing.assert_close(
        values.grad.cpu().double(),
        ref_values.grad,
        rtol=1e-2 if dtype != torch.float32 else 1e-6,
        atol=1e-6,
        msg=lambda m: f"{m} (seed {fresh_seed})",
    )


def test_int64_offsets_and_non_contiguous_values():
    lengths = [4, 0, 6]
    storage = torch.arange(20, dtype=torch.float32)
    values = storage[::2]  # stride 2, T = 10
    out = segment_sum(values, _cu(lengths, "cpu", torch.int64))
    assert out.tolist() == [0 + 2 + 4 + 6, 0.0, 8 + 10 + 12 + 14 + 16 + 18]


def test_float64_stays_float64(fresh_seed):
    values = torch.randn(9, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    out = segment_sum(values, cu)
    assert out.dtype == torch.float64
    # prefix-sum differences round differently from direct sums: compare at float64 precision
    want = torch.stack([values[:2].sum(), values[2:2].sum(), values[2:].sum()])
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert torch.equal(values.grad, torch.ones(9, dtype=torch.float64))


def test_large_magnitudes_keep_precision():
    # 1e8 + 1 is exact in float64 accumulation, lost in a float32 running sum.
    values = torch.tensor([1e8, 1.0, -1e8, 3.0, 4.0], dtype=torch.float32)
    out = segment_sum(values, torch.tensor([0, 3, 5], dtype=torch.int32))
    assert out.tolist() == [1.0, 7.0]


@pytest.mark.parametrize(
    "values, cu, exc, message",
    [
        (
            torch.ones(4, dtype=torch.int64),
            torch.tensor([0, 4], dtype=torch.int32),
            TypeError,
            "values_T must be float32, float16, bfloat16 or float64",
        ),
        (
            torch.ones(4),
            torch.tensor([0, 4], dtype=torch.float32),
            TypeError,
            "cu_seqlens_B1 must be int32 or int64",
        ),
        (
            torch.ones(2, 2),
            torch.tensor([0, 4], dtype=torch.int32),
            ValueError,
            "values_T must be 1-D",
        ),
        (torch.ones(4), torch.zeros(0, dtype=torch.int32), ValueError, "cu_seqlens_B1 must be 1-D"),
        (
            torch.ones(4),
            torch.tensor([1, 4], dtype=torch.int32),
            ValueError,
            "cu_seqlens_B1[0] must be 0, got 1",
        ),
        (
            torch.ones(4),
            torch.tensor([0, 3, 2, 4], dtype=torch.int32),
            ValueError,
            "cu_seqlens_B1 must be non-decreasing",
        ),
        (
            torch.ones(4),
            torch.tensor([0, 1, 3], dtype=torch.int32),
            ValueError,
            "cu_seqlens_B1[-1] = 3 must equal values_T.shape[0] = 4",
        ),
    ],
)
def test_bad_inputs_raise(values, cu, exc, message):
    with pytest.raises(exc) as info:
        segment_sum(values, cu)
    assert message in str(info.value)


class _PointerReadingNative:
    """Stands in for _C on the CPU: reads the raw pointers the CUDA launcher is given."""

    has_cuda = True
    SEGMENT_SUM_DTYPE_CODES = (
        _C.SEGMENT_SUM_DTYPE_CODES
        if _C is not None
        else {"float32": 0, "float16": 1, "bfloat16": 2}
    )

    def __init__(self):
        self.calls = []

    def segment_sum_cuda(
        self, values_ptr, dtype_code, cu_seqlens_ptr, num_segments, out_ptr, stream
    ):
        self.calls.append((dtype_code, num_segments, stream))
        cu = list((ctypes.c_int32 * (num_segments + 1)).from_address(cu_seqlens_ptr))
        names = {code: name for name, code in self.SEGMENT_SUM_DTYPE_CODES.items()}
        dtype = getattr(torch, names[dtype_code])
        size = torch.empty(0, dtype=dtype).element_size()
        raw = (
            bytearray((ctypes.c_char * (cu[-1] * size)).from_address(values_ptr))
            if cu[-1]
            else bytearray()
        )
        values = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        out = (ctypes.c_float * num_segments).from_address(out_ptr)
        for b in range(num_segments):
            out[b] = float(values[cu[b] : cu[b + 1]].double().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_launcher_passes_pointers_codes_and_stream(monkeypatch, dtype, fresh_seed):
    """The Python side of the CUDA path, checked on the CPU with a pointer-reading stand-in."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0xABC)
    )
    fake = _PointerReadingNative()
    lengths = [7, 0, 130, 1]
    gen = torch.Generator().manual_seed(fresh_seed)
    values = torch.randn(2 * sum(lengths), generator=gen).to(dtype)[::2]  # non-contiguous
    out = segment._segment_sum_cuda(fake, values, _cu(lengths, "cpu", torch.int64))
    assert fake.calls == [(fake.SEGMENT_SUM_DTYPE_CODES[str(dtype)[6:]], 4, 0xABC)]
    assert out.dtype == torch.float32 and out.shape == (4,)
    torch.testing.assert_close(
        out.double(),
        _reference(values, lengths),
        rtol=1e-6,
        atol=1e-5,
        msg=lambda m: f"{m} (seed {fresh_seed})",
    )
    empty = segment._segment_sum_cuda(fake, values[:0], torch.zeros(1, dtype=torch.int32))
    assert empty.shape == (0,) and len(fake.calls) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_raises():
    with pytest.raises(ValueError, match="cu_seqlens_B1 is on cpu"):
        segment_sum(torch.ones(4, device="cuda"), torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_uses_native_kernel(monkeypatch, fresh_seed):
    if _C is None or not _C.has_cuda:
        pytest.skip("areal_fast._C was built without CUDA")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the kernels target sm_80 and newer")
    calls = []
    original = segment._segment_sum_cuda
    monkeypatch.setattr(
        segment, "_segment_sum_cuda", lambda *args: calls.append(1) or original(*args)
    )
    lengths = [31, 0, 4099, 1]
    values = torch.randn(sum(lengths), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = segment_sum(values, _cu(lengths, "cuda"))
    stream.synchronize()
    assert calls == [1]
    assert not segment._cuda_kernel_failed
    torch.testing.assert_close(
        out.cpu().double(),
        _reference(values, lengths),
        rtol=1e-5,
        atol=1e-3,
        msg=lambda m: f"{m} (seed {fresh_seed})",
    )
