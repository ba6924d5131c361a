"""Tests for areal_fast.sync.buckets: the bucket planner (C++ and its pure-Python twin) and
pack/unpack (native CPU threads, the CUDA kernel, and the torch fallback).

Plans are checked against the layout rules, not against stored answers; tensor contents
are fresh random bit patterns every run (seed in the failure message), and casts are
compared bit for bit with torch's ``.to(dtype)``.
"""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fast import _native
from areal_fast.sync import buckets as B
from areal_fast.sync.buckets import (
    ALIGNMENT,
    WIRE_DTYPES,
    BucketPlan,
    Chunk,
    TensorSpec,
    bucket_view,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)

try:
    _C = importlib.import_module("areal_fast._C")
except ImportError:
    _C = None

needs_native = pytest.mark.skipif(
    _C is None or not hasattr(_C, "plan_buckets"), reason="areal_fast._C with buckets is not built"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
IMPLS = ["native", "torch"]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run a test with the extension ("native") and with it disabled ("torch")."""
    if request.param == "native":
        if _C is None or not hasattr(_C, "bucket_copy"):
            pytest.skip("areal_fast._C with buckets is not built")
        monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(_native.DISABLE_ENV, "1")
    return request.param


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def random_bits(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (floats include NaN, Inf and
    subnormals); bool gets random True/False."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    size = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, device=device)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical except NaNs, which must be NaN in both (torch's NaN bits depend on the
    code path, sign included)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a_nan, e_nan = actual.isnan().reshape(-1), expected.isnan().reshape(-1)
    assert torch.equal(a_nan, e_nan)
    a_bits, e_bits = bits(actual), bits(expected)
    mismatch = (a_bits != e_bits) & ~e_nan
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} mismatches, first at {mismatch.nonzero()[0].item()}: "
        f"{a_bits[mismatch][0].item():#x} vs {e_bits[mismatch][0].item():#x}"
    )


def check_plan(plan: BucketPlan) -> None:
    """Every layout property of the planner's contract."""
    specs, bb = plan.specs, plan.bucket_bytes
    assert bb > 0 and bb % ALIGNMENT == 0
    assert plan.num_buckets == len(plan.bucket_sizes)
    assert plan.total_bytes == sum(plan.bucket_sizes)
    if not specs:
        assert plan.chunks == () and plan.num_buckets == 0
        return
    # chunks in order: (bucket, offset) non-decreasing, tensors non-decreasing
    keys = [(c.bucket, c.offset) for c in plan.chunks]
    assert keys == sorted(keys)
    assert [c.tensor for c in plan.chunks] == sorted(c.tensor for c in plan.chunks)
    ends = {}
    for c in plan.chunks:
        spec = specs[c.tensor]
        end = c.offset + c.numel * spec.itemsize
        assert c.offset % ALIGNMENT == 0
        assert 0 <= c.offset and end <= plan.bucket_sizes[c.bucket] <= bb
        ends.setdefault(c.bucket, []).append((c.offset, end))
    # every bucket holds a chunk; its size is its last chunk's end; no overlap
    by_bucket, by_tensor = {}, {}  # one pass (plans with many chunks stay linear to check)
    for c in plan.chunks:
        by_bucket.setdefault(c.bucket, []).append(c)
        by_tensor.setdefault(c.tensor, []).append(c)
    assert sorted(ends) == list(range(plan.num_buckets))
    for k, ranges in ends.items():
        assert plan.bucket_sizes[k] == ranges[-1][1]
        for (_, end), (nxt, _) in zip(ranges, ranges[1:]):
            assert end <= nxt
        assert plan.bucket_chunks(k) == tuple(by_bucket[k])
    # every element of every tensor exactly once, in element order
    for i, spec in enumerate(specs):
        mine = by_tensor.get(i, [])
        assert mine, f"tensor {i} has no chunk"
        if spec.numel == 0:
            assert len(mine) == 1 and mine[0].numel == 0 and mine[0].start == 0
            continue
        assert all(c.numel > 0 for c in mine)
        covered = 0
        for c in mine:
            assert c.start == covered
            covered += c.numel
        assert covered == spec.numel
        if spec.nbytes <= bb:
            assert len(mine) == 1  # never split when it fits in one bucket
        else:  # pieces fill whole buckets, consecutive, starting at offset 0
            assert all(c.offset == 0 for c in mine)
            assert [c.bucket for c in mine] == list(
                range(mine[0].bucket, mine[0].bucket + len(mine))
            )
            assert all(c.numel * spec.itemsize == bb for c in mine[:-1])

    # greedy: a whole tensor opens a new bucket only if it did not fit in the previous one
    def solo(chunk):  # under solo_bytes, a fresh bucket also follows a solo tensor
        return plan.solo_bytes and (
            chunk.numel == 0 or specs[chunk.tensor].nbytes >= plan.solo_bytes
        )

    for prev, c in zip(plan.chunks, plan.chunks[1:]):
        if solo(prev) or solo(c):
            continue
        if c.bucket == prev.bucket + 1 and c.start == 0 and specs[c.tensor].nbytes <= bb:
            used = -(-plan.bucket_sizes[prev.bucket] // ALIGNMENT) * ALIGNMENT
            assert used + specs[c.tensor].nbytes > bb


spec_dtypes = st.sampled_from(
    ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64", "int32", "complex128"]
)
spec_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@st.composite
def spec_lists(draw):
    n = draw(st.integers(0, 30))
    return [TensorSpec(f"t{i}", draw(spec_shapes), draw(spec_dtypes)) for i in range(n)]


def random_specs(rng: np.random.Generator, n: int, max_dim: int = 300) -> list[TensorSpec]:
    dtypes = ["float32", "bfloat16", "float16", "int64", "uint8", "bool"]
    specs = []
    for i in range(n):
        rank = int(rng.integers(0, 4))
        shape = tuple(int(d) for d in rng.integers(0, max_dim, size=rank))
        specs.append(TensorSpec(f"layer.{i}.w", shape, dtypes[int(rng.integers(len(dtypes)))]))
    return specs


# ---------------------------------------------------------------------------
# TensorSpec
# ---------------------------------------------------------------------------


def test_tensor_spec_properties():
    rng = np.random.default_rng()
    shape = tuple(int(d) for d in rng.integers(1, 50, size=3))
    for dtype in ["float32", "bfloat16", "float16", "int64", "bool", "float64"]:
        spec = TensorSpec("w", list(shape), dtype)
        assert spec.shape == shape
        assert spec.numel == math.prod(shape)
        assert spec.itemsize == torch.empty((), dtype=getattr(torch, dtype)).element_size()
        assert spec.nbytes == spec.numel * spec.itemsize
    assert TensorSpec("s", (), "float32").numel == 1
    assert TensorSpec("h", (2,), "half").dtype == "float16"
    t = torch.empty(3, 5, dtype=torch.bfloat16)
    assert TensorSpec.from_tensor("x", t) == TensorSpec("x", (3, 5), "bfloat16")
    assert TensorSpec.from_tensor("x", t, "float32").dtype == "float32"
    assert set(WIRE_DTYPES) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="", shape=(2,), dtype="float32"), "name"),
        (dict(name="w", shape=(2, -1), dtype="float32"), "'w'.*shape"),
        (dict(name="w", shape=(2.0,), dtype="float32"), "'w'.*shape"),
        (dict(name="w", shape=(True,), dtype="float32"), "'w'.*shape"),
        (dict(name="w", shape=5, dtype="float32"), "'w'.*shape"),
        (dict(name="w", shape=(2,), dtype="float33"), "'w'.*dtype"),
        (dict(name="w", shape=(2,), dtype="Size"), "'w'.*dtype"),
        (dict(name="w", shape=(2,), dtype=torch.float32), "'w'.*dtype"),
    ],
)
def test_tensor_spec_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorSpec(**kwargs)


