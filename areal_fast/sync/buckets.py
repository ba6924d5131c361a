"""Weight-sync buckets: a deterministic layout of many tensors in fixed-size byte buckets,
and the copies that pack tensors into a bucket and unpack them again.

A trainer streams its weights to inference engines one bucket at a time: the sender packs
bucket k (casting, e.g., float32 master weights to the bfloat16 wire dtype), ships its
``plan.bucket_sizes[k]`` bytes, and the receiver unpacks them into its own tensors. Only the
small metadata (:meth:`BucketPlan.to_metadata`: bucket size and the ``[name, shape,
dtype]`` list) crosses the process boundary once; the receiver re-plans from it and gets
the sender's layout, because the planner is deterministic.

Layout rules (:func:`plan_buckets`): tensors keep their given order; every chunk starts at a
multiple of :data:`ALIGNMENT` bytes; a tensor that fits in the rest of the current bucket
goes there whole, one that does not but fits in a bucket opens a new bucket, one larger than
a bucket is split into whole-bucket element ranges over consecutive buckets (starting in a
fresh bucket), and a tensor without elements gets a 0-element chunk so receivers still learn
about it.

In place: offsets inside a bucket are aligned running sums, like those of
:func:`areal_fast.sync.shared_memory.plan_layout`, so every bucket of tensors that are views of
one such buffer is a contiguous byte range of it (:func:`bucket_view`), which a transport that
sends from and receives into any memory moves with no pack or unpack copy.

Implementations: the planner is C++ (``csrc/buckets.cpp``) with a pure-Python twin that
gives the identical plan. Copies on the CPU run in C++ threads with the GIL released; on
CUDA tensors one kernel launch (``csrc/cuda/bucket_pack.cu``) copies every chunk of a bucket
on the current stream. Without the extension (or for devices it does not cover) the copies
fall back to one torch ``copy_`` per chunk.

Casts: float32, bfloat16 and float16 (:data:`WIRE_DTYPES`) convert into one another with
round-to-nearest-even (bfloat16 as c10::BFloat16's ``round_to_nearest_even``, float16 as
IEEE 754 with subnormals and overflow to Inf, bfloat16 <-> float16 through float32), bit
for bit what torch's ``.to(dtype)`` gives for every non-NaN value. A NaN stays a NaN of the
same sign, but its payload bits follow the native code (see ``csrc/include/areal_fast/
buckets.h``); torch itself writes different NaN bits on different paths. Every other dtype
is copied only to itself, byte for byte.
"""

from __future__ import annotations

import bisect
import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from areal_fast._native import load_native

__all__ = [
    "ALIGNMENT",
    "WIRE_DTYPES",
    "TensorSpec",
    "Chunk",
    "BucketPlan",
    "plan_buckets",
    "pack_bucket",
    "unpack_bucket",
    "bucket_view",
]

ALIGNMENT = 256
MAX_CHUNKS = 1_000_000  # largest plan accepted (a bound on what a header can make us build)
"""Byte alignment of every chunk inside a bucket (and the unit of ``bucket_bytes``)."""

