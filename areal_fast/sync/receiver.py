"""Receive a bucketed weight update: header → accept round → buckets → completion round.

:class:`WeightReceiver` is the engine side of :class:`areal_fast.sync.sender.WeightSender`.
:meth:`WeightReceiver.start` reads the header, re-derives the bucket plan from its metadata
and lets the engine accept or reject it before any byte of weight arrives (an unknown name, a
shape or an uncastable dtype is rejected there, so the engine is untouched).
:class:`ReceiveSession` then delivers the buckets, receiving bucket k + 1 while bucket k is
unpacked, either straight into the engine's tensors (:meth:`ReceiveSession.unpack_into`) or
as complete named tensors (:meth:`ReceiveSession.named_tensors`, for engines with their own
loader, e.g. vLLM). :meth:`ReceiveSession.finish` always runs the completion round, draining
buckets a failed consumer did not read, so the sender and the other engines never hang.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from areal_fast.sync.buckets import BucketPlan, bucket_view, castable, unpack_bucket
from areal_fast.sync.sender import HEADER_FORMAT, engine_failures
from areal_fast.sync.transports import Pending, Transport, WeightSyncError

Accept = Callable[[BucketPlan], str]


def check_against(plan: BucketPlan, params: dict[str, torch.Tensor]) -> str:
    """'' if ``plan`` is a complete update of ``params``, else a one-line reason.

    Every planned name must be a parameter, shapes must match, dtypes must be equal or both in
    {float32, bfloat16, float16} (cast on unpack), parameters must be contiguous and on one
    device, and every parameter must be covered. Tied parameters count once (pass
    ``named_parameters()``, which lists a shared tensor under its first name only).
    """
    devices = {}
    for name, target in params.items():
        devices.setdefault(target.device, name)
    if len(devices) > 1:
        (first, a), (second, b) = list(devices.items())[:2]
        return (
            f"the engine's parameters are on several devices ({a!r} on {first}, {b!r} on {second})"
        )
    covered: set[str] = set()
    for spec in plan.specs:
        target = params.get(spec.name)
        if target is None:
            return f"tensor {spec.name!r} is not a parameter of this engine"
        if tuple(target.shape) != tuple(spec.shape):
            return (
                f"tensor {spec.name!r} has shape {tuple(spec.shape)}, the engine's "
                f"parameter is {tuple(target.shape)}"
            )
        if not castable(spec.torch_dtype, target.dtype):
            return (
                f"tensor {spec.name!r} arrives as {spec.dtype}, which cannot be cast to the "
                f"engine's {str(target.dtype).removeprefix('torch.')}"
            )
        if not target.is_contiguous():
            return f"the engine's parameter {spec.name!r} is not contiguous"
        covered.add(spec.name)
    missing = [name for name in params if name not in covered]
    if missing:
        return f"update misses {len(missing)} engine parameters, first {missing[0]!r}"
    return ""


def _bucket_names(plan: BucketPlan, k: int, limit: int = 3) -> str:
    names = list(dict.fromkeys(plan.specs[c.tensor].name for c in plan.bucket_chunks(k)))
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


class ReceiveSession:
    """One update in progress on an engine rank (from :meth:`WeightReceiver.start`).

    Buckets are handed out in order; bucket k + 1 is already being received while the caller
    works on bucket k, and bucket k is released when the caller asks for the next one (or in
    :meth:`finish`). A consumer that fails part-way leaves the session consistent:
    :meth:`finish` releases what it held, drains the rest and reports the error, so the
    sender and the other engines finish the update instead of hanging.

    Attributes
    ----------
    version : int
        Policy version of the weights being received.
    plan : BucketPlan
    aliases : dict[str, str]
        Tied names the sender did not send → the name sent with their data.
    in_place_buckets : int
        Buckets :meth:`unpack_into` received straight into the targets' memory (no unpack).
    unpacked_buckets : int
        Buckets :meth:`unpack_into` received into a transport buffer and unpacked from it.
    """

    def __init__(
        self,
        transport: Transport,
        timeout: float,
        plan: BucketPlan,
        version: int,
        aliases: dict[str, str],
        num_threads: Optional[int],
    ):
        self.transport, self.timeout = transport, timeout
        self.plan, self.version, self.aliases = plan, version, aliases
        self.num_threads = num_threads
        self._next = 0  # next bucket to hand out
        self._pending: Optional[Pending] = None  # receive posted for bucket self._next
        self._held: Optional[int] = None  # handed out, not yet released
        self._finished = False
        self.in_place_buckets = 0
        self.unpacked_buckets = 0

    def _start(self, k: int, direct: dict[int, torch.Tensor]) -> Pending:
        if k in direct:
            return self.transport.start_recv_into(direct[k], k)
        return self.transport.start_recv(self.plan.bucket_sizes[k], k)

    def _release_held(self) -> None:
        if self._held is not None:
            k, self._held = self._held, None
            self.transport.release(k, self.timeout)

    def _take(self, direct: dict[int, torch.Tensor]) -> tuple[int, torch.Tensor]:
        """Wait for bucket ``self._next``, post the receive of the one after, hold it."""
        self._release_held()
        k, n = self._next, self.plan.num_buckets
        if self._pending is None:
            self._pending = self._start(k, direct)
        pending, self._pending, self._next = self._pending, None, k + 1
        try:
            bucket = pending.wait(self.timeout)
        except WeightSyncError as exc:
            raise type(exc)(f"{exc} [bucket {k} of {n}: {_bucket_names(self.plan, k)}]") from exc
        self._held = k
        if k + 1 < n:
            self._pending = self._start(k + 1, direct)
        return k, bucket

    def _buckets(
        self, direct: Optional[dict[int, torch.Tensor]] = None
    ) -> Iterator[tuple[int, Optional[torch.Tensor]]]:
        """(k, bucket) in order; buckets in ``direct`` arrive straight in the given bytes and
        are yielded as ``(k, None)`` (nothing left to unpack)."""
        direct = direct or {}
        while self._next < self.plan.num_buckets:
            k, bucket = self._take(direct)
            yield k, (None if k in direct else bucket)
        self._release_held()

    def unpack_into(
        self, targets: Sequence[Optional[torch.Tensor]], *, layout_buffer: bool = False
    ) -> None:
        """Unpack every bucket into ``targets[i]`` (for ``plan.specs[i]``; ``None`` skips),
        casting the wire dtype to each target's dtype. Targets on another device than the
        transport's get each bucket copied there first.

        Over a transport that receives into any memory (``supports_direct``), a bucket that
        is one chunk of one target in the wire dtype, contiguous and on the transport's
        device arrives straight in that target (no unpack copy).

        Parameters
        ----------
        targets : sequence of torch.Tensor or None, length ``len(plan.specs)``
        layout_buffer : bool
            The caller declares that the targets are views of one buffer it owns, laid out
            by :func:`~areal_fast.sync.shared_memory.plan_layout` for the plan's specs in
            order, and that the padding bytes between them may be overwritten. Then every
            bucket whose targets lie in that buffer as the bucket lays them out (in the wire
            dtype, on the transport's device) arrives straight in its byte range of the
            buffer, padding included, with no unpack; the others are unpacked as usual.
            Without it, bytes between targets are never written (they may belong to other
            data).

        Raises
        ------
        ValueError
            Targets on several devices, or not one per spec of the plan (nothing received).
        WeightSyncError, WeightSyncTimeout
            A bucket did not arrive or is damaged (the message names the bucket and its
            tensors); some targets may hold new values (the caller marks its weights
            incomplete and calls :meth:`finish` with the error).
        """
        devices = {t.device for t in targets if t is not None}
        device = devices.pop() if len(devices) == 1 else None
        if devices:
            raise ValueError("unpack_into: targets are on several devices")
        direct = self._direct_targets(targets, layout_buffer)
        buckets = self._buckets(direct)
        try:
            for k, bucket in buckets:
                if bucket is None:
                    self.in_place_buckets += 1
                    continue
                if device is not None and bucket.device != device:
                    bucket = bucket.to(device)
                unpack_bucket(self.plan, k, bucket, targets, num_threads=self.num_threads)
                self.unpacked_buckets += 1
        finally:
            buckets.close()

    def _direct_targets(
        self, targets: Sequence[Optional[torch.Tensor]], layout_buffer: bool = False
    ) -> dict[int, torch.Tensor]:
        """Buckets to receive in place → the bytes they arrive in: those that are one chunk
        of one target, and with ``layout_buffer`` also those whose targets lie in one
        storage as the bucket lays them out (:func:`bucket_view`)."""
        if len(targets) != len(self.plan.specs):
            raise ValueError(
                f"unpack_into: {len(targets)} targets, the plan has {len(self.plan.specs)}"
            )
        if not self.transport.supports_direct:
            return {}
        direct = {}
        for k in range(self.plan.num_buckets):
            if not layout_buffer:
                chunks = [c for c in self.plan.bucket_chunks(k) if c.numel > 0]
                if len(chunks) != 1:
                    continue
            view = bucket_view(self.plan, k, targets, self.transport.device)
            if view is not None:
                direct[k] = view
        return direct

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each tensor as soon as its last byte arrived, in plan order.

        Tensors are new (owned by the caller), in the wire dtype, on the transport's device.
        """
        plan = self.plan
        last_chunk: dict[int, int] = {}
        for position, chunk in enumerate(plan.chunks):
            last_chunk[chunk.tensor] = position
        building: dict[int, torch.Tensor] = {}
        position = 0
        buckets = self._buckets()
        try:
            for k, bucket in buckets:
                chunks = plan.bucket_chunks(k)
                targets: list[Optional[torch.Tensor]] = [None] * len(plan.specs)
                for chunk in chunks:
                    if chunk.tensor not in building:
                        spec = plan.specs[chunk.tensor]
                        building[chunk.tensor] = torch.empty(
                            spec.shape, dtype=spec.torch_dtype, device=bucket.device
                        )
                    targets[chunk.tensor] = building[chunk.tensor]
                unpack_bucket(plan, k, bucket, targets, num_threads=self.num_threads)
                done = []
                for chunk in chunks:
                    if last_chunk[chunk.tensor] == position:
                        done.append(chunk.tensor)
                    position += 1
                for index in done:
                    yield plan.specs[index].name, building.pop(index)
        finally:
            buckets.close()

    def finish(self, error: str = "") -> None:
        """Report this rank's outcome ('' = installed) after draining unread buckets.

        Call exactly once per session, also after a failure. When the transport itself
        failed (it is then marked broken), nothing more can be exchanged and the transport
        error is raised at once instead.

        Raises
        ------
        WeightSyncError, WeightSyncTimeout
            The transport failed while draining or reporting (the sender is gone).
        """
        if self._finished:
            raise RuntimeError("ReceiveSession.finish called twice")
        self._finished = True
        self.transport.check_usable()
        while self._next < self.plan.num_buckets or self._held is not None:
            try:  # the sender waits for these: release what the consumer held, drop the rest
                for _ in self._buckets():
                    pass
            except WeightSyncError as exc:  # e.g. a damaged file: skip it, keep draining
                self.transport.check_usable()  # a broken transport cannot report either
                error = error or f"while draining: {exc}"
        self.transport.gather_status(error[:900], self.timeout)


class WeightReceiver:
    """The engine side of weight sync over one transport.

    Parameters
    ----------
    transport : Transport
        A receiving endpoint (rank ≥ 1).
    timeout : float
        Seconds allowed per step (header, each bucket, each status round); finite.
    num_threads : int, optional
        CPU unpacking threads (default: torch's intra-op thread count).

    Raises
    ------
    ValueError
        ``transport`` is the sender's endpoint, or a non-positive timeout.
    """

    def __init__(
        self, transport: Transport, timeout: float = 60.0, num_threads: Optional[int] = None
    ):
        if transport.is_sender:
            raise ValueError("WeightReceiver: the transport is rank 0, the sender's endpoint")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout = {timeout!r} must be a positive, finite number of seconds")
        self.transport, self.timeout, self.num_threads = transport, float(timeout), num_threads

    def start(self, accept: Optional[Accept] = None) -> ReceiveSession:
        """Receive the next update's header and run the accept round.

        Parameters
        ----------
        accept : callable(BucketPlan) -> str, optional
            The engine's verdict on the plan: '' accepts, anything else rejects with that
            reason. Default accepts.

        Returns
        -------
        ReceiveSession

        Raises
        ------
        WeightSyncError
            The header is malformed, or any engine rank rejected the plan (nothing changed on
            any engine; the message names the ranks and their reasons).
        WeightSyncTimeout
            No header within the timeout.
        """
        header = self.transport.recv_header(self.timeout)
        verdict, plan = header.pop("_transport_error", ""), None
        try:
            if header.get("format") != HEADER_FORMAT:
                raise ValueError(
                    f"header format {header.get('format')!r}, expected {HEADER_FORMAT!r}"
                )
            plan = BucketPlan.from_metadata(header["plan"])
            version = int(header["version"])
            aliases = dict(header.get("aliases", {}))
        except (KeyError, TypeError, ValueError) as exc:
            verdict = verdict or f"malformed header: {exc}"
        if not verdict and accept is not None:
            try:
                verdict = accept(plan) or ""
                if not isinstance(verdict, str):
                    raise TypeError(f"accept returned {type(verdict).__name__}, expected str")
            except Exception as exc:  # a crashing check must still answer the round
                verdict = f"the engine's plan check raised {type(exc).__name__}: {exc}"
        statuses = self.transport.gather_status(verdict, self.timeout)
        rejected = engine_failures(statuses)
        if rejected:
            raise WeightSyncError("weight update rejected, nothing changed: " + "; ".join(rejected))
        return ReceiveSession(
            self.transport, self.timeout, plan, version, aliases, self.num_threads
        )
