"""Weight-sync transports: move uint8 buckets from one sender (rank 0) to engine ranks.

Every transport implements :class:`Transport`; the sender and receiver pipelines
(:mod:`areal_fast.sync.sender`, :mod:`areal_fast.sync.receiver`) only call that interface, so
NCCL, gloo, CUDA IPC, shared memory and disk share every line above the transport call.

=====================  ==================================  =================================
transport              data path                           use
=====================  ==================================  =================================
``TorchDistTransport``  ``broadcast`` on a stand-alone       NCCL (GPU engines on other
                        gloo or NCCL process group           devices/nodes); gloo (CPU)
``CudaIpcTransport``    engine maps the trainer's two        engine on the same GPU: reads
                        bucket buffers (CUDA IPC handles)     the bucket in place (zero-copy)
``SharedMemoryTransport`` same, /dev/shm files               engines on the same machine
``DiskTransport``       one safetensors file per bucket      fallback; any shared filesystem
=====================  ==================================  =================================

Every call takes a timeout in seconds and raises :class:`WeightSyncTimeout` (a
``TimeoutError``) naming the operation, the bucket and the peers when it expires, or
:class:`WeightSyncError` naming the peer when one disappears. Process groups are created
stand-alone (:func:`init_sync_group`), never as the default group, so a trainer's FSDP group
or an engine's own groups are untouched. Headers are JSON; nothing is unpickled.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import os
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from areal_fast.sync.shared_memory import reserve_file, shm_dir

STATUS_BYTES = 1024  # room for one status message per rank in gather_status


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the tensor, bucket, file or peer."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight-sync operation did not finish within its timeout."""


class Pending:
    """A transfer in flight; :meth:`wait` returns the bucket (uint8 tensor) or raises."""

    def __init__(self, wait: Callable[[float], torch.Tensor]):
        self._wait = wait

    def wait(self, timeout: float) -> torch.Tensor:
        """Block until the transfer is done, at most ``timeout`` seconds.

        Raises
        ------
        WeightSyncTimeout
            Not done in time.
        WeightSyncError
            The peer disappeared or the data is damaged.
        """
        return self._wait(timeout)


