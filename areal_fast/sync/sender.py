"""Send a complete set of weights as buckets: plan, pack (with cast), double-buffered send.

One update is: a JSON header (version, bucket plan metadata, tied aliases) → every receiver
checks the plan against its engine and answers (a rejection anywhere aborts the update before
any weight moves) → buckets 0..n-1, where gathering and packing bucket k + 1 overlaps sending
bucket k → every receiver reports whether it installed the update. The same code drives every
transport (:mod:`areal_fast.sync.transports`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from areal_fast.sync.buckets import BucketPlan, TensorSpec, bucket_view, pack_bucket, plan_buckets
from areal_fast.sync.sources import ModuleSource
from areal_fast.sync.transports import Transport, WeightSyncError

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_SOLO_BYTES = 4 << 20
HEADER_FORMAT = "areal_fast.weights/1"


@dataclass
class SyncStats:
    """What one update moved.

    Attributes
    ----------
    version : int
    num_bytes : int
        Bytes of the tensors sent, in the wire dtype (after the cast).
    wire_bytes : int
        Bytes of the buckets sent (``num_bytes`` plus 256-byte alignment padding).
    num_buckets : int
    seconds : float
        Wall time of :meth:`WeightSender.send`, header to final acknowledgement.
    direct_buckets : int
        Buckets sent straight from the source's memory, without a pack copy (the others
        were packed into a send buffer first).
    """

    version: int
    num_bytes: int
    wire_bytes: int
    num_buckets: int
    seconds: float
    direct_buckets: int = 0

    @property
    def gbytes_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.num_bytes / max(self.seconds, 1e-12) / 1e9


def wire_specs(source: ModuleSource, wire_dtype: Optional[torch.dtype]) -> list[TensorSpec]:
    """The bucket-plan specs of ``source``: floating tensors cast to ``wire_dtype`` (if
    given), others sent as they are."""
    specs = []
    for t in source.specs():
        dtype = wire_dtype if (wire_dtype is not None and t.dtype.is_floating_point) else t.dtype
        specs.append(TensorSpec(t.name, t.shape, str(dtype).removeprefix("torch.")))
    return specs


def engine_failures(statuses: list[str]) -> list[str]:
    """``"engine rank r: reason"`` for every engine rank (≥ 1) whose status is not ''."""
    return [f"engine rank {rank}: {s}" for rank, s in enumerate(statuses) if rank and s]


class WeightSender:
    """The trainer's side of weight sync.

    Parameters
    ----------
    transport : Transport or None
        Rank-0 endpoint; ``None`` on FSDP2 ranks that only gather (``source.sending`` False).
    bucket_bytes : int
        Bucket size in bytes, a positive multiple of 256 (default 64 MiB); two buckets are
        in memory at once on the sender and on each receiver.
    wire_dtype : torch.dtype, optional
        Cast floating tensors to this dtype while packing (e.g. ``torch.bfloat16`` for a bf16
        engine: half the bytes of fp32). ``None`` sends the trainer's dtypes and lets each
        receiver cast to its own.
    timeout : float
        Seconds allowed for each step (header, each bucket, each acknowledgement).
    num_threads : int, optional
        CPU packing threads (default: torch's intra-op thread count).
    solo_bytes : int, optional
        Over a transport that sends from any memory (``supports_direct``: gloo, NCCL),
        tensors of at least this many bytes get buckets of their own and travel straight
        from the parameter into the engine's parameter, without pack or unpack copies
        (default 4 MiB; 0 turns the rule off). Ignored by the other transports. Over such
        a transport, any bucket whose tensors already lie in one storage as the bucket lays
        them out (views of one :func:`~areal_fast.sync.shared_memory.plan_layout` buffer)
        is sent from there without a pack copy, whatever the plan; for such a source 0
        gives fewer, larger buckets.

    Raises
    ------
    ValueError
        ``bucket_bytes`` not a positive multiple of 256, or a non-positive timeout.
    """

    def __init__(
        self,
        transport: Optional[Transport],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        wire_dtype: Optional[torch.dtype] = None,
        timeout: float = 60.0,
        num_threads: Optional[int] = None,
        solo_bytes: int = DEFAULT_SOLO_BYTES,
    ):
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0 and bucket_bytes % 256 == 0):
            raise ValueError(f"bucket_bytes = {bucket_bytes!r} must be a positive multiple of 256")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout = {timeout!r} must be a positive, finite number of seconds")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.wire_dtype = wire_dtype
        self.timeout = float(timeout)
        self.num_threads = num_threads
        direct = transport is not None and transport.supports_direct
        self.solo_bytes = int(solo_bytes) if direct else 0
        self._plan: Optional[BucketPlan] = None
        self._gathered: Optional[tuple[int, torch.Tensor]] = None  # last tensor, for splits
        self._direct_buckets = 0  # of the update in progress

    def plan_for(self, source: ModuleSource) -> BucketPlan:
        """The bucket plan of ``source`` (cached while names, shapes and dtypes stay)."""
        specs = tuple(wire_specs(source, self.wire_dtype))
        if self._plan is None or self._plan.specs != specs:
            self._plan = plan_buckets(specs, self.bucket_bytes, self.solo_bytes)
        return self._plan

    def send(self, source: ModuleSource, version: int) -> SyncStats:
        """Send every tensor of ``source`` as policy ``version``.

        On an FSDP2 rank that does not send (``source.sending`` False) this only gathers, in
        the sending rank's order, and returns stats with ``num_bytes`` 0 (or raises
        ``WeightSyncError`` when the sending rank stops the update).

        A failure after the first bucket marks the transport broken (receivers cannot tell
        where the stream stopped; they time out and keep refusing to serve): create a new
        group and transport for the next update.

        Returns
        -------
        SyncStats

        Raises
        ------
        WeightSyncError
            A receiver rejected the plan (unknown name, shape or dtype mismatch — the message
            names the engine rank and the tensor) or failed part-way, or a peer disappeared.
        WeightSyncTimeout
            A step took longer than ``timeout``.
        """
        start = time.perf_counter()
        plan = self.plan_for(source)
        self._gathered, self._direct_buckets = None, 0
        if not source.sending:
            return self._follow(source, plan, version, start)
        if self.transport is None:
            raise ValueError("WeightSender: the sending rank needs a transport")
        tp, timeout = self.transport, self.timeout
        try:
            slots = tp.send_buffers(max(max(plan.bucket_sizes, default=0), 256))
            tp.send_header(
                {
                    "format": HEADER_FORMAT,
                    "version": int(version),
                    "plan": plan.to_metadata(),
                    "aliases": dict(source.aliases),
                },
                timeout,
            )
            rejected = engine_failures(tp.gather_status("", timeout))
        except BaseException:
            source.sync_flag(False)  # FSDP2: the other ranks stop gathering too
            raise
        if rejected:
            source.sync_flag(False)
            raise WeightSyncError(
                f"weight update v{version} rejected, nothing changed: " + "; ".join(rejected)
            )
        source.sync_flag(True)
        tp.accepted()
        try:
            self._send_buckets(source, plan, slots)
        except BaseException as exc:
            # receivers cannot tell where the stream stopped: this transport is done
            tp.mark_broken(f"the sender failed during update v{version}: {exc}")
            source.sync_flag(False)
            raise
        source.sync_flag(True)  # FSDP2: every bucket went out
        failed = engine_failures(tp.gather_status("", timeout))
        if failed:
            raise WeightSyncError(f"weight update v{version} failed on " + "; ".join(failed))
        return SyncStats(
            version,
            sum(spec.nbytes for spec in plan.specs),
            plan.total_bytes,
            plan.num_buckets,
            time.perf_counter() - start,
            self._direct_buckets,
        )

    def _send_buckets(self, source: ModuleSource, plan: BucketPlan, slots) -> None:
        tp, timeout, pending = self.transport, self.timeout, None
        for k in range(plan.num_buckets):
            tp.wait_slot_free(k, timeout)
            if k:
                source.sync_flag(True)  # FSDP2: "gather bucket k with me"
            # gather + pack bucket k while bucket k - 1 is in flight
            direct = self._pack(source, plan, k, slots[k % 2], tp.supports_direct)
            if pending is not None:
                pending.wait(timeout)
            pending = (
                tp.start_send_direct(direct, k)
                if direct is not None
                else tp.start_send(k % 2, plan.bucket_sizes[k], k)
            )
        if pending is not None:
            pending.wait(timeout)
        tp.finish_send(plan.num_buckets, timeout)

    def _follow(
        self, source: ModuleSource, plan: BucketPlan, version: int, start: float
    ) -> SyncStats:
        """A non-sending FSDP2 rank: gather each bucket's tensors in the sending rank's order
        for as long as it says to go on."""
        for k in range(plan.num_buckets):
            if not source.sync_flag(True):
                raise WeightSyncError(
                    f"weight update v{version} was stopped by the sending rank (see its error)"
                )
            for _ in self._gather(source, self._bucket_tensors(plan, k)):
                pass
        if not source.sync_flag(True):
            raise WeightSyncError(
                f"weight update v{version} failed on the sending rank while sending (see its error)"
            )
        return SyncStats(version, 0, 0, plan.num_buckets, time.perf_counter() - start)

    def _gather(self, source: ModuleSource, indices: list[int]) -> list[torch.Tensor]:
        """Full tensors ``indices``; a tensor split over consecutive buckets is gathered once
        (every training rank makes the same calls, so FSDP2 all-gathers stay paired)."""
        cached = self._gathered
        fresh = [i for i in indices if cached is None or cached[0] != i]
        gathered = dict(zip(fresh, source.tensors(fresh)))
        if cached is not None and cached[0] in indices:
            gathered[cached[0]] = cached[1]
        if indices:
            self._gathered = (indices[-1], gathered[indices[-1]])
        return [gathered[i] for i in indices]

    @staticmethod
    def _bucket_tensors(plan: BucketPlan, k: int) -> list[int]:
        out: list[int] = []
        for chunk in plan.bucket_chunks(k):
            if not out or out[-1] != chunk.tensor:
                out.append(chunk.tensor)
        return out

    def _pack(
        self, source: ModuleSource, plan: BucketPlan, k: int, slot: torch.Tensor, direct_ok: bool
    ) -> Optional[torch.Tensor]:
        """Pack bucket ``k`` into ``slot``; or, when the transport can send from any memory and
        the bucket's tensors already lie in one storage exactly as the bucket lays them out, in
        the wire dtype on the transport's device (:func:`bucket_view`: a bucket that is one
        chunk of one tensor, or any bucket of tensors that are views of one
        :func:`~areal_fast.sync.shared_memory.plan_layout` buffer), return those bytes to
        send without a copy."""
        indices = self._bucket_tensors(plan, k)
        sources: list[Optional[torch.Tensor]] = [None] * len(plan.specs)
        for index, tensor in zip(indices, self._gather(source, indices)):
            sources[index] = tensor.to(slot.device)  # blocking: a host copy must be complete
        if direct_ok:
            view = bucket_view(plan, k, sources, slot.device)
            if view is not None:
                self._direct_buckets += 1
                return view
        pack_bucket(plan, k, sources, slot, num_threads=self.num_threads)
        return None
