"""The wire format between the controller and its workers: msgpack, never pickle.

Every controller ↔ worker message is one of the dataclasses in :data:`MESSAGE_TYPES` (the
typed messages of :mod:`areal_fast.wire.messages` and the records they carry). A
dataclass travels as a msgpack map ``{"__t": <class name>, <field>: <value>, ...}``; decoding
builds only classes named in that whitelist, so bytes from a socket can create plain data
and nothing else (no code runs, unlike ``pickle.loads``). Fields annotated as tuples come
back as tuples; everything else is msgpack's plain types (int, float, str, bool, None,
list, dict with str or int keys).

:class:`MessageChannel` puts this codec on a :class:`multiprocessing.connection.Connection`
(a local pipe, or an authenticated socket of a Ray worker): ``send(message)`` /
``recv()``, and ``fileno()`` so that ``multiprocessing.connection.wait`` can wait on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from areal_fast.rollout.engine import SamplingParams
from areal_fast.sync.cuda_slots import CudaSlotSpec
from areal_fast.sync.shared_memory import WeightBufferSpec, WeightEntry
from areal_fast.sync.slot_broadcast import WeightLink
from areal_fast.wire import messages as msg
from areal_fast.wire.shards import DistributedBatch, ShardMetadata, TensorMetadata

_TYPE_KEY = "__t"


class CodecError(ValueError):
    """Bytes that are not a valid message (unknown type, bad field); the message says which."""


def _message_types() -> dict[str, type]:
    classes = [
        c
        for c in vars(msg).values()
        if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == msg.__name__
    ]
    classes += [
        DistributedBatch,
        ShardMetadata,
        TensorMetadata,
        SamplingParams,
        WeightBufferSpec,
        WeightEntry,
        WeightLink,
        CudaSlotSpec,
    ]
    return {c.__name__: c for c in classes}


MESSAGE_TYPES: dict[str, type] = _message_types()
# per class: the fields declared as tuples (msgpack has one array type; these become tuples)
_TUPLE_FIELDS = {
    name: {
        f.name
        for f in dataclasses.fields(cls)
        if str(f.type).replace("typing.", "").lower().startswith("tuple")
    }
    for name, cls in MESSAGE_TYPES.items()
}


def _default(obj: Any) -> Any:
    name = type(obj).__name__
    if dataclasses.is_dataclass(obj) and MESSAGE_TYPES.get(name) is type(obj):
        out = {_TYPE_KEY: name}
        for f in dataclasses.fields(obj):
            out[f.name] = getattr(obj, f.name)
        return out
    raise TypeError(f"cannot send a {name} to a worker (not a message type or plain data)")


def _object_hook(data: dict) -> Any:
    name = data.get(_TYPE_KEY)
    if name is None:
        return data
    cls = MESSAGE_TYPES.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name!r}")
    del data[_TYPE_KEY]
    for key in _TUPLE_FIELDS[name] & data.keys():
        data[key] = tuple(data[key])
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"bad {name} message: {exc}") from exc


def encode_message(message: Any) -> bytes:
    """Serialize one message (a whitelisted dataclass, possibly nested) to msgpack bytes.

    Raises
    ------
    TypeError
        ``message`` holds an object that is neither plain data nor a message type.
    """
    return msgpack.packb(message, default=_default, use_bin_type=True)


def decode_message(data: bytes) -> Any:
    """Rebuild a message from :func:`encode_message`'s bytes.

    Raises
    ------
    CodecError
        Not msgpack, an unknown type name, or fields the type does not accept.
    """
    try:
        return msgpack.unpackb(data, object_hook=_object_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types
        raise CodecError(f"undecodable message ({type(exc).__name__}: {exc})") from exc


class Encoded(bytes):
    """A message already encoded by :func:`encode_message`; :meth:`MessageChannel.send` sends
    it as is (one encoding for a message sent to many workers)."""


class MessageChannel:
    """A :class:`multiprocessing.connection.Connection` that carries msgpack messages.

    ``send`` / ``recv`` / ``poll`` / ``close`` mirror the connection's; raised errors are the
    connection's (``EOFError``, ``OSError`` when the peer is gone) or :class:`CodecError`.
    """

    def __init__(self, conn):
        self.conn = conn

    def send(self, message: Any) -> None:
        """Encode and send one message (an :class:`Encoded` one as it is)."""
        self.conn.send_bytes(message if isinstance(message, Encoded) else encode_message(message))

    def recv(self) -> Any:
        """Receive and decode one message (blocks)."""
        return decode_message(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message (or EOF) is ready within ``timeout`` seconds."""
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        """The connection's file descriptor (for ``multiprocessing.connection.wait``)."""
        return self.conn.fileno()

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.conn.closed
