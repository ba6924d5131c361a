"""DistributedBatch: the controller moves shard metadata; trainer shards fetch the tensors.

A rollout worker keeps every finished GRPO group (one shard) in its own process, in a
:class:`ShardStore` served over an authenticated local connection. The controller only sees
:class:`ShardMetadata`; a trainer turns a :class:`DistributedBatch` into a
:class:`~areal_fast.rl.batch.PackedBatch` by fetching the shards from their workers
(:func:`fetch_packed_batch`). A fetched shard is removed from its store, so each accepted
group is trained on at most once.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener
from pathlib import Path

import msgpack
import torch

from areal_fast._nodes import reachable_host
from areal_fast.ops.packing import partition_balanced
from areal_fast.rl.batch import PackedBatch, assemble_packed_batch
from areal_fast.wire.shard_io import (
    read_shard_file,
    recv_shards,
    send_shards,
    write_shard_file,
)

log = logging.getLogger("areal_fast.shards")


@dataclass(frozen=True)
class TensorMetadata:
    """Shape, dtype and device of a tensor that lives in another process."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "int64"
    device: str = "cpu"


@dataclass(frozen=True)
class ShardMetadata:
    """Where one shard (one finished GRPO group) lives and what it holds.

    Attributes
    ----------
    node_id : str
        Name of the worker process that holds it.
    node_addr : str
        "host:port" of that worker's shard server.
    shard_id : int
        Key in the worker's store (the group id).
    batch_size : int
        Sequences in the shard (the group size).
    offset : int
        Index of the shard's first sequence within its DistributedBatch (0 until batched).
    fields : dict[str, TensorMetadata]
        Per-token fields ([T_shard]): input_ids, labels, loss_mask, behav_logprobs, versions;
        per-sequence fields ([batch_size]): seq_lens, rewards, group_ids.
    path : str
        The shard's spool file (safetensors) when the worker keeps one: a trainer reads it
        there if the worker has died ("" when not spooled).
    """

    node_id: str
    node_addr: str
    shard_id: int
    batch_size: int
    offset: int
    fields: dict = field(hash=False)
    path: str = ""

    @property
    def num_tokens(self) -> int:
        """Packed tokens of the shard (prompt and completion)."""
        return int(self.fields["input_ids"].shape[0])


@dataclass
class DistributedBatch:
    """One training batch as a list of shards held by rollout workers (metadata only)."""

    shards: list[ShardMetadata]

    def __post_init__(self):
        offset, placed = 0, []
        for shard in self.shards:
            placed.append(
                ShardMetadata(
                    shard.node_id,
                    shard.node_addr,
                    shard.shard_id,
                    shard.batch_size,
                    offset,
                    shard.fields,
                    shard.path,
                )
            )
            offset += shard.batch_size
        self.shards = placed

    @property
    def num_seqs(self) -> int:
        """Sequences over all shards."""
        return sum(s.batch_size for s in self.shards)

    @property
    def num_tokens(self) -> int:
        """Packed tokens over all shards."""
        return sum(s.num_tokens for s in self.shards)

    def split(self, num_parts: int) -> list["DistributedBatch"]:
        """Split into ``num_parts`` token-balanced batches (trainer data-parallel ranks).

        Shards (GRPO groups) are never split; balancing uses the native Karmarkar–Karp
        partitioner over shard token counts.

        Raises
        ------
        ValueError
            If num_parts < 1 or there are fewer shards than parts.
        """
        if num_parts < 1 or num_parts > len(self.shards):
            raise ValueError(
                f"num_parts = {num_parts} must be in [1, {len(self.shards)}] (shards in the batch)"
            )
        lengths = [s.num_tokens for s in self.shards]
        # a budget of the whole batch never forces extra parts: exactly num_parts come back
        parts = partition_balanced(
            lengths, max(sum(lengths), 1), method="kk", min_num_mbs=num_parts
        )
        return [DistributedBatch([self.shards[i] for i in sorted(part)]) for part in parts]


