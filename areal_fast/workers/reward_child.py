"""A child process of a ``reward.pool = process`` pool: loads ``reward.path`` and answers calls.

Started by :class:`~areal_fast.workers.reward_pool.ProcessRunner` as ``python -m
areal_fast.workers.reward_child PATH``. Messages are msgpack (plain data only: strings,
numbers, lists, maps; nothing is unpickled) with an 8-byte big-endian length in front: the parent writes ``(completions, samples)`` to the child's stdin; the child
writes ``("ready", None)`` (or ``("failed", message)``) once, then ``("ok", values)`` or
``("error", "Type: message")`` per call to its original stdout. Whatever the reward prints
goes to stderr (the rollout worker's log), so it cannot corrupt the answers.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import BinaryIO, Optional

import msgpack

_HEADER = struct.Struct(">Q")


def write_message(stream: BinaryIO, message) -> None:
    """Write one length-prefixed msgpack message to ``stream`` and flush it."""
    data = msgpack.packb(message, use_bin_type=True)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_message(stream: BinaryIO) -> Optional[object]:
    """One length-prefixed msgpack message from ``stream`` (buffered or raw; arrays come back
    as lists); None at its end."""
    header = _read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    data = _read_exactly(stream, _HEADER.unpack(header)[0])
    return None if data is None else msgpack.unpackb(data, raw=False)


def _read_exactly(stream: BinaryIO, size: int) -> Optional[bytes]:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(path: str) -> int:
    """Serve calls of the reward ``path`` until stdin ends; returns the exit status."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr
    sys.stdout = sys.stderr
    from areal_fast.data.user_reward import load_reward, score

    try:
        fn = load_reward(path)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names it
        write_message(out, ("failed", str(exc)))
        return 1
    write_message(out, ("ready", None))
    while True:
        job = read_message(sys.stdin.buffer)
        if job is None:
            return 0
        completions, samples = job
        try:
            answer = ("ok", score(fn, completions, samples))
        except Exception as exc:  # noqa: BLE001 - the reward's own error, sent back
            answer = ("error", f"{type(exc).__name__}: {exc}")
        write_message(out, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