# ---------------------------------------------------------------------------
# Planner
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_plan_properties_on_random_specs(native, monkeypatch):
    if native and (_C is None or not hasattr(_C, "plan_buckets")):
        pytest.skip("areal_fast._C with buckets is not built")
    if not native:
        monkeypatch.setenv(_native.DISABLE_ENV, "1")
    rng = np.random.default_rng()
    for _ in range(20):
        specs = random_specs(rng, int(rng.integers(1, 60)))
        bucket_bytes = ALIGNMENT * int(rng.integers(1, 2000))
        check_plan(plan_buckets(specs, bucket_bytes))


@needs_native
@settings(max_examples=400, deadline=None)
@given(specs=spec_lists(), units=st.integers(1, 64), solo=st.sampled_from([0, 1, 200, 4096]))
def test_native_and_python_planners_agree(specs, units, solo):
    bucket_bytes = units * ALIGNMENT
    plan = plan_buckets(specs, bucket_bytes, solo)  # native
    chunks, sizes = B._plan_python(
        [s.numel for s in specs], [s.itemsize for s in specs], bucket_bytes, solo
    )
    assert [tuple(vars(c).values()) for c in plan.chunks] == chunks
    assert list(plan.bucket_sizes) == sizes
    check_plan(plan)
    check_solo(plan)


def check_solo(plan):
    """Every tensor of >= solo_bytes bytes is alone (zero-size chunks aside) in its buckets."""
    if not plan.solo_bytes:
        return
    by_tensor = {}
    for c in plan.chunks:
        by_tensor.setdefault(c.tensor, []).append(c)
    for spec_index, spec in enumerate(plan.specs):
        if spec.nbytes < plan.solo_bytes or spec.nbytes == 0:
            continue
        for chunk in by_tensor[spec_index]:
            others = [
                c
                for c in plan.bucket_chunks(chunk.bucket)
                if c.tensor != spec_index and c.numel > 0
            ]
            assert not others, (spec.name, chunk.bucket)
            assert chunk.offset == 0


