"""Weights for rollout workers on other nodes: trainer rank 0's slots, copied over the network.

Trainer rank 0 writes every version into a host-side shared-memory slot
(:class:`~areal_fast.sync.shared_memory.SharedWeightBuffer`, already gathered from every FSDP2
rank). A worker on the same node maps that slot; a worker on another node cannot, so
:class:`SlotBroadcaster` sends the slot to it from a thread of its own while training goes
on, and :class:`SlotSubscriber` receives it on the worker into a node-local buffer with the
same layout, from which the worker installs exactly as a local one does.

One link per remote worker (:class:`WeightLink`): a stand-alone gloo process group of two
ranks (trainer rank 0 and that worker; :class:`~areal_fast.sync.transports.TorchDistTransport`)
met through one TCP store that trainer rank 0 listens on, or a folder on shared storage
(:class:`~areal_fast.sync.transports.DiskTransport`). Every update is the bucketed protocol of
:class:`~areal_fast.sync.sender.WeightSender` → :class:`~areal_fast.sync.receiver.WeightReceiver`
(header, plan check, double-buffered buckets, completion round), each step bounded by the
link's timeout. Because both ends are laid out by
:func:`~areal_fast.sync.shared_memory.plan_layout`, each bucket is one contiguous byte range
of both buffers and moves without pack or unpack copies.

- A link per worker keeps failures apart: a worker that dies mid-update fails its own link
  within the timeout (the trainer logs a line naming it); the other workers and the trainer
  go on.
- Each link sends the newest version only: a worker still taking version v when v + 1 is
  published gets v + 1 next, never a mix (the controller rewrites a slot only after every
  worker serves the version it held, so a slot being sent is never overwritten).
- The worker posts ``ready-<n>`` in the link's store (a file for disk) once it can take
  update n; only then does the sender pick the newest version and post ``update-<n>``. No
  collective is held open between steps and no wait for the next version times out.

Source
------
torch.distributed ``TCPStore``, ``PrefixStore``, ``ProcessGroupGloo`` (c10d).
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import shutil
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from areal_fast.sync.receiver import WeightReceiver, check_against
from areal_fast.sync.sender import SyncStats, WeightSender
from areal_fast.sync.shared_memory import SharedWeightBuffer
from areal_fast.sync.sources import SourceTensor
from areal_fast.sync.transports import (
    DiskTransport,
    TorchDistTransport,
    WeightSyncError,
    WeightSyncTimeout,
)

log = logging.getLogger("areal_fast.sync")


class LinkError(WeightSyncError):
    """A worker's weight link failed; restarting the worker makes a new link."""

    restartable = True


POLL_SECONDS = 0.05  # how often a waiting worker checks for the next update


@dataclass(frozen=True)
class WeightLink:
    """How one rollout worker gets weights from trainer rank 0 (a message field: plain values).

    Attributes
    ----------
    kind : {"broadcast", "disk"}
    tag : str
        ``<worker>-a<attempt>``: names the link's pair group or disk run; a restarted
        worker gets a new one.
    address : str
        broadcast: ``ip:port`` of trainer rank 0's rendezvous store.
    directory : str
        disk: the shared folder.
    timeout : float
        Seconds each step (connect, header, bucket, status round) may take.
    bucket_bytes : int
        Bucket size, a positive multiple of 256.
    """

    kind: str
    tag: str
    address: str = ""
    directory: str = ""
    timeout: float = 300.0
    bucket_bytes: int = 64 << 20

    def describe(self) -> str:
        """Where the link goes, for messages."""
        return f"gloo via {self.address}" if self.kind == "broadcast" else f"disk {self.directory}"


def buffer_checksum(buffer: SharedWeightBuffer) -> str:
    """CRC-32 (hex) of every tensor's bytes in layout order (padding excluded); a CUDA slot's
    tensors are read back to the host for it."""
    crc = 0
    for _, tensor in buffer.named_tensors():
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).cpu().numpy(), crc)
    return f"{crc:08x}"