def parse_header(raw, where: str) -> dict:
    """A header's JSON object; a malformed one becomes ``{"_transport_error": reason}``,
    which the receiver answers in the accept round (so the sender learns it at once)."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        return header
    except ValueError as exc:
        return {"_transport_error": f"{where} is not a valid JSON object ({exc})"}


def _check_timeout(timeout: float) -> float:
    if not (isinstance(timeout, (int, float)) and 0 < timeout and math.isfinite(timeout)):
        raise ValueError(
            f"weight-sync timeout = {timeout!r} must be a positive, finite number of seconds"
        )
    return float(timeout)


class Transport(ABC):
    """One endpoint of a weight-sync channel: rank 0 sends, ranks 1..world_size-1 receive.

    The pipelines call, per update: ``send_buffers`` (sender) → ``send_header`` /
    ``recv_header`` → ``gather_status`` (plan accepted?) → per bucket ``start_send`` /
    ``start_recv`` and ``release`` → ``gather_status`` (update complete?). A receiver always
    starts receiving bucket k + 1 before it releases bucket k, and the sender starts bucket
    k + 2 only after every receiver released bucket k (double buffering, two slots).

    Attributes
    ----------
    rank, world_size : int
    device : torch.device
        Where buckets live (the sender packs into ``send_buffers``, receivers unpack from the
        tensor that ``start_recv(...).wait()`` returns).
    """

    rank: int
    world_size: int
    device: torch.device
    #: Whether start_send_direct / start_recv_into move a bucket from / into any contiguous
    #: uint8 view (a bucket that is one chunk of one tensor then skips the pack or unpack copy).
    supports_direct: bool = False
    #: Why this endpoint is unusable (a collective failed or timed out, so ranks may no
    #: longer agree on which operation comes next); ``None`` while healthy.
    broken: Optional[str] = None

    @property
    def is_sender(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def mark_broken(self, reason: str) -> None:
        """Refuse every later operation: after a failure part-way through an update the
        ranks' sequences of collectives no longer match (create a new group and transport)."""
        if self.broken is None:
            self.broken = reason

    def check_usable(self) -> None:
        """Raise if :meth:`mark_broken` was called.

        Raises
        ------
        WeightSyncError
            Naming the earlier failure.
        """
        if self.broken is not None:
            raise WeightSyncError(
                f"{type(self).__name__} is unusable after an earlier failure "
                f"({self.broken}); create a new group and transport"
            )

    def accepted(self) -> None:
        """Sender: every receiver accepted the plan (mapped transports may now drop names
        that only served to find the buffers)."""

    @abstractmethod
    def send_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two uint8 buffers of at least ``nbytes`` the sender packs into (slot 0, 1)."""

    @abstractmethod
    def send_header(self, header: dict, timeout: float) -> None:
        """Send a JSON-able dict to every receiver."""

    @abstractmethod
    def recv_header(self, timeout: float) -> dict:
        """Receive the sender's header."""

    @abstractmethod
    def start_send(self, slot: int, nbytes: int, index: int) -> Pending:
        """Start sending the first ``nbytes`` of ``send_buffers(...)[slot]`` as bucket ``index``."""

    @abstractmethod
    def start_recv(self, nbytes: int, index: int) -> Pending:
        """Start receiving bucket ``index`` of ``nbytes`` bytes."""

    def start_send_direct(self, data: torch.Tensor, index: int) -> Pending:
        """Send the contiguous uint8 tensor ``data`` as bucket ``index`` (``supports_direct``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot send from arbitrary memory")

    def start_recv_into(self, out: torch.Tensor, index: int) -> Pending:
        """Receive bucket ``index`` straight into the contiguous uint8 tensor ``out``."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive into arbitrary memory")

    def release(self, index: int, timeout: float) -> None:
        """The receiver is done reading bucket ``index`` (the sender may reuse its slot)."""

    def wait_slot_free(self, index: int, timeout: float) -> None:
        """Sender: before packing bucket ``index`` into slot ``index % 2``, wait until every
        receiver released bucket ``index - 2`` (mapped transports; others return at once)."""

    def finish_send(self, num_buckets: int, timeout: float) -> None:
        """Sender: wait until receivers released every bucket (mapped transports)."""

    @abstractmethod
    def gather_status(self, message: str, timeout: float) -> list[str]:
        """Every rank contributes ``message`` ('' = ok); returns all of them in rank order."""

    def barrier(self, timeout: float) -> None:
        """Wait until every rank reached this point."""
        self.gather_status("", timeout)

    def close(self) -> None:
        """Release buffers and the process group / files owned by this endpoint."""


# --------------------------------------------------------------------------- process groups


def init_sync_group(
    rank: int,
    world_size: int,
    master_port: int,
    *,
    master_addr: str = "127.0.0.1",
    backend: str = "gloo",
    timeout: float = 60.0,
    device: Optional[torch.device] = None,
):
    """A stand-alone process group for weight sync (not the default group).

    Parameters
    ----------
    rank, world_size : int
        0 is the sender (trainer rank 0); 1..world_size-1 are engine ranks.
    master_port : int
        TCP port of the rendezvous store, listened on by rank 0 at ``master_addr``.
    master_addr : str
        Address of rank 0; 127.0.0.1 (this machine only) unless configured.
    backend : {"gloo", "nccl"}
    timeout : float
        Seconds for the rendezvous and the group's default operation timeout.
    device : torch.device, optional
        CUDA device of this rank for NCCL (default: the current device).

    Returns
    -------
    torch.distributed.ProcessGroup

    Raises
    ------
    ValueError
        Bad rank/world size/backend.
    WeightSyncTimeout
        Peers did not join within ``timeout``.
    """
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"weight-sync group: rank {rank} / world_size {world_size} invalid "
            f"(need world_size >= 2 and 0 <= rank < world_size)"
        )
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-sync group: backend = {backend!r}, expected 'gloo' or 'nccl'")
    delta = datetime.timedelta(seconds=_check_timeout(timeout))
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=delta)
        store = dist.PrefixStore(f"areal_fast_sync_{backend}", store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, delta)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        if device is not None:
            torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except RuntimeError as exc:
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise WeightSyncTimeout(
                f"weight-sync group: rank {rank} of {world_size} could not meet its peers at "
                f"{master_addr}:{master_port} within {timeout:g} s"
            ) from exc
        raise WeightSyncError(
            f"weight-sync group at {master_addr}:{master_port}: {str(exc).splitlines()[0]}"
        ) from exc


