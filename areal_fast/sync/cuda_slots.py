"""Same-GPU weight slots: a complete set of named weights in one CUDA buffer, shared by CUDA IPC.

When the trainer's parameters and a rollout worker's engine are on the same GPU, the trainer
keeps two device buffers beside its shared-memory slots (version v in slot v % 2), laid out
exactly like them (:func:`~areal_fast.sync.shared_memory.plan_layout`), and exports each
buffer once with CUDA IPC (``cudaIpcGetMemHandle`` through
``torch.UntypedStorage._share_cuda_``, as :class:`~areal_fast.sync.transports.CudaIpcTransport`
does for its buckets). The export travels as a
:class:`~areal_fast.sync.shared_memory.CudaSlotSpec` in the slot's
:class:`~areal_fast.sync.shared_memory.WeightBufferSpec` (its ``cuda`` field): the GPU's UUID
and the eight export fields as JSON text, bytes in base64. Nothing is pickled; a reader checks
the number and the type of every field before torch sees them, finds its device by the UUID
(indices differ between processes with different ``CUDA_VISIBLE_DEVICES``) and maps the
buffer once (``_new_shared_cuda``).

Ordering: the trainer copies a version in device to device and synchronises its device
before it reports the version (:meth:`CudaWeightSlot.finish_write`); an engine copies out of
the mapped slot device to device and synchronises before it acknowledges
(:meth:`CudaWeightSlot.finish_read`); the controller lets the trainer rewrite a slot only once
every worker serves a newer version than the one the slot held (two versions later), the rule
of the shared-memory slots.

Source: CUDA runtime IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle) through torch's storage
sharing, as ``torch.multiprocessing`` does for CUDA tensors (its reductions module).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import replace
from typing import Optional

import torch

from areal_fast.sync.shared_memory import CudaSlotSpec, SharedWeightBuffer, WeightBufferSpec
from areal_fast.sync.transports import cuda_device_by_uuid, cuda_device_uuid

# the fields of UntypedStorage._share_cuda_(): device index, IPC memory handle, storage bytes,
# storage offset in the allocation, ref-counter file name, its offset, IPC event handle, and
# whether the reader must wait for that event
SHARE_FIELDS = (
    ("device", int),
    ("handle", bytes),
    ("size_bytes", int),
    ("offset_bytes", int),
    ("ref_counter", bytes),
    ("ref_counter_offset", int),
    ("event_handle", bytes),
    ("event_sync_required", bool),
)


def encode_share(fields) -> str:
    """The eight fields of ``UntypedStorage._share_cuda_()`` as JSON text (bytes as base64).

    Raises
    ------
    ValueError
        Not eight fields, or a field whose type is not the one :data:`SHARE_FIELDS` names.
    """
    fields = tuple(fields)
    _check_fields(fields, "export")
    return json.dumps(
        [{"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for v in fields]
    )


def decode_share(text: str) -> tuple:
    """The fields :func:`encode_share` wrote, each checked for its type (JSON only, no pickle).

    Raises
    ------
    ValueError
        Not JSON, not a list of eight fields, a field of the wrong type or bad base64 (the
        message names the field).
    """
    try:
        raw = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"CUDA slot: the export is not JSON ({exc})") from None
    if not isinstance(raw, list) or len(raw) != len(SHARE_FIELDS):
        raise ValueError(f"CUDA slot: the export must be a list of {len(SHARE_FIELDS)} fields")
    out = []
    for value, (name, kind) in zip(raw, SHARE_FIELDS):
        if kind is bytes:
            if (
                not isinstance(value, dict)
                or set(value) != {"b64"}
                or not isinstance(value["b64"], str)
            ):
                raise ValueError(f"CUDA slot: export field {name!r} is not {{'b64': text}}")
            try:
                value = base64.b64decode(value["b64"], validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"CUDA slot: export field {name!r} is not base64") from None
        out.append(value)
    fields = tuple(out)
    _check_fields(fields, "export")
    return fields


def _check_fields(fields: tuple, what: str) -> None:
    if len(fields) != len(SHARE_FIELDS):
        raise ValueError(f"CUDA slot: the {what} has {len(fields)} fields, expected 8")
    for value, (name, kind) in zip(fields, SHARE_FIELDS):
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if wrong or (kind is int and value < 0):
            raise ValueError(
                f"CUDA slot: {what} field {name!r} is {type(value).__name__} {value!r:.40}, "
                f"expected a {'non-negative int' if kind is int else kind.__name__}"
            )


def slot_gpu(spec: WeightBufferSpec) -> str:
    """The GPU UUID of ``spec``'s CUDA twin ("" when the slot has none)."""
    cuda = getattr(spec, "cuda", None)
    return cuda.device_uuid if cuda is not None else ""