class SlotSource:
    """The tensors of a weight slot as a :class:`~areal_fast.sync.sender.WeightSender` source
    (views of the slot, in layout order; nothing is gathered or copied)."""

    sending = True
    aliases: dict = {}

    def __init__(self, buffer: SharedWeightBuffer):
        self._named = list(buffer.named_tensors())

    def specs(self) -> list[SourceTensor]:
        """Name, shape and dtype of every tensor."""
        return [SourceTensor(name, tuple(t.shape), t.dtype) for name, t in self._named]

    def sync_flag(self, go: bool) -> bool:
        """One process: nothing to agree on."""
        return go

    def tensors(self, indices: Sequence[int]) -> Iterator[torch.Tensor]:
        """The slot views ``indices``."""
        for index in indices:
            yield self._named[index][1]


def _gloo_group(store, rank: int, bind_ip: str, timeout: float):
    """A gloo group of two on ``store`` whose sockets bind ``bind_ip``."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_ip)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _run_id(tag: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in tag)[:64]


class _Notice:
    """Flags between the two ends of a link: the worker posts ``ready-<n>`` once it can take
    update n (after installing n - 1), the sender then picks the newest version and posts
    ``update-<n>`` before sending it. Neither end holds a collective open while waiting,
    and no wait times out: the next version may be a long training step away."""

    def __init__(self, store=None, directory: Optional[Path] = None):
        self.store, self.directory = store, directory

    def post(self, key: str, value: str = "") -> None:
        if self.store is not None:
            self.store.set(key, value)
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.tmp"
            tmp.write_text(value)
            tmp.rename(self.directory / key)

    def ready(self, key: str) -> bool:
        if self.store is not None:
            return self.store.check([key])
        return (self.directory / key).is_file()

    def take(self, key: str) -> str:
        """The value of a posted ``key``, which is then deleted (each is read once)."""
        if self.store is not None:
            value = self.store.get(key).decode()
            self.store.delete_key(key)
            return value
        path = self.directory / key
        value = path.read_text()
        path.unlink(missing_ok=True)
        return value

    def wait(self, key: str, stopped: Callable[[], bool], timeout: float = math.inf) -> str:
        """Wait until ``key`` is posted and take its value; None when ``stopped()`` first.

        Raises
        ------
        WeightSyncTimeout
            Not posted within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not stopped():
            if self.ready(key):
                return self.take(key)
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"no {key!r} from the other end within {timeout:g} s")
            time.sleep(POLL_SECONDS)
        return None


def _disk_link(link: WeightLink, rank: int) -> tuple[DiskTransport, "_Notice"]:
    """Rank ``rank``'s end of a disk link: one folder holds its updates and its notices."""
    folder = Path(link.directory) / _run_id(link.tag)
    return DiskTransport(str(folder), rank, 2, _run_id(link.tag)), _Notice(directory=folder)


class _Peer:
    def __init__(self, worker: str, link: WeightLink):
        self.worker, self.link = worker, link
        self.closed = False
        self.sent: collections.deque = collections.deque(maxlen=256)  # newest SyncStats
        self.thread: Optional[threading.Thread] = None