def test_solo_tensors_get_buckets_to_themselves_and_survive_metadata():
    rng = np.random.default_rng()
    specs = random_specs(rng, 60)
    solo = int(rng.integers(64, 2048))
    plan = plan_buckets(specs, ALIGNMENT * int(rng.integers(4, 40)), solo)
    check_plan(plan)
    check_solo(plan)
    assert BucketPlan.from_metadata(json.loads(json.dumps(plan.to_metadata()))) == plan
    with pytest.raises(ValueError, match="solo_bytes"):
        plan_buckets(specs, 512, -1)


def test_plan_without_native_matches(monkeypatch):
    rng = np.random.default_rng()
    specs = random_specs(rng, 80)
    bucket_bytes = ALIGNMENT * int(rng.integers(1, 400))
    first = plan_buckets(specs, bucket_bytes)
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    assert plan_buckets(specs, bucket_bytes) == first


def test_metadata_round_trip_through_json():
    rng = np.random.default_rng()
    specs = random_specs(rng, 50)
    plan = plan_buckets(specs, ALIGNMENT * int(rng.integers(1, 500)))
    meta = json.loads(json.dumps(plan.to_metadata()))
    assert meta["alignment"] == ALIGNMENT and meta["bucket_bytes"] == plan.bucket_bytes
    again = BucketPlan.from_metadata(meta)
    assert again == plan
    assert again.chunks == plan.chunks and again.bucket_sizes == plan.bucket_sizes


def test_tensor_larger_than_a_bucket_is_split():
    rng = np.random.default_rng()
    bucket_bytes = ALIGNMENT * int(rng.integers(2, 9))
    small = TensorSpec("small", (int(rng.integers(1, 40)),), "float32")
    big_numel = bucket_bytes // 2 * int(rng.integers(3, 7)) + int(rng.integers(1, 100))
    big = TensorSpec("big", (big_numel,), "bfloat16")
    after = TensorSpec("after", (3,), "float16")
    plan = plan_buckets([small, big, after], bucket_bytes)
    check_plan(plan)
    pieces = [c for c in plan.chunks if c.tensor == 1]
    assert len(pieces) == math.ceil(big.nbytes / bucket_bytes)
    assert pieces[0].bucket == 1  # the partly used first bucket is not split into
    tail = pieces[-1]
    # the last piece's bucket stays open for the next tensor
    last = plan.chunks[-1]
    assert last.tensor == 2 and last.bucket == tail.bucket
    assert last.offset == -(-(tail.numel * 2) // ALIGNMENT) * ALIGNMENT


def test_split_tensor_starts_in_the_current_bucket_when_it_is_empty():
    plan = plan_buckets(
        [TensorSpec("e", (0,), "float32"), TensorSpec("big", (1000,), "int64")], 1024
    )
    check_plan(plan)
    assert plan.chunks[0].bucket == plan.chunks[1].bucket == 0


def test_odd_shapes_and_zero_size_tensors():
    rng = np.random.default_rng()
    specs = [
        TensorSpec("a", (7, 13), "bfloat16"),
        TensorSpec("empty", (0, 5), "float32"),
        TensorSpec("b", (int(rng.integers(1, 99)), 3), "float16"),
        TensorSpec("scalar", (), "float32"),
        TensorSpec("empty2", (3, 0), "int64"),
    ]
    plan = plan_buckets(specs, ALIGNMENT * 4)
    check_plan(plan)
    assert [c.numel for c in plan.chunks if c.tensor in (1, 4)] == [0, 0]
    assert [c.offset for c in plan.chunks[:3]] == [0, ALIGNMENT, ALIGNMENT]
    assert plan_buckets([], 512).num_buckets == 0
    only_empty = plan_buckets([TensorSpec("e", (0,), "float32")], 512)
    assert only_empty.bucket_sizes == (0,) and only_empty.chunks == (Chunk(0, 0, 0, 0, 0),)


@pytest.mark.parametrize("bucket_bytes", [0, -256, 100, 257, 256.0, True, "512", None])
def test_bad_bucket_bytes(bucket_bytes):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([TensorSpec("w", (4,), "float32")], bucket_bytes)


def test_bad_specs():
    with pytest.raises(ValueError, match=r"specs\[1\].*'w' appears twice"):
        plan_buckets([TensorSpec("w", (4,), "float32"), TensorSpec("w", (2,), "int64")], 512)
    with pytest.raises(ValueError, match=r"specs\[0\]"):
        plan_buckets([("w", (4,), "float32")], 512)
    with pytest.raises(ValueError, match=r"specs\[0\].*'huge'.*int64"):
        plan_buckets([TensorSpec("huge", (2**40, 2**40), "float32")], 512)


def _meta():
    return plan_buckets(
        [TensorSpec("a", (3, 4), "float32"), TensorSpec("b", (5,), "int64")], 1024
    ).to_metadata()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.pop("bucket_bytes"), "'bucket_bytes'"),
        (lambda m: m.pop("alignment"), "'alignment'"),
        (lambda m: m.pop("tensors"), "'tensors'"),
        (lambda m: m.update(bucket_bytes="1024"), r"\['bucket_bytes'\]"),
        (lambda m: m.update(bucket_bytes=1000), "bucket_bytes"),
        (lambda m: m.update(bucket_bytes=-512), "bucket_bytes"),
        (lambda m: m.update(alignment=128), r"\['alignment'\]"),
        (lambda m: m.update(tensors={"a": 1}), r"\['tensors'\]"),
        (lambda m: m["tensors"].append(["c", [2]]), r"\['tensors'\]\[2\]"),
        (lambda m: m["tensors"].append([7, [2], "float32"]), r"\['tensors'\]\[2\] name"),
        (lambda m: m["tensors"].append(["c", [2, -1], "float32"]), r"\['tensors'\]\[2\].*shape"),
        (lambda m: m["tensors"].append(["c", "2", "float32"]), r"\['tensors'\]\[2\].*shape"),
        (lambda m: m["tensors"].append(["c", [2.5], "float32"]), r"\['tensors'\]\[2\].*shape"),
        (lambda m: m["tensors"].append(["c", [2], "floaty"]), r"\['tensors'\]\[2\].*dtype"),
        (lambda m: m["tensors"].append(["a", [2], "float32"]), "'a' appears twice"),
    ],
)
def test_bad_metadata(edit, match):
    meta = _meta()
    edit(meta)
    with pytest.raises(ValueError, match=match) as info:
        BucketPlan.from_metadata(meta)
    assert "\n" not in str(info.value)