def engine_gpu(engine) -> str:
    """UUID of the GPU an in-process engine serves from, for CUDA-IPC slots; "" for an engine
    on the CPU and for one that maps the host slots itself (``update_weights_from_buffer``:
    a serving engine in other processes)."""
    if hasattr(engine, "update_weights_from_buffer"):
        return ""
    device = getattr(engine, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return ""
    return cuda_device_uuid(device)


class CudaWeightSlot(SharedWeightBuffer):
    """One weight slot in device memory, shared by CUDA IPC (writer or reader side).

    :meth:`create` in the trainer (from its host slot's layout), :meth:`attach` in an engine
    process on the same GPU. The layout (``spec.entries``), :meth:`view`, :meth:`write` and
    :meth:`named_tensors` are those of :class:`SharedWeightBuffer`; views are CUDA tensors.
    """

    def __init__(self, spec: WeightBufferSpec, data: torch.Tensor, owner: bool):
        self.spec, self.owner, self._data = spec, owner, data
        self.device = data.device

    @classmethod
    def create(cls, layout: WeightBufferSpec, device) -> "CudaWeightSlot":
        """A zero-filled device buffer of ``layout.total_bytes`` on ``device``, exported once;
        its ``spec`` is ``layout`` with the export in ``cuda``.

        Raises
        ------
        ValueError
            ``device`` is not a CUDA device.
        torch.OutOfMemoryError
            The buffer does not fit on the GPU.
        """
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA weight slot: device {device} is not a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        data = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        share = encode_share(data.untyped_storage()._share_cuda_())
        cuda = CudaSlotSpec(cuda_device_uuid(device), layout.total_bytes, share)
        return cls(replace(layout, cuda=cuda), data, owner=True)

    @classmethod
    def attach(cls, spec: WeightBufferSpec) -> "CudaWeightSlot":
        """Map the device buffer of ``spec.cuda`` (another process's) on this process's
        device with the same GPU UUID.

        Raises
        ------
        ValueError
            ``spec`` has no CUDA twin, or its export is malformed or smaller than the layout.
        areal_fast.sync.transports.WeightSyncError
            No visible GPU has the slot's UUID.
        RuntimeError
            CUDA refused to open the IPC handle (e.g. the writer is gone).
        """
        cuda: Optional[CudaSlotSpec] = getattr(spec, "cuda", None)
        if cuda is None:
            raise ValueError(f"weight slot {spec.path}: it has no CUDA twin to map")
        fields = list(decode_share(cuda.share))
        if fields[2] < spec.total_bytes or cuda.nbytes < spec.total_bytes:
            raise ValueError(
                f"CUDA slot: the export holds {fields[2]} bytes, the layout needs "
                f"{spec.total_bytes}"
            )
        device = cuda_device_by_uuid(cuda.device_uuid)
        fields[0] = device.index
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
        data = torch.empty(0, dtype=torch.uint8, device=device)
        data.set_(storage, 0, (spec.total_bytes,), (1,))
        return cls(spec, data, owner=False)

    def finish_write(self) -> None:
        """Writer: wait until every copy into the slot is done on the device (before the
        version is reported, so a reader in another process sees all of it)."""
        torch.cuda.synchronize(self.device)

    def finish_read(self) -> None:
        """Reader: wait until every copy out of the slot is done (before acknowledging, after
        which the writer may rewrite the slot)."""
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Drop the buffer (a reader's mapping is closed once its last view is gone)."""
        self._data = None