class SlotBroadcaster:
    """Trainer rank 0's side: send every published slot to each remote worker's link.

    Parameters
    ----------
    bind_ip : str
        Address the rendezvous store and the gloo sockets bind (this node's address).
    advertise_ip : str, optional
        Address workers connect to (default ``bind_ip``; give the node's IP when binding a
        wildcard).
    timeout : float
        Seconds a worker may take to join the store.
    listen : bool
        Serve the rendezvous store (broadcast links); False for disk links only.

    Attributes
    ----------
    address : str
        ``ip:port`` of the rendezvous store, for :class:`WeightLink` ("" without one).
    errors : dict[str, str]
        Worker → why its link failed (one line naming the worker and the link; the same
        line is logged as a warning, and the worker's own side fails and is restarted).
    """

    def __init__(
        self,
        bind_ip: str,
        advertise_ip: Optional[str] = None,
        timeout: float = 300.0,
        listen: bool = True,
    ):
        self.bind_ip = advertise_ip or bind_ip  # gloo needs an interface's address
        self._store = None
        self.address = ""
        if listen:  # c10d's TCPStore server listens on every interface, whatever bind_ip
            self._store = dist.TCPStore(
                bind_ip,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout),
            )
            self.address = f"{self.bind_ip}:{self._store.port}"
        self.errors: dict[str, str] = {}
        self._cond = threading.Condition()
        self._latest: Optional[tuple[int, SharedWeightBuffer]] = None
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._rewrites: collections.Counter = collections.Counter()  # id(buffer) → rewrites

    def rewriting(self, buffer: SharedWeightBuffer) -> None:
        """``buffer`` is about to be overwritten: no send starts from it until the next
        :meth:`publish`, and a send from it in flight is not installed by its worker."""
        with self._cond:
            self._rewrites[id(buffer)] += 1
            if self._latest is not None and self._latest[1] is buffer:
                self._latest = None

    def publish(self, version: int, buffer: SharedWeightBuffer) -> None:
        """Version ``version`` is complete in ``buffer``: every link sends it next."""
        with self._cond:
            self._latest = (int(version), buffer)
            self._cond.notify_all()

    def add_peer(self, worker: str, link: WeightLink) -> None:
        """Start sending to ``worker`` over ``link`` (the newest published version first); a
        link the worker had before is closed."""
        peer = _Peer(worker, link)
        with self._cond:
            old = self._peers.get(worker)
            if old is not None:
                old.closed = True
            self._peers[worker] = peer
            self.errors.pop(worker, None)
            self._cond.notify_all()
        peer.thread = threading.Thread(
            target=self._serve, args=(peer,), daemon=True, name=f"weights-{worker}"
        )
        peer.thread.start()

    def sent(self, worker: str) -> list[SyncStats]:
        """The updates sent to ``worker`` over its current link."""
        peer = self._peers.get(worker)
        return list(peer.sent) if peer else []

    def _connect(self, peer: _Peer):
        link = peer.link
        if link.kind == "disk":
            return _disk_link(link, 0)
        if self._store is None:
            raise WeightSyncError(f"rollout worker {peer.worker!r}: no rendezvous store here")
        store = dist.PrefixStore(f"areal_fast/{link.tag}", self._store)
        try:
            group = _gloo_group(store, 0, self.bind_ip, link.timeout)
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0][:160]
            if "timeout" in reason.lower() or "timed out" in reason.lower():
                raise WeightSyncTimeout(
                    f"rollout worker {peer.worker!r} did not join its weight link within "
                    f"{link.timeout:g} s ({reason})"
                ) from None
            raise WeightSyncError(
                f"rollout worker {peer.worker!r}: its weight link cannot start ({reason})"
            ) from None
        return TorchDistTransport(group, "gloo", group_timeout=link.timeout), _Notice(store)

    def _next(self, peer: _Peer, sent: Optional[int]) -> Optional[tuple[int, SharedWeightBuffer]]:
        with self._cond:
            while not (self._closed or peer.closed):
                if self._latest is not None and self._latest[0] != sent:
                    return self._latest
                self._cond.wait()
        return None

    def _serve(self, peer: _Peer) -> None:
        transport, link = None, peer.link
        try:
            transport, notice = self._connect(peer)
            # one layout at both ends: every bucket moves in place (no solo buckets needed)
            sender = WeightSender(transport, link.bucket_bytes, timeout=link.timeout, solo_bytes=0)
            sent, n = None, 0

            def stopped() -> bool:
                return peer.closed or self._closed

            # the newest version once the worker can take it (a dead worker never is: its
            # replacement's link closes this one)
            while notice.wait(f"ready-{n}", stopped) is not None:
                item = self._next(peer, sent)
                if item is None:
                    break
                version, buffer = item
                rewrites = self._rewrites[id(buffer)]
                notice.post(f"update-{n}", str(version))
                peer.sent.append(sender.send(SlotSource(buffer), version))
                # the worker installs only what stayed intact while it was sent (a slot is
                # rewritten under a send only when a restarted worker joined mid-pipeline)
                intact = self._rewrites[id(buffer)] == rewrites
                notice.post(f"commit-{n}", "ok" if intact else "rewritten")
                sent, n = (version if intact else sent), n + 1
        except Exception as exc:  # noqa: BLE001 - this link only; the others go on
            if not (peer.closed or self._closed):
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.errors[peer.worker] = (
                    f"weight link to rollout worker {peer.worker!r} ({link.describe()}) "
                    f"failed: {first}"
                )
                log.warning("%s", self.errors[peer.worker])
        finally:
            if transport is not None:
                transport.close()
            if link.kind == "disk":  # the link's notices and last bucket files
                shutil.rmtree(Path(link.directory) / _run_id(link.tag), ignore_errors=True)

    def close(self, wait: float = 5.0) -> None:
        """Stop every link: each thread ends after its current update (waited for up to
        ``wait`` seconds), closing its group."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            peers = list(self._peers.values())
        deadline = time.monotonic() + wait
        for peer in peers:
            if peer.thread is not None:
                peer.thread.join(max(0.0, deadline - time.monotonic()))


class SlotSubscriber:
    """A remote worker's side: receive each version into a node-local buffer.

    Parameters
    ----------
    link : WeightLink
    bind_ip : str
        This node's address (the gloo socket binds it).
    deliver : callable (version, buffer, receive_seconds) -> None
        Called from the subscriber's thread with each complete version; the caller installs
        from ``buffer`` and then calls :meth:`installed` (the next version is received into
        the same buffer only after that).
    fail : callable (Exception) -> None
        Called once when the link fails, with a :class:`LinkError` naming the link.
    """

    def __init__(
        self,
        link: WeightLink,
        bind_ip: str,
        deliver: Callable[[int, SharedWeightBuffer, float], None],
        fail: Callable[[Exception], None],
    ):
        self.link, self.bind_ip = link, bind_ip
        self._deliver, self._fail = deliver, fail
        self.buffer: Optional[SharedWeightBuffer] = None
        self._installed = threading.Event()
        self._closed = False
        self._transport = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="weights-in")

    def start(self) -> None:
        """Join the link and start receiving (in a thread)."""
        self._thread.start()

    def installed(self) -> None:
        """The version last delivered is installed; its buffer may be reused."""
        self._installed.set()

    def _connect(self):
        link = self.link
        if link.kind == "disk":
            return _disk_link(link, 1)
        host, port = _host_port(link.address)
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=link.timeout)
            )
            store = dist.PrefixStore(f"areal_fast/{link.tag}", store)
            group = _gloo_group(store, 1, self.bind_ip, link.timeout)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"cannot join the weight link at {link.address} (timeout {link.timeout:g} s): "
                f"{str(exc).splitlines()[0][:160]}"
            ) from None
        return TorchDistTransport(group, "gloo", group_timeout=link.timeout), _Notice(store)

    def _accept(self, plan) -> str:
        if self.buffer is not None and [(s.name, tuple(s.shape), s.dtype) for s in plan.specs] != [
            (e.name, tuple(e.shape), e.dtype) for e in self.buffer.spec.entries
        ]:
            return "the update's tensors differ from the first update's"
        if self.buffer is None:
            self.buffer = SharedWeightBuffer.create(
                (s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta"))
                for s in plan.specs
            )
        return check_against(plan, dict(self.buffer.named_tensors()))

    def _run(self) -> None:
        try:
            transport, notice = self._connect()
            self._transport = transport
            receiver = WeightReceiver(transport, timeout=self.link.timeout)
            n = 0
            while True:
                notice.post(f"ready-{n}")
                if notice.wait(f"update-{n}", lambda: self._closed) is None:
                    break
                start = time.perf_counter()
                session = receiver.start(accept=self._accept)
                views = dict(self.buffer.named_tensors())
                try:
                    targets = [views[s.name] for s in session.plan.specs]
                    session.unpack_into(targets, layout_buffer=True)  # the buffer is ours
                except WeightSyncError as exc:
                    session.finish(str(exc))  # raises at once when the transport broke
                    raise
                session.finish()
                verdict = notice.wait(f"commit-{n}", lambda: self._closed, self.link.timeout)
                n += 1
                if verdict != "ok":  # closed, or the slot changed under the send: not installed
                    continue
                self._installed.clear()
                self._deliver(session.version, self.buffer, time.perf_counter() - start)
                while not (self._closed or self._installed.wait(1.0)):
                    pass
        except Exception as exc:  # noqa: BLE001 - handed to the worker
            if not self._closed:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self._fail(LinkError(f"weight link ({self.link.describe()}): {first}"))

    def close(self, wait: float = 5.0) -> None:
        """Stop receiving (the thread ends after the current update, waited for up to
        ``wait`` seconds); close the group; delete the node-local buffer."""
        self._closed = True
        self._installed.set()
        if self._thread.is_alive():
            self._thread.join(wait)
        if self._thread.is_alive():  # still inside a transfer into the buffer: leave both
            return
        if self._transport is not None:
            self._transport.close()
        if self.buffer is not None:
            self.buffer.close()