WIRE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes that cast into one another on pack/unpack. Any other torch dtype name is a valid
:attr:`TensorSpec.dtype` too, copied only from/to tensors of that same dtype."""

# Byte alignment required of a bucket buffer's first byte (16-byte vector access on CUDA).
_BUFFER_ALIGNMENT = 16
_INT64_MAX = 2**63 - 1
_cuda_kernel_failed = False


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _dtype_from_name(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether pack/unpack can copy ``src`` elements into ``dst`` (equal dtypes, or both in
    :data:`WIRE_DTYPES`)."""
    return src == dst or (_dtype_name(src) in WIRE_DTYPES and _dtype_name(dst) in WIRE_DTYPES)


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and wire dtype of one tensor of a bucket plan.

    Parameters
    ----------
    name : str
        Unique within a plan (e.g. the state-dict key).
    shape : tuple[int, ...]
        Non-negative sizes; any sequence of ints is accepted and stored as a tuple.
    dtype : str
        Wire dtype: a torch dtype name without ``"torch."`` (e.g. ``"bfloat16"``); aliases
        such as ``"half"`` are stored under the canonical name (``"float16"``).

    Raises
    ------
    ValueError
        A non-string or empty name, a shape that is not a sequence of non-negative ints, or
        a dtype that names no torch dtype (or one whose itemsize does not divide 256).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty str, got {self.name!r}")
        try:
            shape = tuple(self.shape)
        except TypeError:
            shape = None
        if shape is None or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 0
            for d in shape
        ):
            raise ValueError(
                f"TensorSpec {self.name!r}: shape must be a sequence of "
                f"non-negative ints, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        dtype = _dtype_from_name(self.dtype) if isinstance(self.dtype, str) else None
        if dtype is None:
            raise ValueError(
                f"TensorSpec {self.name!r}: dtype {self.dtype!r} is not a torch dtype name"
            )
        if ALIGNMENT % dtype.itemsize != 0:
            raise ValueError(
                f"TensorSpec {self.name!r}: dtype {self.dtype!r} has itemsize "
                f"{dtype.itemsize}, which does not divide {ALIGNMENT}"
            )
        object.__setattr__(self, "dtype", _dtype_name(dtype))

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor, dtype: str | None = None) -> TensorSpec:
        """Spec of ``tensor`` under ``name``, with wire dtype ``dtype`` (default: the
        tensor's own dtype)."""
        return cls(name, tuple(tensor.shape), dtype or _dtype_name(tensor.dtype))

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the wire dtype."""
        return _dtype_from_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor in the wire dtype."""
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        """The wire dtype as a ``torch.dtype``."""
        return _dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Chunk:
    """One contiguous element range of one tensor inside one bucket.

    Attributes
    ----------
    tensor : int
        Index into ``plan.specs``.
    bucket : int
        Bucket index.
    offset : int
        Byte offset of the range inside the bucket, a multiple of :data:`ALIGNMENT`.
    start : int
        First element of the range in the flattened (row-major) tensor.
    numel : int
        Number of elements (0 only for a tensor without elements).
    """

    tensor: int
    bucket: int
    offset: int
    start: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    """Where every element of every tensor goes; build it with :func:`plan_buckets` or
    :meth:`from_metadata`.

    Attributes
    ----------
    specs : tuple[TensorSpec, ...]
        The tensors, in placement order.
    bucket_bytes : int
        Capacity of one bucket in bytes (a positive multiple of :data:`ALIGNMENT`).
    chunks : tuple[Chunk, ...]
        In placement order: by bucket, offsets increasing within a bucket; a tensor split
        over buckets has its chunks in element order.
    bucket_sizes : tuple[int, ...]
        Bytes used by each bucket: the end of its last chunk (no padding after it); at most
        ``bucket_bytes``. A buffer of that many bytes holds the bucket.
    solo_bytes : int
        Tensors of at least this many bytes have their buckets to themselves (0: off).
    """

    specs: tuple[TensorSpec, ...]
    bucket_bytes: int
    chunks: tuple[Chunk, ...]
    bucket_sizes: tuple[int, ...]
    solo_bytes: int = 0
    _bounds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        buckets = [c.bucket for c in self.chunks]
        bounds = tuple(bisect.bisect_left(buckets, k) for k in range(len(self.bucket_sizes) + 1))
        object.__setattr__(self, "_bounds", bounds)

    @property
    def num_buckets(self) -> int:
        """Number of buckets (``len(bucket_sizes)``)."""
        return len(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        """Sum of :attr:`bucket_sizes` (padding between chunks included)."""
        return sum(self.bucket_sizes)

    def bucket_chunks(self, k: int) -> tuple[Chunk, ...]:
        """The chunks of bucket ``k``, by increasing offset.

        Raises
        ------
        ValueError
            ``k`` is not in ``[0, num_buckets)``.
        """
        _check_bucket_index(self, k)
        return self.chunks[self._bounds[k] : self._bounds[k + 1]]

    def to_metadata(self) -> dict:
        """JSON-able description from which :meth:`from_metadata` rebuilds this plan:
        ``{"bucket_bytes": int, "solo_bytes": int, "alignment": 256, "tensors": [[name,
        [shape...], dtype], ...]}``."""
        return {
            "bucket_bytes": self.bucket_bytes,
            "solo_bytes": self.solo_bytes,
            "alignment": ALIGNMENT,
            "tensors": [[s.name, list(s.shape), s.dtype] for s in self.specs],
        }

    @classmethod
    def from_metadata(cls, meta: Mapping) -> BucketPlan:
        """Re-plan from :meth:`to_metadata` output; the planner is deterministic, so this is
        the sender's plan.

        Raises
        ------
        ValueError
            ``meta`` is not a mapping, lacks a key, or has a value of the wrong type or
            range (the message names the key, e.g. ``metadata['tensors'][3]``).
        """
        if not isinstance(meta, Mapping):
            raise ValueError(f"bucket plan metadata must be a dict, got {type(meta).__name__}")
        for key in ("bucket_bytes", "alignment", "tensors"):
            if key not in meta:
                raise ValueError(f"bucket plan metadata is missing key {key!r}")
        bucket_bytes, alignment, tensors = meta["bucket_bytes"], meta["alignment"], meta["tensors"]
        solo_bytes = meta.get("solo_bytes", 0)
        if not _is_int(bucket_bytes):
            raise ValueError(f"metadata['bucket_bytes'] must be an int, got {bucket_bytes!r}")
        if not _is_int(solo_bytes) or solo_bytes < 0:
            raise ValueError(f"metadata['solo_bytes'] must be an int >= 0, got {solo_bytes!r}")
        if not _is_int(alignment) or alignment != ALIGNMENT:
            raise ValueError(f"metadata['alignment'] must be {ALIGNMENT}, got {alignment!r}")
        if not isinstance(tensors, (list, tuple)):
            raise ValueError(f"metadata['tensors'] must be a list, got {type(tensors).__name__}")
        specs = []
        for i, entry in enumerate(tensors):
            key = f"metadata['tensors'][{i}]"
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(f"{key} must be [name, shape, dtype], got {entry!r}")
            name, shape, dtype = entry
            if not isinstance(name, str) or not name:
                raise ValueError(f"{key} name must be a non-empty str, got {name!r}")
            if not isinstance(shape, (list, tuple)) or not all(
                _is_int(d) and d >= 0 for d in shape
            ):
                raise ValueError(
                    f"{key} ({name!r}) shape must be a list of non-negative ints, got {shape!r}"
                )
            if not isinstance(dtype, str) or _dtype_from_name(dtype) is None:
                raise ValueError(f"{key} ({name!r}) dtype {dtype!r} is not a torch dtype name")
            try:
                specs.append(TensorSpec(name, tuple(shape), dtype))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        try:
            return plan_buckets(specs, bucket_bytes, solo_bytes)
        except ValueError as exc:
            raise ValueError(f"metadata: {exc}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bucket_index(plan: BucketPlan, k) -> None:
    if not _is_int(k) or not 0 <= k < plan.num_buckets:
        raise ValueError(f"bucket index k = {k!r} is out of range [0, {plan.num_buckets})")


def _plan_python(
    numels: Sequence[int], itemsizes: Sequence[int], bucket_bytes: int, solo_bytes: int = 0
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Pure-Python twin of the C++ ``plan_buckets`` (csrc/buckets.cpp): same steps, same
    plan. Returns (chunks as (tensor, bucket, offset, start, numel) tuples, bucket sizes)."""
    chunks: list[tuple[int, ...]] = []
    sizes: list[int] = []
    last_solo = False
    for i, (numel, itemsize) in enumerate(zip(numels, itemsizes)):
        nbytes = numel * itemsize
        if not sizes:
            sizes.append(0)
        if nbytes > 0 and solo_bytes > 0:  # a solo tensor, or the one after it: fresh bucket
            solo = nbytes >= solo_bytes
            if (solo or last_solo) and sizes[-1] > 0:
                sizes.append(0)
            last_solo = solo
        bucket = len(sizes) - 1
        offset = -(-sizes[-1] // ALIGNMENT) * ALIGNMENT
        if nbytes == 0:
            chunks.append((i, bucket, offset, 0, 0))
            sizes[-1] = offset
        elif nbytes <= bucket_bytes - offset:
            chunks.append((i, bucket, offset, 0, numel))
            sizes[-1] = offset + nbytes
        elif nbytes <= bucket_bytes:
            sizes.append(nbytes)
            chunks.append((i, bucket + 1, 0, 0, numel))
        else:  # larger than a bucket: whole-bucket pieces, starting in an empty bucket
            if sizes[-1] > 0:
                sizes.append(0)
                bucket += 1
            per_bucket = bucket_bytes // itemsize
            start = 0
            while start < numel:
                take = min(per_bucket, numel - start)
                chunks.append((i, bucket, 0, start, take))
                sizes[-1] = take * itemsize
                start += take
                if start < numel:
                    sizes.append(0)
                    bucket += 1
    return chunks, sizes


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, solo_bytes: int = 0) -> BucketPlan:
    """Lay ``specs`` out in buckets of ``bucket_bytes`` bytes (rules in the module docstring).

    Parameters
    ----------
    specs : sequence of TensorSpec
        In the order to place them; names must be unique.
    bucket_bytes : int
        Bucket capacity in bytes, a positive multiple of :data:`ALIGNMENT` (256).
    solo_bytes : int
        Tensors of at least this many bytes start in an empty bucket and the next tensor
        starts another: each has its buckets to itself, so a transport that sends from any
        memory (``Transport.supports_direct``) moves it without packing or unpacking. 0 (the
        default) turns the rule off.

    Returns
    -------
    BucketPlan
        Computed by the C++ planner when the extension is loaded, else by the identical
        pure-Python one. No specs give a plan without buckets.

    Raises
    ------
    ValueError
        ``bucket_bytes`` is not a positive multiple of 256; ``solo_bytes`` negative; an entry
        is not a TensorSpec; a name appears twice; a tensor's byte size exceeds int64.
    """
    if not _is_int(bucket_bytes) or bucket_bytes <= 0 or bucket_bytes % ALIGNMENT:
        raise ValueError(
            f"bucket_bytes must be a positive multiple of {ALIGNMENT}, got {bucket_bytes!r}"
        )
    if not _is_int(solo_bytes) or solo_bytes < 0:
        raise ValueError(f"solo_bytes must be an int >= 0, got {solo_bytes!r}")
    specs = tuple(specs)
    seen = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"specs[{i}] must be a TensorSpec, got {type(spec).__name__}")
        if spec.name in seen:
            raise ValueError(f"specs[{i}]: tensor name {spec.name!r} appears twice")
        seen.add(spec.name)
        if spec.nbytes > _INT64_MAX:
            raise ValueError(f"specs[{i}] ({spec.name!r}): {spec.nbytes} bytes exceed int64")
    numels = [s.numel for s in specs]
    itemsizes = [s.itemsize for s in specs]
    # a header from the network decides these sizes: refuse plans too large to hold
    num_chunks = sum(max(1, -(-s.nbytes // bucket_bytes)) for s in specs)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(
            f"{sum(s.nbytes for s in specs)} bytes in buckets of {bucket_bytes} "
            f"would need {num_chunks} chunks (at most {MAX_CHUNKS}); use larger "
            f"buckets"
        )
    native = load_native()
    if native is not None and hasattr(native, "plan_buckets"):
        rows, sizes = native.plan_buckets(
            np.asarray(numels, dtype=np.int64).reshape(-1),
            np.asarray(itemsizes, dtype=np.int64).reshape(-1),
            bucket_bytes,
            solo_bytes,
        )
        rows, sizes = rows.tolist(), sizes.tolist()
    else:
        rows, sizes = _plan_python(numels, itemsizes, bucket_bytes, solo_bytes)
    return BucketPlan(
        specs=specs,
        bucket_bytes=bucket_bytes,
        chunks=tuple(Chunk(*row) for row in rows),
        bucket_sizes=tuple(sizes),
        solo_bytes=solo_bytes,
    )


# ---------------------------------------------------------------------------
# Pack / unpack
# ---------------------------------------------------------------------------


@dataclass
class _Copy:
    """``numel`` elements: ``src`` bytes from ``src_offset`` as ``src_dtype`` ->
    ``dst`` bytes from ``dst_offset`` as ``dst_dtype``."""

    src: torch.Tensor
    src_offset: int
    src_dtype: torch.dtype
    dst: torch.Tensor
    dst_offset: int
    dst_dtype: torch.dtype
    numel: int


def _check_buffer(plan: BucketPlan, k: int, buf, what: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D uint8 tensor, got {buf.dtype} of "
            f"shape {tuple(buf.shape)}"
        )
    if buf.numel() < plan.bucket_sizes[k]:
        raise ValueError(f"{what} has {buf.numel()} bytes, bucket {k} needs {plan.bucket_sizes[k]}")
    if buf.data_ptr() % _BUFFER_ALIGNMENT:
        raise ValueError(f"{what} must start at a {_BUFFER_ALIGNMENT}-byte aligned address")


def _check_tensor(spec: TensorSpec, tensor, device: torch.device, what: str, to_wire: bool) -> None:
    """Shape, layout, device and dtype checks of a pack source / unpack target."""
    label = f"{what} for tensor {spec.name!r}"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{label} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != spec.shape:
        raise ValueError(f"{label} has shape {tuple(tensor.shape)}, the plan says {spec.shape}")
    if not tensor.is_contiguous():
        raise ValueError(f"{label} is not contiguous")
    if tensor.device != device:
        raise ValueError(f"{label} is on {tensor.device}, the bucket buffer on {device}")
    src, dst = (tensor.dtype, spec.torch_dtype) if to_wire else (spec.torch_dtype, tensor.dtype)
    if not castable(src, dst):
        raise ValueError(
            f"{label}: cannot cast {_dtype_name(src)} to {_dtype_name(dst)} "
            f"(casts exist among {', '.join(WIRE_DTYPES)} only)"
        )


def _resolve_threads(num_threads) -> int:
    if num_threads is None:
        return max(1, torch.get_num_threads())
    if not _is_int(num_threads) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    return num_threads


def _copy_rows(native, copies: list[_Copy]) -> np.ndarray:
    """int64 [C, 5] rows (src_ptr, dst_ptr, count, src_code, dst_code) for the extension."""
    codes = native.BUCKET_DTYPE_CODES
    rows = np.empty((len(copies), 5), dtype=np.int64)
    for r, c in enumerate(copies):
        src = c.src.data_ptr() + c.src_offset
        dst = c.dst.data_ptr() + c.dst_offset
        if c.src_dtype == c.dst_dtype:
            rows[r] = (src, dst, c.numel * c.src_dtype.itemsize, codes["bytes"], codes["bytes"])
        else:
            rows[r] = (
                src,
                dst,
                c.numel,
                codes[_dtype_name(c.src_dtype)],
                codes[_dtype_name(c.dst_dtype)],
            )
    return rows


@functools.lru_cache(maxsize=None)
def _device_supported(index: int) -> bool:
    # The kernel carries sm_80 / sm_90 code and compute_90 PTX.
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _byte_view(buf: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of ``buf`` (uint8 or any dtype)."""
    flat = buf.reshape(-1).view(torch.uint8)
    return flat[offset : offset + numel * dtype.itemsize].view(dtype)


def _run_copies_torch(copies: list[_Copy]) -> None:
    with torch.no_grad():
        for c in copies:
            _byte_view(c.dst, c.dst_offset, c.numel, c.dst_dtype).copy_(
                _byte_view(c.src, c.src_offset, c.numel, c.src_dtype)
            )


def _run_copies(copies: list[_Copy], device: torch.device, num_threads: int) -> None:
    """Run the copies with the extension when it covers ``device``, else with torch."""
    global _cuda_kernel_failed
    copies = [c for c in copies if c.numel > 0]
    if not copies:
        return
    native = load_native()
    if device.type == "cpu" and native is not None and hasattr(native, "bucket_copy"):
        native.bucket_copy(_copy_rows(native, copies), num_threads)
        return
    if (
        device.type == "cuda"
        and native is not None
        and not _cuda_kernel_failed
        and hasattr(native, "bucket_copy_cuda")
        and _device_supported(device.index)
    ):
        rows = _copy_rows(native, copies)
        try:
            with torch.cuda.device(device):
                native.bucket_copy_cuda(rows, torch.cuda.current_stream(device).cuda_stream)
            return
        except RuntimeError as exc:
            # E.g. a driver older than the CUDA runtime the extension was built with.
            _cuda_kernel_failed = True
            warnings.warn(
                f"areal_fast bucket_copy CUDA kernel failed ({exc}); using torch "
                f"copies from now on.",
                RuntimeWarning,
                stacklevel=3,
            )
    _run_copies_torch(copies)


def pack_bucket(
    plan: BucketPlan,
    k: int,
    tensors: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    *,
    num_threads: int | None = None,
) -> None:
    """Copy the chunks of bucket ``k`` from their source tensors into ``out``.

    Parameters
    ----------
    plan : BucketPlan
    k : int
        Bucket index in ``[0, plan.num_buckets)``.
    tensors : sequence of torch.Tensor (or None), length ``len(plan.specs)``
        ``tensors[i]`` is the source of ``plan.specs[i]``: contiguous, of shape
        ``specs[i].shape``, on the device of ``out``, of the spec's dtype or (for a float32 /
        bfloat16 / float16 spec) another of those three, which is cast to the spec's dtype.
        Entries of tensors without a chunk in bucket ``k`` are not read and may be None.
    out : torch.Tensor, uint8 [>= plan.bucket_sizes[k]]
        Contiguous, first byte 16-byte aligned, on the sources' device. Receives each chunk
        at its offset in the spec's dtype; padding bytes between chunks and bytes past
        ``bucket_sizes[k]`` are left as they were.
    num_threads : int, optional
        CPU threads of the native copy (default ``torch.get_num_threads()``); ignored on
        CUDA and by the torch fallback.

    On CUDA the copy is one kernel launch on the current stream (asynchronous, like any
    kernel); sources written on another stream must be synchronised by the caller.

    Raises
    ------
    ValueError
        ``k`` out of range, a bad ``out`` buffer, ``len(tensors)`` differing from the plan,
        or a source (named in the message) that is missing, of another shape, not
        contiguous, on another device or of a dtype that cannot be cast to the spec's.
    """
    chunks = plan.bucket_chunks(k)
    _check_buffer(plan, k, out, "out")
    if len(tensors) != len(plan.specs):
        raise ValueError(f"tensors has {len(tensors)} entries, the plan has {len(plan.specs)}")
    threads = _resolve_threads(num_threads)
    copies, checked = [], set()
    for c in chunks:
        spec, src = plan.specs[c.tensor], tensors[c.tensor]
        if c.tensor not in checked:
            _check_tensor(spec, src, out.device, "source", to_wire=True)
            checked.add(c.tensor)
        copies.append(
            _Copy(
                src,
                c.start * src.element_size(),
                src.dtype,
                out,
                c.offset,
                spec.torch_dtype,
                c.numel,
            )
        )
    _run_copies(copies, out.device, threads)


def unpack_bucket(
    plan: BucketPlan,
    k: int,
    bucket: torch.Tensor,
    targets: Sequence[torch.Tensor | None],
    *,
    num_threads: int | None = None,
) -> None:
    """Copy the chunks of bucket ``k`` from ``bucket`` into their target tensors.

    Parameters
    ----------
    plan : BucketPlan
    k : int
        Bucket index in ``[0, plan.num_buckets)``.
    bucket : torch.Tensor, uint8 [>= plan.bucket_sizes[k]]
        Contiguous, first byte 16-byte aligned, as written by :func:`pack_bucket`.
    targets : sequence of torch.Tensor or None, length ``len(plan.specs)``
        ``targets[i]`` receives elements ``[start, start + numel)`` (flattened) of each chunk
        of ``plan.specs[i]``, cast from the spec's dtype to the target's dtype (float32 /
        bfloat16 / float16 among each other, any other dtype only to itself); None skips
        that tensor. Targets must be contiguous, of the spec's shape, on the bucket's device.
    num_threads : int, optional
        CPU threads of the native copy (default ``torch.get_num_threads()``).

    Writes happen in place through the raw memory (autograd version counters of the
    targets are not bumped). On CUDA: one kernel launch on the current stream.

    Raises
    ------
    ValueError
        ``k`` out of range, a bad ``bucket`` buffer, ``len(targets)`` differing from the
        plan, or a target (named in the message) of another shape, not contiguous, on
        another device or of a dtype the spec's dtype cannot be cast to.
    """
    chunks = plan.bucket_chunks(k)
    _check_buffer(plan, k, bucket, "bucket")
    if len(targets) != len(plan.specs):
        raise ValueError(f"targets has {len(targets)} entries, the plan has {len(plan.specs)}")
    threads = _resolve_threads(num_threads)
    copies, checked = [], set()
    for c in chunks:
        spec, dst = plan.specs[c.tensor], targets[c.tensor]
        if dst is None:
            continue
        if c.tensor not in checked:
            _check_tensor(spec, dst, bucket.device, "target", to_wire=False)
            checked.add(c.tensor)
        copies.append(
            _Copy(
                bucket,
                c.offset,
                spec.torch_dtype,
                dst,
                c.start * dst.element_size(),
                dst.dtype,
                c.numel,
            )
        )
    _run_copies(copies, bucket.device, threads)


def bucket_view(
    plan: BucketPlan,
    k: int,
    tensors: Sequence[torch.Tensor | None],
    device: torch.device,
) -> torch.Tensor | None:
    """Bucket ``k`` as a byte range of the memory that already holds its tensors, or None.

    When tensors sit in one buffer laid out like the bucket — e.g. views of one buffer laid
    out by :func:`areal_fast.sync.shared_memory.plan_layout`, whose byte offsets are the
    aligned running sums that every bucket plan over the same specs shares — bucket ``k`` is
    one contiguous range of that buffer, and a transport can send it from there (or receive
    it there) with no pack or unpack copy. The bytes between two chunks are the buffer's own
    padding: sent as they are, or overwritten on receive.

    Parameters
    ----------
    plan : BucketPlan
    k : int
        Bucket index in ``[0, plan.num_buckets)``.
    tensors : sequence of torch.Tensor or None, length ``len(plan.specs)``
        ``tensors[i]`` holds ``plan.specs[i]``; entries of tensors without elements in bucket
        ``k`` are not looked at.
    device : torch.device
        Where the range must be (the transport's device).

    Returns
    -------
    torch.Tensor or None
        uint8 ``[plan.bucket_sizes[k]]``, a view (no copy) that starts at byte ``base`` of
        the tensors' storage, where for every chunk ``c`` of the bucket with elements,
        ``tensors[c.tensor]`` holds element ``c.start`` at byte ``base + c.offset``. None
        when a chunk's tensor is missing, not contiguous, not of the spec's dtype, not on
        ``device``, in another storage than the others, or elsewhere than that, or when the
        range does not lie inside the storage.

    Raises
    ------
    ValueError
        ``k`` out of range, or ``len(tensors)`` differing from the plan.
    """
    chunks = [c for c in plan.bucket_chunks(k) if c.numel > 0]
    if len(tensors) != len(plan.specs):
        raise ValueError(f"tensors has {len(tensors)} entries, the plan has {len(plan.specs)}")
    if not chunks:
        return None
    base, storage, first = None, None, None
    for c in chunks:
        spec, tensor = plan.specs[c.tensor], tensors[c.tensor]
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype != spec.torch_dtype
            or tensor.device != device
            or tuple(tensor.shape) != spec.shape
            or not tensor.is_contiguous()
        ):
            return None
        here = tensor.data_ptr() + c.start * spec.itemsize - c.offset
        ptr = tensor.untyped_storage().data_ptr()
        if base is None:
            base, storage, first = here, ptr, tensor
        elif here != base or ptr != storage:
            return None
    size = plan.bucket_sizes[k]
    start = base - storage
    if start < 0 or start + size > first.untyped_storage().nbytes():
        return None
    raw = first.detach().reshape(-1).view(torch.uint8)
    return raw.as_strided((size,), (1,), start)