def _no_delay(conn) -> None:
    """Switch off Nagle's algorithm on a TCP connection: replies larger than 16 KiB are sent
    as a header and a body, and Nagle plus delayed ACKs would stall each by ~40 ms."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()


def tensor_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, TensorMetadata]:
    """:class:`TensorMetadata` of each tensor in ``tensors``."""
    return {
        k: TensorMetadata(tuple(v.shape), str(v.dtype).split(".")[-1], str(v.device))
        for k, v in tensors.items()
    }


class ShardStore:
    """Shards of one rollout worker, served to trainers over ``multiprocessing.connection``.

    The server binds ``host`` (127.0.0.1 unless a launcher configures another; a wildcard
    such as 0.0.0.0 is advertised as the node's IP) on a free port
    and requires ``authkey`` (an HMAC challenge before any data is read), so only processes
    of the same job can connect; requests are msgpack and tensors travel as raw bytes
    (:func:`~areal_fast.wire.shard_io.send_shards`), never pickled.
    """

    def __init__(self, authkey: bytes, host: str = "127.0.0.1", spool_dir: str | None = None):
        self._shards: dict[int, dict[str, torch.Tensor]] = {}
        self.spool_dir = Path(spool_dir) if spool_dir else None
        if self.spool_dir is not None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._listener = Listener((host, 0), authkey=authkey)
        self._closed = False
        bound, port = self._listener.address  # a wildcard bind is told as the node's IP
        self.address = "%s:%d" % (reachable_host(bound), port)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="shard-server")

    def start(self) -> None:
        """Start accepting trainer connections."""
        self._thread.start()

    def spool_path(self, shard_id: int) -> str:
        """Spool file of ``shard_id`` ("" without a spool directory)."""
        return str(self.spool_dir / f"{shard_id}.safetensors") if self.spool_dir else ""

    def put(self, shard_id: int, tensors: dict[str, torch.Tensor]) -> str:
        """Keep ``tensors`` under ``shard_id`` until fetched or dropped; with a spool
        directory also write them to its file first (atomically: temp name, then rename),
        so they outlive this process. Returns the spool path ("" without)."""
        path = self.spool_path(shard_id)
        if path:
            write_shard_file(path, tensors)
        with self._lock:
            self._shards[shard_id] = tensors
        return path

    def drop(self, shard_ids: list[int]) -> int:
        """Forget shards (trained, filtered, unused at the end) and delete their spool files,
        also those a previous process of this worker left; returns how many were held in
        memory."""
        with self._lock:
            held = sum(self._shards.pop(i, None) is not None for i in shard_ids)
        for i in shard_ids:
            if self.spool_dir is not None:
                Path(self.spool_path(i)).unlink(missing_ok=True)
        return held

    def __len__(self) -> int:
        with self._lock:
            return len(self._shards)

    def _take(self, shard_ids: list[int]) -> dict:
        with self._lock:
            missing = [i for i in shard_ids if i not in self._shards]
            if missing:
                return {"error": f"shard {missing[0]} is not held (already fetched or dropped)"}
            # spool files stay until the controller drops the trained groups: a transfer
            # cut short by this worker's death still leaves the trainer the files
            return {i: self._shards.pop(i) for i in shard_ids}

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a peer failed or broke the handshake
                continue  # (the loop ends once close() has been called)
            _no_delay(conn)
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn) -> None:
        with conn:
            try:
                while True:
                    request = msgpack.unpackb(conn.recv_bytes(), raw=False)
                    shard_ids = [int(i) for i in request["fetch"]]
                    send_shards(conn, self._take(shard_ids))
            except (EOFError, OSError):
                return
            except (ValueError, KeyError, TypeError, msgpack.UnpackException):
                return  # a malformed request: drop the connection, keep serving others

    def close(self) -> None:
        """Stop serving."""
        self._closed = True
        self._listener.close()


def _connect(address: tuple[str, int], authkey: bytes, timeout: float, node: str):
    """``multiprocessing.connection.Client`` with a deadline on connecting and on the
    authentication handshake (which has none of its own).

    Raises
    ------
    TimeoutError
        The worker did not complete the handshake within ``timeout`` seconds.
    """
    box: dict = {}

    def connect() -> None:
        try:
            box["conn"] = Client(address, authkey=authkey)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=connect, daemon=True, name=f"connect-{node}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(
            f"connecting to worker {node!r} ({address[0]}:{address[1]}) took "
            f"more than {timeout:g} s"
        )
    if "error" in box:
        raise box["error"]
    return box["conn"]


def fetch_shards(
    batch: DistributedBatch, authkey: bytes, timeout: float
) -> list[dict[str, torch.Tensor]]:
    """Fetch every shard of ``batch`` from its worker, in the batch's order.

    Raises
    ------
    TimeoutError
        A worker did not answer within ``timeout`` seconds (named in the message).
    RuntimeError
        A worker no longer holds a shard, or the connection broke (worker named).
    """
    by_addr: dict[str, list[ShardMetadata]] = {}
    for shard in batch.shards:
        by_addr.setdefault(shard.node_addr, []).append(shard)
    fetched: dict[tuple[str, int], dict] = {}
    for addr, shards in by_addr.items():
        if not addr:  # no worker holds them (restored from a checkpoint): their copies
            reply = {s.shard_id: read_shard_file(s.path, s.node_id) for s in shards}
            for shard in shards:
                fetched[(addr, shard.shard_id)] = reply[shard.shard_id]
            continue
        try:
            reply = _fetch_from_worker(addr, shards, authkey, timeout)
        except (TimeoutError, RuntimeError) as exc:
            if not all(s.path and Path(s.path).is_file() for s in shards):
                raise
            # the worker died (or was replaced): its shards are on disk
            log.warning("%s; reading its %d shards from their spool files", exc, len(shards))
            reply = {s.shard_id: read_shard_file(s.path, s.node_id) for s in shards}
        for shard in shards:
            fetched[(addr, shard.shard_id)] = reply[shard.shard_id]
    return [fetched[(s.node_addr, s.shard_id)] for s in batch.shards]


def _fetch_from_worker(
    addr: str, shards: list[ShardMetadata], authkey: bytes, timeout: float
) -> dict:
    node = shards[0].node_id
    host, port = addr.rsplit(":", 1)
    try:
        with _connect((host, int(port)), authkey, timeout, node) as conn:
            _no_delay(conn)
            conn.send_bytes(msgpack.packb({"fetch": [s.shard_id for s in shards]}))
            if not conn.poll(timeout):
                raise TimeoutError(
                    f"fetching {len(shards)} shards from worker {node!r} "
                    f"({addr}) took more than {timeout:g} s"
                )
            return recv_shards(conn, node, timeout)
    except (TimeoutError, RuntimeError):
        raise
    except (OSError, EOFError) as exc:
        raise RuntimeError(f"fetching shards from worker {node!r} ({addr}) failed: {exc}") from exc


def fetch_packed_batch(
    batch: DistributedBatch, authkey: bytes, adv_mode: str, timeout: float
) -> PackedBatch:
    """:func:`fetch_shards` then :func:`~areal_fast.rl.batch.assemble_packed_batch`."""
    return assemble_packed_batch(fetch_shards(batch, authkey, timeout), adv_mode)