def test_bad_metadata_type():
    with pytest.raises(ValueError, match="dict"):
        BucketPlan.from_metadata([["a", [1], "float32"]])


def test_bucket_chunks_index_checked():
    plan = plan_buckets([TensorSpec("a", (3,), "float32")], 512)
    for k in (-1, 1, "0", 0.0):
        with pytest.raises(ValueError, match="bucket index"):
            plan.bucket_chunks(k)


# ---------------------------------------------------------------------------
# Pack / unpack on the CPU (native threads and the torch fallback)
# ---------------------------------------------------------------------------


def _expected_bucket(plan: BucketPlan, k: int, sources, before: torch.Tensor) -> torch.Tensor:
    """Bytes pack_bucket must produce: the bucket's previous bytes with each chunk's
    ``src[start:start+numel].to(wire dtype)`` written at its offset (torch reference)."""
    want = before.clone()
    for c in plan.bucket_chunks(k):
        spec = plan.specs[c.tensor]
        piece = sources[c.tensor].reshape(-1)[c.start : c.start + c.numel].to(spec.torch_dtype)
        want[c.offset : c.offset + c.numel * spec.itemsize] = piece.view(torch.uint8)
    return want


def _wire_view(buf: torch.Tensor, c: Chunk, spec: TensorSpec) -> torch.Tensor:
    return buf[c.offset : c.offset + c.numel * spec.itemsize].view(spec.torch_dtype)


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "int64", "bool", "uint8", "float64"]
)
def test_round_trip_is_bit_exact(dtype, impl, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    torch_dtype = getattr(torch, dtype)
    shapes = [
        (7, 13),
        (int(rng.integers(100, 3000)),),
        (),
        (0, 4),
        (int(rng.integers(1, 40)), int(rng.integers(1, 40)), 3),
        (5000,),
    ]
    specs = [TensorSpec(f"p{i}", s, dtype) for i, s in enumerate(shapes)]
    plan = plan_buckets(specs, ALIGNMENT * int(rng.integers(4, 40)))
    check_plan(plan)
    sources = [random_bits(s, torch_dtype) for s in shapes]
    targets = [random_bits(s, torch_dtype) for s in shapes]
    buf = random_bits((plan.bucket_bytes,), torch.uint8)
    for k in range(plan.num_buckets):
        before = buf.clone()
        pack_bucket(plan, k, sources, buf)
        assert torch.equal(buf, _expected_bucket(plan, k, sources, before))  # padding kept
        unpack_bucket(plan, k, buf, targets)
    for src, tgt in zip(sources, targets):
        assert torch.equal(bits(src), bits(tgt)) if src.numel() else tgt.numel() == 0


SPECIALS = [
    float("inf"),
    -float("inf"),
    float("nan"),
    -float("nan"),
    0.0,
    -0.0,
    65504.0,
    65519.996,
    65520.0,
    65536.0,
    -65520.0,
    1e30,
    3.3895314e38,
    3.4e38,
    2.0**-14,
    2.0**-24,
    2.0**-25,
    3 * 2.0**-26,
    2.0**-25 * 1.0000001,
    1e-40,
    -1e-45,
    1.1754942e-38,
    2.0**-133,
    1.0 + 2.0**-8,
    1.0 + 3 * 2.0**-8,
    1.0 + 2.0**-11,
]


def _float32_inputs(n: int) -> torch.Tensor:
    """Random bit patterns (all exponents: NaN, Inf, subnormals), values near float16's
    range limits and the special values above, shuffled."""
    parts = [
        random_bits((n,), torch.float32),
        torch.randn(n) * 1e-5,
        torch.randn(n) * 6e4,
        torch.tensor(SPECIALS, dtype=torch.float32),
    ]
    x = torch.cat(parts)
    return x[torch.randperm(x.numel())]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_pack_cast_from_float32_matches_torch(wire, impl, fresh_seed):
    x = _float32_inputs(20000)
    x = x[: x.numel() // 26 * 26].reshape(-1, 2, 13)
    y = _float32_inputs(3001)
    specs = [TensorSpec("x", tuple(x.shape), wire), TensorSpec("y", tuple(y.shape), wire)]
    plan = plan_buckets(specs, ALIGNMENT * 100)
    buf = random_bits((plan.bucket_bytes,), torch.uint8)
    got = {0: [], 1: []}
    for k in range(plan.num_buckets):
        pack_bucket(plan, k, [x, y], buf)
        for c in plan.bucket_chunks(k):
            got[c.tensor].append(_wire_view(buf, c, specs[c.tensor]).clone())
    wire_dtype = getattr(torch, wire)
    assert_same_floats(torch.cat(got[0]), x.reshape(-1).to(wire_dtype))
    assert_same_floats(torch.cat(got[1]), y.to(wire_dtype))


@pytest.mark.parametrize(
    "wire, target",
    [
        ("bfloat16", "float32"),
        ("float16", "float32"),
        ("bfloat16", "float16"),
        ("float16", "bfloat16"),
        ("float32", "bfloat16"),
        ("float32", "float16"),
    ],
)
def test_unpack_cast_matches_torch(wire, target, impl, fresh_seed):
    wire_dtype, target_dtype = getattr(torch, wire), getattr(torch, target)
    n = 50000 + int(torch.randint(0, 1000, ()))
    src = random_bits((n,), wire_dtype)
    if wire == "float32":
        src = _float32_inputs(n)
    plan = plan_buckets([TensorSpec("w", tuple(src.shape), wire)], ALIGNMENT * 64)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    out = random_bits(tuple(src.shape), target_dtype)
    for k in range(plan.num_buckets):
        pack_bucket(plan, k, [src], buf)
        unpack_bucket(plan, k, buf, [out])
    assert_same_floats(out, src.to(target_dtype))


@needs_native
def test_native_nan_encoding_keeps_sign_and_quiets(monkeypatch):
    """NaN payload bits are the native code's documented choice (torch's differ by path)."""
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    x = random_bits((4096,), torch.float32)
    x = x[x.isnan()]
    specs = [
        TensorSpec("b", tuple(x.shape), "bfloat16"),
        TensorSpec("h", tuple(x.shape), "float16"),
    ]
    plan = plan_buckets(specs, ALIGNMENT * 64)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    pack_bucket(plan, 0, [x, x], buf)
    u = bits(x).to(torch.int64) & 0xFFFFFFFF
    for c in plan.bucket_chunks(0):
        got = bits(_wire_view(buf, c, specs[c.tensor])).to(torch.int64) & 0xFFFF
        if c.tensor == 0:  # sign and top 7 payload bits, quiet bit set
            assert torch.equal(got, (u >> 16) | 0x40)
        else:  # sign | 0x7E00 | top 9 payload bits (x86 F16C)
            assert torch.equal(got, ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF))


@needs_native
def test_thread_counts_give_identical_bytes(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    # ~6 MiB of output so 4 threads really split it, cuts landing inside chunks
    shapes = [
        (int(rng.integers(1000, 5000)), 257),
        (7, 13),
        (int(rng.integers(1, 999)),),
        (1536, 256),
        (0,),
        (int(rng.integers(10**5, 10**6)),),
    ]
    dtypes = ["float32", "bfloat16", "float16", "bfloat16", "int64", "int64"]
    srcs = [
        random_bits(s, torch.float32) if d in WIRE_DTYPES else random_bits(s, torch.int64)
        for s, d in zip(shapes, dtypes)
    ]
    specs = [TensorSpec(f"w{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    plan = plan_buckets(specs, 4 << 20)
    for k in range(plan.num_buckets):
        results = []
        for threads in (1, 4, 3):
            buf = torch.zeros(plan.bucket_sizes[k], dtype=torch.uint8)
            pack_bucket(plan, k, srcs, buf, num_threads=threads)
            results.append(buf)
            targets = [torch.full(s.shape, 7, dtype=s.dtype) for s in srcs]
            unpack_bucket(plan, k, buf, targets, num_threads=threads)
            results.extend(bits(t) for t in targets if t.numel())
        n = len(results) // 3
        for i in range(n):
            assert torch.equal(results[i], results[n + i]) and torch.equal(
                results[i], results[2 * n + i]
            )


def test_unpack_skips_none_targets_and_writes_parameters(impl, fresh_seed):
    specs = [TensorSpec("a", (64, 3), "bfloat16"), TensorSpec("b", (100,), "float32")]
    plan = plan_buckets(specs, 4096)
    srcs = [torch.randn(64, 3), torch.randn(100)]
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    pack_bucket(plan, 0, srcs, buf)
    param = torch.nn.Parameter(torch.randn(100))
    untouched = torch.randn(64, 3)
    keep = untouched.clone()
    unpack_bucket(plan, 0, buf, [None, param])
    assert torch.equal(param.detach(), srcs[1])
    unpack_bucket(plan, 0, buf, [None, None])
    assert torch.equal(untouched, keep)


def test_pack_ignores_sources_outside_the_bucket(impl):
    specs = [TensorSpec("a", (100,), "float32"), TensorSpec("b", (100,), "float32")]
    plan = plan_buckets(specs, 512)
    assert plan.num_buckets == 2
    buf = torch.empty(512, dtype=torch.uint8)
    a = torch.randn(100)
    pack_bucket(plan, 0, [a, None], buf)
    assert torch.equal(buf[:400].view(torch.float32), a)
    with pytest.raises(ValueError, match="source for tensor 'b'"):
        pack_bucket(plan, 1, [a, None], buf)


# ---------------------------------------------------------------------------
# bucket_view: buckets of one plan_layout buffer are byte ranges of it
# ---------------------------------------------------------------------------


def _layout_views(specs, offsets, total):
    buf = torch.randint(0, 256, (total,), dtype=torch.uint8)
    views = [
        buf[o : o + s.nbytes].view(s.torch_dtype).view(s.shape) for s, o in zip(specs, offsets)
    ]
    return buf, views


def test_every_bucket_of_a_layout_buffer_is_a_view_of_it(fresh_seed):
    from areal_fast.sync.shared_memory import plan_layout

    rng = np.random.default_rng(fresh_seed)
    specs = random_specs(rng, 40, max_dim=60) + [TensorSpec("odd", (5, 123), "bfloat16")]
    specs += [TensorSpec("split", (1003,), "float32")]
    entries, total = plan_layout((s.name, torch.empty(s.shape, dtype=s.torch_dtype)) for s in specs)
    buf, views = _layout_views(specs, [e.offset for e in entries], total)
    for bucket_bytes, solo in [(1024, 0), (2048, 0), (4096, 700), (1 << 20, 0)]:
        plan = plan_buckets(specs, bucket_bytes, solo)
        for k in range(plan.num_buckets):
            view = bucket_view(plan, k, views, torch.device("cpu"))
            if all(c.numel == 0 for c in plan.bucket_chunks(k)):
                assert view is None
                continue
            assert view is not None, f"seed {fresh_seed}: bucket {k} of {bucket_bytes}"
            assert view.numel() == plan.bucket_sizes[k] and view.untyped_storage().data_ptr() == (
                buf.data_ptr()
            )
            packed = torch.zeros(plan.bucket_sizes[k], dtype=torch.uint8)
            pack_bucket(plan, k, views, packed)
            for c in plan.bucket_chunks(k):
                end = c.offset + c.numel * plan.specs[c.tensor].itemsize
                assert torch.equal(view[c.offset : end], packed[c.offset : end])


def test_bucket_view_refuses_other_layouts(fresh_seed):
    specs = [
        TensorSpec("a", (5, 123), "bfloat16"),
        TensorSpec("b", (1003,), "float32"),
        TensorSpec("c", (7, 13), "float16"),
    ]
    plan = plan_buckets(specs, 8192)
    assert plan.num_buckets == 1 and plan.bucket_chunks(0)[1].offset == 1280
    cpu = torch.device("cpu")
    _, views = _layout_views(specs, [0, 1280, 5376], 5376 + 182)
    assert bucket_view(plan, 0, views, cpu) is not None
    _, dense = _layout_views(specs, [0, 1232, 5248], 5248 + 182)  # 16-byte aligned offsets
    assert bucket_view(plan, 0, dense, cpu) is None
    separate = [torch.empty(s.shape, dtype=s.torch_dtype) for s in specs]
    assert bucket_view(plan, 0, separate, cpu) is None
    cast = list(views)
    cast[1] = torch.empty(1003, dtype=torch.bfloat16)
    assert bucket_view(plan, 0, cast, cpu) is None
    assert bucket_view(plan, 0, [views[0], None, views[2]], cpu) is None
    assert bucket_view(plan, 0, views, torch.device("meta")) is None
    strided = _layout_views([TensorSpec("t", (26, 7), "float16")], [5376], 5376 + 364)[1][0]
    assert bucket_view(plan, 0, [views[0], views[1], strided[::2]], cpu) is None
    # a bucket said to reach past the end of the storage is refused
    longer = BucketPlan(plan.specs, 8192, plan.chunks, (plan.bucket_sizes[0] + 256,))
    assert bucket_view(longer, 0, views, cpu) is None
    with pytest.raises(ValueError, match="tensors has 2 entries"):
        bucket_view(plan, 0, views[:2], cpu)
    with pytest.raises(ValueError, match="out of range"):
        bucket_view(plan, 1, views, cpu)


def test_one_tensor_bucket_is_a_view_of_any_tensor(fresh_seed):
    specs = [TensorSpec("w", (3001,), "float32"), TensorSpec("n", (3,), "float32")]
    plan = plan_buckets(specs, 4096)
    assert plan.num_buckets == 3  # w over three buckets, n after w's tail in the third
    weight = torch.nn.Parameter(torch.randn(3001))
    tensors = [weight, torch.randn(3)]
    for k in range(2):
        chunk = plan.bucket_chunks(k)[0]
        view = bucket_view(plan, k, tensors, torch.device("cpu"))
        assert not view.requires_grad
        expected = weight.detach()[chunk.start : chunk.start + chunk.numel].view(torch.uint8)
        assert torch.equal(view, expected) and view.data_ptr() == expected.data_ptr()
    assert bucket_view(plan, 2, tensors, torch.device("cpu")) is None  # two storages


def _error_setup():
    specs = [TensorSpec("layer.w", (8, 4), "bfloat16"), TensorSpec("layer.ids", (5,), "int64")]
    plan = plan_buckets(specs, 1024)
    return plan, [torch.randn(8, 4), torch.randint(0, 9, (5,))]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.__setitem__(0, torch.randn(4, 8).t()), "'layer.w' is not contiguous"),
        (lambda s: s.__setitem__(0, torch.randn(8, 5)), "'layer.w' has shape"),
        (
            lambda s: s.__setitem__(0, torch.randn(8, 4, dtype=torch.float64)),
            "'layer.w': cannot cast float64 to bfloat16",
        ),
        (
            lambda s: s.__setitem__(1, torch.randint(0, 9, (5,), dtype=torch.int32)),
            "'layer.ids': cannot cast int32 to int64",
        ),
        (lambda s: s.__setitem__(1, torch.randn(5)), "'layer.ids': cannot cast float32 to int64"),
        (lambda s: s.__setitem__(1, [1, 2, 3, 4, 5]), "'layer.ids' must be a torch.Tensor"),
        (lambda s: s.__setitem__(0, torch.randn(8, 4, device="meta")), "'layer.w' is on meta"),
        (lambda s: s.pop(), "tensors has 1 entries"),
    ],
)
def test_pack_errors_name_the_tensor(mutate, match, impl):
    plan, sources = _error_setup()
    mutate(sources)
    buf = torch.empty(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        pack_bucket(plan, 0, sources, buf)


@pytest.mark.parametrize(
    "target, match",
    [
        (torch.empty(4, 8).t(), "target for tensor 'layer.w' is not contiguous"),
        (torch.empty(32), "target for tensor 'layer.w' has shape"),
        (torch.empty(8, 4, dtype=torch.int32), "'layer.w': cannot cast bfloat16 to int32"),
    ],
)
def test_unpack_errors_name_the_tensor(target, match, impl):
    plan, sources = _error_setup()
    buf = torch.empty(1024, dtype=torch.uint8)
    pack_bucket(plan, 0, sources, buf)
    with pytest.raises(ValueError, match=match):
        unpack_bucket(plan, 0, buf, [target, torch.empty(5, dtype=torch.int64)])


def test_buffer_and_argument_errors(impl):
    plan, sources = _error_setup()
    need = plan.bucket_sizes[0]
    cases = [
        (torch.empty(need - 1, dtype=torch.uint8), "out has"),
        (torch.empty(need, dtype=torch.int8), "uint8"),
        (torch.empty(2, need, dtype=torch.uint8), "1-D"),
        (torch.empty(need + 1, dtype=torch.uint8)[1:], "16-byte aligned"),
        (torch.empty(2 * need, dtype=torch.uint8)[::2], "contiguous"),
    ]
    for buf, match in cases:
        with pytest.raises(ValueError, match=match):
            pack_bucket(plan, 0, sources, buf)
    buf = torch.empty(need, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bucket index"):
        pack_bucket(plan, plan.num_buckets, sources, buf)
    with pytest.raises(ValueError, match="num_threads"):
        pack_bucket(plan, 0, sources, buf, num_threads=0)
    with pytest.raises(ValueError, match="bucket has"):
        unpack_bucket(plan, 0, buf[: need - 1], [None, None])
    with pytest.raises(ValueError, match="targets has 1 entries"):
        unpack_bucket(plan, 0, buf, [None])


@needs_native
def test_native_copy_rejects_bad_descriptors():
    a = torch.randn(16)
    b = torch.empty(16)
    good = [a.data_ptr(), b.data_ptr(), 16, 1, 1]
    _C.bucket_copy(np.array([good], dtype=np.int64), 1)
    assert torch.equal(a, b)
    for row, match in [
        ([a.data_ptr(), b.data_ptr(), -1, 1, 1], "count"),
        ([a.data_ptr(), b.data_ptr(), 4, 9, 1], "dtype code"),
        ([a.data_ptr(), b.data_ptr(), 4, 0, 1], "raw bytes"),
        ([0, b.data_ptr(), 4, 1, 1], "null"),
    ]:
        with pytest.raises(ValueError, match=r"copies\[0\]: .*" + match):
            _C.bucket_copy(np.array([row], dtype=np.int64), 1)
    with pytest.raises(ValueError, match="num_threads"):
        _C.bucket_copy(np.array([good], dtype=np.int64), 0)
    with pytest.raises(ValueError, match=r"\[C, 5\]"):
        _C.bucket_copy(np.zeros((2, 4), dtype=np.int64), 1)


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU): the kernel against the CPU result
# ---------------------------------------------------------------------------


def _cuda_kernel_available() -> bool:
    return _C is not None and getattr(_C, "has_cuda", False) and hasattr(_C, "bucket_copy_cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16", "int64"])
def test_cuda_pack_unpack_matches_cpu(wire, fresh_seed, monkeypatch):
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    rng = np.random.default_rng(fresh_seed)
    wire_dtype = getattr(torch, wire)
    src_dtype = torch.float32 if wire in WIRE_DTYPES else wire_dtype
    shapes = [
        (int(rng.integers(1, 3000)), 129),
        (7, 13),
        (),
        (0, 3),
        (1536, 256),
        (int(rng.integers(10**5, 10**6)),),
    ]
    specs = [TensorSpec(f"w{i}", s, wire) for i, s in enumerate(shapes)]
    plan = plan_buckets(specs, ALIGNMENT * int(rng.integers(2000, 20000)))
    cpu_src = [random_bits(s, src_dtype) for s in shapes]
    if wire in WIRE_DTYPES:
        cpu_src[-1] = _float32_inputs(shapes[-1][0])[: shapes[-1][0]]
    gpu_src = [t.cuda() for t in cpu_src]
    cpu_buf = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)
    gpu_buf = torch.zeros(plan.bucket_bytes, dtype=torch.uint8, device="cuda")
    back_dtype = torch.bfloat16 if wire == "float16" else src_dtype
    cpu_out = [torch.zeros(s, dtype=back_dtype) for s in shapes]
    gpu_out = [torch.zeros(s, dtype=back_dtype, device="cuda") for s in shapes]
    for k in range(plan.num_buckets):
        pack_bucket(plan, k, cpu_src, cpu_buf)
        pack_bucket(plan, k, gpu_src, gpu_buf)
        size = plan.bucket_sizes[k]
        if _cuda_kernel_available():  # identical bits, NaNs included
            assert torch.equal(gpu_buf[:size].cpu(), cpu_buf[:size])
        else:  # torch fallback on the GPU: NaN bits may differ
            gpu_host = gpu_buf.cpu()
            for c in plan.bucket_chunks(k):
                spec = specs[c.tensor]
                got, want = _wire_view(gpu_host, c, spec), _wire_view(cpu_buf, c, spec)
                if wire in WIRE_DTYPES:
                    assert_same_floats(got, want)
                else:
                    assert torch.equal(got, want)
        unpack_bucket(plan, k, cpu_buf, cpu_out)
        unpack_bucket(plan, k, gpu_buf, gpu_out)
    for a, b in zip(cpu_out, gpu_out):
        if a.dtype.is_floating_point:
            assert_same_floats(b.cpu(), a)
        else:
            assert torch.equal(b.cpu(), a)


