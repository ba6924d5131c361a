"""Same-machine weight transport: a complete set of named weights in one shared-memory file.

The trainer process writes its parameters into a flat, 256-byte-aligned buffer mapped from
a file under ``/dev/shm`` (``torch.from_file(shared=True)``); engine processes on the same
machine map the same file and copy from it. Only the small :class:`WeightBufferSpec`
(names, shapes, dtypes, offsets) crosses the process boundary. Two buffers used alternately
(version v in slot v % 2) let the trainer write version v + 1 while engines still read v.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from areal_fast.sync.buckets import ALIGNMENT, TensorSpec, plan_buckets


@dataclass(frozen=True)
class WeightEntry:
    """Where one named tensor lives in the buffer (bytes from the start)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int
    nbytes: int


@dataclass(frozen=True)
class CudaSlotSpec:
    """The CUDA twin of one weight slot: which GPU holds it and its CUDA-IPC export.

    Attributes
    ----------
    device_uuid : str
        UUID of the GPU (``torch.cuda.get_device_properties(d).uuid``).
    nbytes : int
        Size of the device buffer in bytes (the slot's ``total_bytes``).
    share : str
        JSON list of the eight ``_share_cuda_`` fields
        (:data:`areal_fast.sync.cuda_slots.SHARE_FIELDS`); bytes fields are
        ``{"b64": <base64 text>}``.
    """

    device_uuid: str
    nbytes: int
    share: str


@dataclass(frozen=True)
class WeightBufferSpec:
    """Everything a reader needs to map a buffer: file path, total size and the layout.

    ``cuda`` describes the slot's CUDA twin when the trainer also keeps one on its GPU (the
    same layout in device memory, shared by CUDA IPC: :mod:`areal_fast.sync.cuda_slots`).
    """

    path: str
    total_bytes: int
    entries: tuple[WeightEntry, ...]
    cuda: Optional[CudaSlotSpec] = None


def plan_layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[WeightEntry], int]:
    """Byte layout of ``named_tensors`` in their given order, each entry 256-byte aligned:
    the bucket planner's layout of one bucket that holds them all.

    Returns
    -------
    entries : list[WeightEntry]
    total_bytes : int

    Raises
    ------
    ValueError
        A name that appears twice.
    """
    specs = [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in named_tensors
    ]
    total = max(sum(-(-s.nbytes // ALIGNMENT) * ALIGNMENT for s in specs), ALIGNMENT)
    try:
        plan = plan_buckets(specs, total)
    except ValueError as exc:
        raise ValueError(f"weight buffer: {exc}") from None
    return [
        WeightEntry(s.name, s.shape, s.dtype, c.offset, s.nbytes)
        for s, c in zip(specs, plan.chunks)
    ], total


def reserve_file(folder: Path, nbytes: int, what: str) -> Path:
    """A new owner-only (0o600) file ``areal_fast-weights-<pid>-<random>`` of ``nbytes``
    bytes in ``folder``, its pages reserved now (``posix_fallocate``): a sparse file on a full
    tmpfs would fail later with SIGBUS on first write instead of this error.

    Raises
    ------
    OSError
        The file cannot be created or the bytes do not fit (the message starts with ``what``).
    """
    path = folder / f"areal_fast-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise OSError(
            exc.errno, f"{what}: {nbytes} bytes do not fit in {folder} ({exc.strerror})"
        ) from exc
    finally:
        os.close(fd)
    return path


def shm_dir() -> Path:
    """/dev/shm where it exists, else the temporary directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SharedWeightBuffer:
    """One mapped weight buffer (writer or reader side).

    Use :meth:`create` in the trainer and :meth:`attach` (with the creator's ``spec``) in
    engine processes. Reading while the writer writes yields a mix of versions, so the
    caller sequences them (the controller hands a buffer to engines only after the trainer
    finished writing it, and the trainer rewrites it only after every engine loaded it).
    """

    def __init__(self, spec: WeightBufferSpec, owner: bool):
        self.spec = spec
        self.owner = owner
        self._data = torch.from_file(
            spec.path, shared=True, size=spec.total_bytes, dtype=torch.uint8
        )

    @classmethod
    def create(
        cls, named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | None = None
    ) -> "SharedWeightBuffer":
        """A new zero-filled buffer laid out for ``named_tensors`` (their values are not copied).

        Raises
        ------
        OSError
            The file cannot be created (e.g. /dev/shm full).
        """
        entries, total = plan_layout(named_tensors)
        path = reserve_file(Path(directory) if directory else shm_dir(), total, "weight buffer")
        return cls(WeightBufferSpec(str(path), total, tuple(entries)), owner=True)

    @classmethod
    def attach(cls, spec: WeightBufferSpec) -> "SharedWeightBuffer":
        """Map an existing buffer described by ``spec``.

        Raises
        ------
        FileNotFoundError
            The buffer file no longer exists (its creator closed it).
        """
        if not Path(spec.path).is_file():
            raise FileNotFoundError(f"weight buffer {spec.path} does not exist")
        return cls(spec, owner=False)

    def view(self, entry: WeightEntry) -> torch.Tensor:
        """The tensor of ``entry`` as a view into the mapped buffer (no copy)."""
        dtype = getattr(torch, entry.dtype)
        raw = self._data[entry.offset : entry.offset + entry.nbytes]
        return raw.view(dtype).view(entry.shape)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``named_tensors`` into the buffer; returns the bytes written.

        Raises
        ------
        ValueError
            A name not in the layout, a shape or dtype that differs from it, or a layout
            entry left unwritten (each message names the tensor).
        """
        by_name = {e.name: e for e in self.spec.entries}
        written, total = set(), 0
        for name, tensor in named_tensors:
            entry = by_name.get(name)
            if entry is None:
                raise ValueError(f"weight buffer: no entry for tensor {name!r}")
            if (
                tuple(tensor.shape) != entry.shape
                or str(tensor.dtype).split(".")[-1] != entry.dtype
            ):
                raise ValueError(
                    f"weight buffer: {name!r} is {tuple(tensor.shape)} "
                    f"{tensor.dtype}, the layout says {entry.shape} {entry.dtype}"
                )
            self.view(entry).copy_(tensor.detach())
            written.add(name)
            total += entry.nbytes
        missing = [e.name for e in self.spec.entries if e.name not in written]
        if missing:
            raise ValueError(
                f"weight buffer: {len(missing)} tensors not written, first {missing[0]!r}"
            )
        return total

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) of every entry, in layout order (views alias the shared file)."""
        for entry in self.spec.entries:
            yield entry.name, self.view(entry)

    def close(self) -> None:
        """Unmap; the creator also deletes the file."""
        self._data = None
        if self.owner:
            Path(self.spec.path).unlink(missing_ok=True)


def remove_orphaned_buffers(directory: str | None = None) -> int:
    """Delete weight-buffer files whose creating process no longer exists (a trainer killed
    with SIGKILL cannot delete its own); returns how many were removed."""
    removed = 0
    for path in (Path(directory) if directory else shm_dir()).glob("areal_fast-weights-*-*"):
        try:
            pid = int(path.name.split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except (ValueError, IndexError, PermissionError):
            continue
    return removed