def _wait_work(work, timeout: float, what: str, backend: str, world_size: int) -> None:
    """Wait for a c10d Work with a deadline; translate failures into WeightSync errors."""
    peers = f"ranks 0..{world_size - 1}"
    try:
        if backend == "nccl":
            deadline = time.monotonic() + timeout
            while not work.is_completed():  # non-blocking query of the CUDA event
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(
                        f"weight sync ({backend}): {what} did not finish "
                        f"within {timeout:g} s ({peers})"
                    )
                time.sleep(0.0005)
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except WeightSyncError:
        raise
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower():
            raise WeightSyncTimeout(
                f"weight sync ({backend}): {what} did not finish within {timeout:g} s ({peers})"
            ) from exc
        peer = ""
        match = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text.split("]", 1)[-1])
        if match:
            peer = f" — peer {match.group(1)}:{match.group(2)} disappeared"
        raise WeightSyncError(
            f"weight sync ({backend}): {what} failed{peer} ({text.splitlines()[0][:200]})"
        ) from exc


class TorchDistTransport(Transport):
    """Buckets broadcast from rank 0 over a torch.distributed process group (gloo or NCCL).

    The NCCL and gloo paths are the same code; only the group's backend and the device of the
    buckets differ (CPU for gloo, the rank's GPU for NCCL).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        From :func:`init_sync_group` (rank 0 = sender).
    backend : {"gloo", "nccl"}, optional
        Default: the group's own backend (``group.name()``).
    device : torch.device, optional
        Default: CPU for gloo, the current CUDA device for NCCL.
    group_timeout : float, optional
        The group's own operation timeout (``init_sync_group``'s ``timeout``); no wait can
        outlast it, so longer per-call timeouts are cut to it (and the message says so).

    Any failed or timed-out operation marks the transport broken (:meth:`mark_broken`): the
    ranks' collectives may no longer pair up, so later calls raise at once.

    Source
    ------
    ``ProcessGroup.broadcast`` / ``allgather`` of torch.distributed (c10d).
    """

    def __init__(
        self,
        group,
        backend: Optional[str] = None,
        device: Optional[torch.device] = None,
        group_timeout: Optional[float] = None,
    ):
        if backend is None:
            name = getattr(group, "name", lambda: "gloo")()
            backend = "nccl" if "nccl" in str(name).lower() else "gloo"
        self.group = group
        self.backend = backend
        self.group_timeout = group_timeout
        self.rank, self.world_size = group.rank(), group.size()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self._send: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._recv: list[Optional[torch.Tensor]] = [None, None]

    def _broadcast(self, tensor: torch.Tensor):
        self.check_usable()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([tensor], opts)

    def _run(self, work, timeout: float, what: str) -> None:
        timeout = _check_timeout(timeout)
        if self.group_timeout is not None:
            timeout = min(timeout, self.group_timeout)
        try:
            _wait_work(work, timeout, what, self.backend, self.world_size)
        except WeightSyncError as exc:
            self.mark_broken(str(exc))
            raise

    def _post(self, make_work):
        self.check_usable()
        return make_work()

    def send_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._send is None or self._send[0].numel() < nbytes:
            self._send = (
                torch.empty(nbytes, dtype=torch.uint8, device=self.device),
                torch.empty(nbytes, dtype=torch.uint8, device=self.device),
            )
        return self._send

    def send_header(self, header: dict, timeout: float) -> None:
        self.check_usable()
        payload = json.dumps(header).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._run(self._broadcast(size), timeout, "header size broadcast")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self._run(self._broadcast(data), timeout, "header broadcast")

    def recv_header(self, timeout: float) -> dict:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._run(self._broadcast(size), timeout, "header size broadcast")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._run(self._broadcast(data), timeout, "header broadcast")
        return parse_header(bytes(data.cpu().numpy()), "the header")

    def start_send(self, slot: int, nbytes: int, index: int) -> Pending:
        work = self._broadcast(self._send[slot][:nbytes])
        what = f"bucket {index} ({nbytes} bytes) broadcast"
        return Pending(lambda timeout: (self._run(work, timeout, what), self._send[slot])[1])

    def start_recv(self, nbytes: int, index: int) -> Pending:
        slot = index % 2
        if self._recv[slot] is None or self._recv[slot].numel() < nbytes:
            self._recv[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.start_recv_into(self._recv[slot][:nbytes], index)

    supports_direct = True

    def start_send_direct(self, data: torch.Tensor, index: int) -> Pending:
        work = self._broadcast(data)
        what = f"bucket {index} ({data.numel()} bytes) broadcast"
        return Pending(lambda timeout: (self._run(work, timeout, what), data)[1])

    def start_recv_into(self, out: torch.Tensor, index: int) -> Pending:
        work = self._broadcast(out)
        what = f"bucket {index} ({out.numel()} bytes) broadcast"
        return Pending(lambda timeout: (self._run(work, timeout, what), out)[1])

    def gather_status(self, message: str, timeout: float) -> list[str]:
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        raw = message.encode()[:STATUS_BYTES]
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        mine = mine.to(self.device)
        outs = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = self._post(lambda: self.group.allgather([outs], [mine]))
        self._run(work, timeout, "status exchange")
        return [bytes(o.cpu().numpy()).rstrip(b"\0").decode(errors="replace") for o in outs]

    def close(self) -> None:
        self._send, self._recv = None, [None, None]
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass


# --------------------------------------------------------------------------- mapped buffers


class _MappedTransport(Transport):
    """Sender-owned buffers that receivers map and read in place; control over a gloo group.

    The sender's two slots are described in the header (``_slots``: per receiver rank, two
    descriptors); a receiver maps them once and keeps the mapping while they stay the same. A
    receiver that cannot map them rejects the update in the accept round. Per bucket the
    sender broadcasts a notice ``[index, slot, nbytes]`` on the control group; each receiver
    joins one all-reduce per bucket when it has released it, which is what lets the sender
    refill that slot (two buckets later).
    """

    def __init__(self, control_group, group_timeout: Optional[float] = None):
        self.control = TorchDistTransport(
            control_group, "gloo", torch.device("cpu"), group_timeout=group_timeout
        )
        self.rank, self.world_size = self.control.rank, self.control.world_size
        self._slots: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._mapped: dict[str, torch.Tensor] = {}
        self._receiver_slots: list[torch.Tensor] = []
        self._acked = 0

    # subclasses: allocate / describe (once per receiver) / map one slot
    @abstractmethod
    def _allocate(self, nbytes: int) -> torch.Tensor: ...

    @abstractmethod
    def _describe(self, slot: int, buf: torch.Tensor) -> dict: ...

    @abstractmethod
    def _map(self, descriptor: dict) -> torch.Tensor: ...

    @property
    def broken(self) -> Optional[str]:  # type: ignore[override]
        return self.control.broken

    def mark_broken(self, reason: str) -> None:
        self.control.mark_broken(reason)

    def _before_notice(self) -> None:
        """Make the packed bytes visible to other processes (CUDA: sync the stream)."""

    def _after_read(self) -> None:
        """Receiver: make sure its reads of the bucket finished before it releases it."""

    def send_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        nbytes = max(nbytes, 256)
        if self._slots is None or self._slots[0].numel() < nbytes:
            self._free_slots()
            self._slots = (self._allocate(nbytes), self._allocate(nbytes))
            self._descriptors = {
                str(rank): [self._describe(i, buf) for i, buf in enumerate(self._slots)]
                for rank in range(1, self.world_size)
            }
        return self._slots

    def _free_slots(self) -> None:
        self._slots, self._descriptors = None, {}

    def send_header(self, header: dict, timeout: float) -> None:
        if self._slots is None:
            raise WeightSyncError("mapped transport: send_buffers() must come before the header")
        self._acked = 0
        self.control.send_header({**header, "_slots": self._descriptors}, timeout)

    def recv_header(self, timeout: float) -> dict:
        header = self.control.recv_header(timeout)
        raw = header.pop("_slots", None)
        slots = raw.get(str(self.rank)) if isinstance(raw, dict) else None
        try:
            if not isinstance(slots, list) or len(slots) != 2:
                raise WeightSyncError("header carries no '_slots' descriptors for this rank")
            self._receiver_slots = self._map_all(slots)
        except Exception as exc:  # becomes this rank's verdict in the accept round
            self._receiver_slots = []
            header["_transport_error"] = (
                f"{type(self).__name__} cannot map the sender's buffers: {exc}"
            )
        return header

    def _map_all(self, descriptors: list) -> list[torch.Tensor]:
        keys = [json.dumps(d, sort_keys=True) for d in descriptors]
        if set(keys) != set(self._mapped):  # new slots: drop the old mappings first
            self._mapped = {}
            for key, descriptor in zip(keys, descriptors):
                self._mapped[key] = self._map(descriptor)
        return [self._mapped[key] for key in keys]

    @staticmethod
    def _notice(values: Optional[list[int]] = None) -> torch.Tensor:
        return torch.tensor(values if values else [0, 0, 0], dtype=torch.int64)

    def _ack(self, index: int, timeout: float) -> None:
        flag = torch.zeros(1, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = self.control._post(lambda: self.control.group.allreduce([flag], opts))
        self.control._run(work, timeout, f"release of bucket {index}")

    def start_send(self, slot: int, nbytes: int, index: int) -> Pending:
        if index >= 2 and self._acked <= index - 2:
            raise WeightSyncError(
                f"mapped transport: bucket {index} sent into slot {slot} "
                f"before bucket {index - 2} was released (wait_slot_free)"
            )
        self._before_notice()
        notice = self._notice([index, slot, nbytes])
        work = self.control._broadcast(notice)
        what = f"bucket {index} notice"

        def wait(timeout: float) -> torch.Tensor:
            self.control._run(work, timeout, what)
            return self._slots[slot]

        return Pending(wait)

    def wait_slot_free(self, index: int, timeout: float) -> None:
        while self._acked <= index - 2:
            self._ack(self._acked, timeout)
            self._acked += 1

    def finish_send(self, num_buckets: int, timeout: float) -> None:
        while self._acked < num_buckets:
            self._ack(self._acked, timeout)
            self._acked += 1

    def start_recv(self, nbytes: int, index: int) -> Pending:
        notice = self._notice()
        work = self.control._broadcast(notice)

        def wait(timeout: float) -> torch.Tensor:
            self.control._run(work, timeout, f"bucket {index} notice")
            got_index, slot, size = (int(v) for v in notice.tolist())
            if got_index != index or size != nbytes or slot not in (0, 1):
                raise WeightSyncError(
                    f"mapped transport: expected bucket {index} of {nbytes} "
                    f"bytes, the sender announced bucket {got_index} of {size} "
                    f"bytes in slot {slot}"
                )
            buf = self._receiver_slots[slot]
            if buf.numel() < nbytes:
                raise WeightSyncError(
                    f"mapped transport: bucket {index} ({nbytes} bytes) "
                    f"overruns slot {slot} ({buf.numel()} bytes)"
                )
            return buf[:nbytes]

        return Pending(wait)

    def release(self, index: int, timeout: float) -> None:
        self._after_read()
        self._ack(index, timeout)

    def gather_status(self, message: str, timeout: float) -> list[str]:
        return self.control.gather_status(message, timeout)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device

    def close(self) -> None:
        self._mapped, self._receiver_slots = {}, []
        self._free_slots()
        self.control.close()


class SharedMemoryTransport(_MappedTransport):
    """Engines on the same machine read the sender's buckets in place from /dev/shm files.

    The two slot files are created owner-only (0o600) with their pages reserved
    (``posix_fallocate``), so a full /dev/shm fails here, not later with SIGBUS.

    Parameters
    ----------
    control_group : torch.distributed.ProcessGroup
        gloo group from :func:`init_sync_group` (rank 0 = sender).
    directory : str, optional
        Where the slot files live (default /dev/shm).
    """

    def __init__(
        self, control_group, directory: Optional[str] = None, group_timeout: Optional[float] = None
    ):
        super().__init__(control_group, group_timeout)
        self._device = torch.device("cpu")
        self._dir = Path(directory) if directory else shm_dir()
        self._paths: list[Path] = []
        self._slot_paths: list[str] = []

    def accepted(self) -> None:
        # every receiver mapped the slots before answering: the names can go, so a killed
        # sender leaves nothing behind in /dev/shm (the mappings stay valid)
        for path in self._paths:
            path.unlink(missing_ok=True)

    def _describe(self, slot: int, buf: torch.Tensor) -> dict:
        return {"path": self._slot_paths[slot], "nbytes": buf.numel()}

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            path = reserve_file(self._dir, nbytes, "shared-memory transport")
        except OSError as exc:
            raise WeightSyncError(str(exc)) from exc
        self._paths.append(path)
        self._slot_paths.append(str(path))
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    def _map(self, descriptor: dict) -> torch.Tensor:
        path = descriptor.get("path")
        if not path or not Path(path).is_file():
            raise WeightSyncError(f"shared-memory transport: slot file {path!r} does not exist")
        return torch.from_file(path, shared=True, size=int(descriptor["nbytes"]), dtype=torch.uint8)

    def _free_slots(self) -> None:
        super()._free_slots()
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._paths, self._slot_paths = [], []


def cuda_device_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device (stable across processes, unlike an index under differing
    ``CUDA_VISIBLE_DEVICES``)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def cuda_device_by_uuid(device_uuid: str) -> torch.device:
    """The local CUDA device whose UUID is ``device_uuid``.

    Raises
    ------
    WeightSyncError
        No visible device has that UUID (the engine is not on the trainer's GPU).
    """
    for index in range(torch.cuda.device_count()):
        if cuda_device_uuid(torch.device("cuda", index)) == device_uuid:
            return torch.device("cuda", index)
    raise WeightSyncError(
        f"CUDA IPC: the sender's GPU {device_uuid} is not visible in this "
        f"process (CUDA IPC needs the engine on the same GPU)"
    )


class CudaIpcTransport(_MappedTransport):
    """An engine on the trainer's GPU reads the trainer's buckets in place (CUDA IPC).

    The sender's two bucket buffers are exported once with ``cudaIpcGetMemHandle`` (through
    torch's storage sharing); the handle travels in the JSON header (base64) keyed by the
    device UUID, and the receiver maps it on its device with that UUID. Streams are
    synchronised before a notice (sender) and before a release (receiver).

    Parameters
    ----------
    control_group : torch.distributed.ProcessGroup
        gloo group from :func:`init_sync_group` (rank 0 = sender).
    device : torch.device
        This process's CUDA device.

    Source
    ------
    CUDA runtime IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle) via
    ``torch.UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, as torch.multiprocessing
    does for CUDA tensors.
    """

    def __init__(self, control_group, device: torch.device, group_timeout: Optional[float] = None):
        super().__init__(control_group, group_timeout)
        self._device = torch.device(device)
        if self._device.type != "cuda":
            raise ValueError(f"CudaIpcTransport: device {self._device} is not a CUDA device")
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def _describe(self, slot: int, buf: torch.Tensor) -> dict:
        # one export per receiver: torch counts each export as one consumer reference
        shared = buf.untyped_storage()._share_cuda_()
        fields = [base64.b64encode(v).decode() if isinstance(v, bytes) else v for v in shared]
        return {
            "uuid": cuda_device_uuid(self._device),
            "nbytes": buf.numel(),
            "share": fields,
            "binary": [isinstance(v, bytes) for v in shared],
        }

    def _map(self, descriptor: dict) -> torch.Tensor:
        device = cuda_device_by_uuid(descriptor["uuid"])
        if device != self._device:
            raise WeightSyncError(
                f"CUDA IPC: the sender's buffers are on {device} (UUID "
                f"{descriptor['uuid']}), this engine runs on {self._device}"
            )
        fields = [
            base64.b64decode(v) if is_bytes else v
            for v, is_bytes in zip(descriptor["share"], descriptor["binary"])
        ]
        fields[0] = device.index
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
        buf = torch.empty(0, dtype=torch.uint8, device=device)
        buf.set_(storage, 0, (int(descriptor["nbytes"]),), (1,))
        return buf

    def _before_notice(self) -> None:
        torch.cuda.current_stream(self._device).synchronize()

    def _after_read(self) -> None:
        torch.cuda.current_stream(self._device).synchronize()


# --------------------------------------------------------------------------- disk


class DiskTransport(Transport):
    """Fallback: each bucket is a safetensors file in a shared directory.

    Update r of run ``run_id`` lives in ``<directory>/<run_id>-update-<r>/``: ``header.json``
    then ``bucket-<k>.safetensors`` and ``status-<tag>-<rank>.txt`` files (the run id keeps a
    receiver from reading an earlier run's files in a reused directory); every file is written under a temporary name and
    renamed, so a reader never sees a partial file unless the writer's disk lies. The sender
    deletes update r - 1 once every receiver acknowledged update r.

    Parameters
    ----------
    directory : str
        Shared directory (created if missing).
    rank, world_size : int
        0 = sender.
    run_id : str
        The same string on every rank of this job, e.g. a UUID the launcher hands out
        (letters, digits, ``-`` and ``_``).
    poll_interval : float
        Seconds between checks for a file (> 0).

    Raises
    ------
    ValueError
        Bad rank / world size / run id / poll interval, or (sender) the directory already holds
        updates of this run id.

    Source
    ------
    safetensors (``safetensors.torch.save_file`` / ``load_file``).
    """

    def __init__(
        self, directory: str, rank: int, world_size: int, run_id: str, poll_interval: float = 0.005
    ):
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"DiskTransport: rank {rank} / world_size {world_size} invalid")
        if not (isinstance(run_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id)):
            raise ValueError(
                f"DiskTransport: run_id = {run_id!r} must be 1-64 letters, digits, '-' or '_'"
            )
        if not (isinstance(poll_interval, (int, float)) and 0 < poll_interval < 60):
            raise ValueError(
                f"DiskTransport: poll_interval = {poll_interval!r} must be in (0, 60) seconds"
            )
        self.root = Path(directory)
        self.run_id = run_id
        self.root.mkdir(parents=True, exist_ok=True)
        if rank == 0 and any(self.root.glob(f"{run_id}-update-*")):
            raise ValueError(
                f"DiskTransport: {directory} already holds updates of run "
                f"{run_id!r}; use a new run id"
            )
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")
        self.poll_interval = poll_interval
        self._round = -1
        self._status_count = 0
        self._send: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="areal_fast-disk")

    def _round_dir(self, number: int) -> Path:
        return self.root / f"{self.run_id}-update-{number}"

    @property
    def _dir(self) -> Path:
        return self._round_dir(self._round)

    def _write_atomic(self, path: Path, write: Callable[[str], None]) -> None:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        write(str(tmp))
        os.replace(tmp, path)

    def _wait_file(self, path: Path, timeout: float, what: str) -> None:
        deadline = time.monotonic() + _check_timeout(timeout)
        while not path.exists():
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"disk transport: {what} ({path}) did not appear within {timeout:g} s"
                )
            time.sleep(self.poll_interval)

    def send_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._send is None or self._send[0].numel() < nbytes:
            self._send = (
                torch.empty(nbytes, dtype=torch.uint8),
                torch.empty(nbytes, dtype=torch.uint8),
            )
        return self._send

    def send_header(self, header: dict, timeout: float) -> None:
        self._round += 1
        self._status_count = 0
        self._dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(header)
        self._write_atomic(self._dir / "header.json", lambda p: Path(p).write_text(text))

    def recv_header(self, timeout: float) -> dict:
        path = self._round_dir(self._round + 1) / "header.json"
        self._wait_file(path, timeout, f"header of update {self._round + 1}")
        self._round += 1  # only once the header is there: a timed-out wait can be retried
        self._status_count = 0
        return parse_header(path.read_text(), str(path))

    def start_send(self, slot: int, nbytes: int, index: int) -> Pending:
        from safetensors.torch import save_file

        bucket = self._send[slot][:nbytes].clone()  # the slot is refilled while this writes
        path = self._dir / f"bucket-{index}.safetensors"
        future: Future = self._pool.submit(
            self._write_atomic, path, lambda p: save_file({"bucket": bucket}, p)
        )

        def wait(timeout: float) -> torch.Tensor:
            try:
                future.result(timeout=_check_timeout(timeout))
            except TimeoutError as exc:
                raise WeightSyncTimeout(
                    f"disk transport: writing {path} took over {timeout:g} s"
                ) from exc
            except OSError as exc:
                raise WeightSyncError(f"disk transport: cannot write {path} ({exc})") from exc
            return self._send[slot]

        return Pending(wait)

    def start_recv(self, nbytes: int, index: int) -> Pending:
        path = self._dir / f"bucket-{index}.safetensors"

        def wait(timeout: float) -> torch.Tensor:
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            self._wait_file(path, timeout, f"bucket {index}")
            try:
                bucket = load_file(str(path))["bucket"]
            except (SafetensorError, KeyError, OSError) as exc:
                raise WeightSyncError(
                    f"disk transport: bucket {index} file {path} is damaged "
                    f"({str(exc).splitlines()[0][:160]})"
                ) from exc
            if bucket.dtype != torch.uint8 or bucket.numel() != nbytes:
                raise WeightSyncError(
                    f"disk transport: bucket {index} file {path} holds "
                    f"{bucket.numel()} bytes, the plan says {nbytes} "
                    f"(truncated or from another update)"
                )
            if bucket.data_ptr() % 256:  # the file's header length decides the alignment
                bucket = bucket.clone()
            return bucket

        return Pending(wait)

    def gather_status(self, message: str, timeout: float) -> list[str]:
        tag = self._status_count
        self._status_count += 1
        mine = self._dir / f"status-{tag}-{self.rank}.txt"
        self._write_atomic(mine, lambda p: Path(p).write_text(message))
        out = []
        deadline = time.monotonic() + _check_timeout(timeout)
        for rank in range(self.world_size):
            path = self._dir / f"status-{tag}-{rank}.txt"
            self._wait_file(
                path, max(deadline - time.monotonic(), 1e-3), f"status {tag} of rank {rank}"
            )
            out.append(path.read_text())
        if self.rank == 0 and self._round >= 1:  # every rank is past update r - 1
            self._remove_round(self._round - 1)
        return out

    def _remove_round(self, number: int) -> None:
        shutil.rmtree(self._round_dir(number), ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._send = None  # the last update's files stay: receivers may still read them


__all__ = [
    "WeightSyncError",
    "WeightSyncTimeout",
    "Pending",
    "Transport",
    "init_sync_group",
    "TorchDistTransport",
    "SharedMemoryTransport",
    "CudaIpcTransport",
    "DiskTransport",
    "cuda_device_uuid",
    "cuda_device_by_uuid",
]