@pytest.mark.cuda
@needs_cuda
def test_cuda_many_chunks_and_misaligned_sources(fresh_seed, monkeypatch):
    """More chunks than one kernel launch carries, sources at unaligned addresses (scalar
    and narrow-vector paths), on a side stream."""
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    rng = np.random.default_rng(fresh_seed)
    n = 1000
    dtypes = ["bfloat16", "float16", "float32", "uint8", "int64"]
    specs, cpu_src = [], []
    for i in range(n):
        wire = dtypes[i % len(dtypes)]
        numel = int(rng.integers(1, 200))
        base_dtype = torch.float32 if wire in WIRE_DTYPES else getattr(torch, wire)
        backing = random_bits((numel + 3,), base_dtype)
        shift = int(rng.integers(0, 4))
        cpu_src.append(backing[shift : shift + numel])  # misaligned views of a buffer
        specs.append(TensorSpec(f"t{i}", (numel,), wire))
    plan = plan_buckets(specs, 4 << 20)
    assert plan.num_buckets == 1 and len(plan.chunks) > 800
    cpu_buf = torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8)
    pack_bucket(plan, 0, cpu_src, cpu_buf)
    gpu_src = [t.cuda() for t in cpu_src]  # contiguous copies...
    gpu_src = [
        torch.cat([torch.zeros(1, dtype=t.dtype, device="cuda"), t])[1:] for t in gpu_src
    ]  # ...moved off 16-byte alignment
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu_buf = torch.zeros(plan.bucket_sizes[0], dtype=torch.uint8, device="cuda")
        pack_bucket(plan, 0, gpu_src, gpu_buf)
        gpu_out = [torch.zeros_like(t) for t in gpu_src]
        unpack_bucket(plan, 0, gpu_buf, gpu_out)
    stream.synchronize()
    if _cuda_kernel_available():
        assert torch.equal(gpu_buf.cpu(), cpu_buf)
    for src, out, spec in zip(cpu_src, gpu_out, specs):
        expect = src.to(spec.torch_dtype).to(src.dtype)
        if src.dtype.is_floating_point:
            assert_same_floats(out.cpu(), expect)
        else:
            assert torch.equal(out.cpu(), expect)


@pytest.mark.cuda
@needs_cuda
def test_cuda_device_mismatch_names_the_tensor():
    plan = plan_buckets([TensorSpec("w", (4,), "float32")], 512)
    buf = torch.empty(512, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="'w' is on cpu"):
        pack_bucket(plan, 0, [torch.randn(4)], buf)
