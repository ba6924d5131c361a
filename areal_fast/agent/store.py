"""Compressed, append-only store of agent trajectories (one JSON object per line).

:class:`TrajectoryWriter` takes records (JSON-serialisable dicts) from the rollout loop
without touching the disk: ``put`` appends to an in-memory queue and a pool of daemon
threads serialises, compresses and appends them to files. Layout of a store directory::

    <directory>/<name>-<thread>.jsonl.zst   # compression "zstd": one zstd frame per batch
    <directory>/<name>-<thread>.jsonl       # compression "none"

Files are only ever appended to, unbuffered, one write per batch, so a crash of the process
loses at most the batches in flight; they are not fsynced, so a crash of the machine may lose
what the kernel had not yet written. A batch whose write fails (disk full) is cut off the file
again; a process killed in the middle of a write leaves a partial last batch, at which
:func:`read_trajectories` raises, so a restarted process should write under a new ``name``.
Concatenated zstd frames form a valid zstd stream: ``zstdcat rollout-0.jsonl.zst`` prints
the records.

Each thread appends to its own file, so two writers of the same ``name`` must never share a
directory: a second writer of a live ``(directory, name)`` pair in one process is refused,
and the caller gives every process a distinct ``name`` (e.g. ``rollout-rank3``). Reopening
a directory later appends to the existing files, whatever compression they were made with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = [
    "TrajectoryConfig",
    "TrajectoryStats",
    "TrajectoryStoreError",
    "TrajectoryWriter",
    "read_trajectories",
]

MAX_BATCH = 256  # records one thread takes from the queue at most per frame
LINGER_RECORDS = 64  # a lingering writer thread stops waiting once this many are queued
COMPRESSIONS = ("zstd", "none")
SUFFIXES = (".jsonl.zst", ".jsonl")
_READ_SIZE = 1 << 20
_ACTIVE: set[tuple[str, str]] = set()  # (absolute directory, name) of open writers
_ACTIVE_LOCK = threading.Lock()


class TrajectoryStoreError(RuntimeError):
    """A trajectory file could not be written or read; the message is one line."""


def _zstd():
    try:
        import zstandard
    except ImportError as exc:
        raise TrajectoryStoreError(
            "trajectory.compression = 'zstd' needs the zstandard package (pip install zstandard)"
        ) from exc
    return zstandard


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass
class TrajectoryConfig:
    """Settings of the trajectory store (the ``trajectory`` section of a run config).

    Parameters
    ----------
    cache_size : int
        Records held in memory awaiting write (>= 1); ``put`` waits when this many are queued.
    write_threads : int
        Writer threads (>= 1), each appending to its own file.
    compression : str
        ``"zstd"`` (files ``*.jsonl.zst``) or ``"none"`` (files ``*.jsonl``).
    compression_level : int
        zstd level in [-7, 22]: negative levels are the fast ones, 0 is zstd's default (3).
    enabled : bool
        Whether the run stores trajectories; read by the caller, not by the writer.
    directory : str
        Store directory; empty means the caller fills in the run directory.
    linger_seconds : float
        How long (>= 0) a writer thread waits, after the first record of a batch, for more
        records before writing it (it writes at once when :data:`LINGER_RECORDS` are queued,
        on ``flush`` and on ``close``). Frames of many records compress far better than
        frames of one (single-turn sessions of the demo model: 5.2x against 1.7x at level 3);
        records in flight are lost if the process dies, so this bounds that window too.

    Raises
    ------
    ValueError
        A field is out of range; the message names it as ``trajectory.<field>``.
    """

    cache_size: int = 1000
    write_threads: int = 4
    compression: str = "zstd"
    compression_level: int = 3
    enabled: bool = False  # store every agent session (agent.path runs) as a trajectory record
    directory: str = ""  # store directory; "": <run dir>/trajectories
    linger_seconds: float = 1.0

    def __post_init__(self):
        for key in ("cache_size", "write_threads", "compression_level"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                _invalid(key, value, "must be an integer")
        if self.cache_size < 1:
            _invalid("cache_size", self.cache_size, "must be >= 1")
        if self.write_threads < 1:
            _invalid("write_threads", self.write_threads, "must be >= 1")
        if self.compression not in COMPRESSIONS:
            _invalid("compression", self.compression, f"must be one of {COMPRESSIONS}")
        if not -7 <= self.compression_level <= 22:
            _invalid("compression_level", self.compression_level, "must be in [-7, 22]")
        if not isinstance(self.enabled, bool):
            _invalid("enabled", self.enabled, "must be true or false")
        if not isinstance(self.directory, (str, os.PathLike)):
            _invalid("directory", self.directory, "must be a path")
        if (
            isinstance(self.linger_seconds, bool)
            or not isinstance(self.linger_seconds, (int, float))
            or not 0 <= self.linger_seconds <= 3600
        ):
            _invalid("linger_seconds", self.linger_seconds, "must be a number in [0, 3600]")


def _invalid(key: str, value, why: str):
    raise ValueError(f"trajectory.{key} = {value!r} {why}")


@dataclass
class TrajectoryStats:
    """Counters of a :class:`TrajectoryWriter` (a snapshot; sizes in bytes, times in seconds).

    Attributes
    ----------
    records_written : int
        Records on disk (flushed to the operating system).
    raw_bytes : int
        Size of their JSON lines, uncompressed UTF-8.
    stored_bytes : int
        Bytes appended to the files.
    stall_seconds : float
        Time ``put`` spent waiting for room in a full cache; exactly 0.0 if it never waited.
    errors : int
        Failures of writer threads.
    frames : int
        Batches written (zstd frames, or appends of plain JSON lines).
    write_seconds : float
        Thread-seconds spent serialising, compressing and writing, summed over threads.
    """

    records_written: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    stall_seconds: float = 0.0
    errors: int = 0
    frames: int = 0
    write_seconds: float = 0.0

    @property
    def compression_ratio(self) -> float:
        """``raw_bytes / stored_bytes``; 0.0 before anything is written."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def as_dict(self, prefix: str = "trajectory/") -> dict[str, float]:
        """The counters and ``compression_ratio`` keyed ``<prefix><field>`` for logging."""
        out = {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out[prefix + "compression_ratio"] = self.compression_ratio
        return out


class _FileSink:
    """One writer thread's append-only file, opened (directory created) on the first batch."""

    def __init__(self, path: Path, level: int | None):
        self.path = path
        self._file = None
        self._compressor = None  # ZstdCompressor is not thread-safe: one per thread
        if level is not None:
            self._compressor = _zstd().ZstdCompressor(level=level, write_checksum=True)

    def append(self, raw: bytes) -> int:
        """Append ``raw`` (one zstd frame if compressed) unbuffered; returns the bytes written.

        A failed write is cut off again, so the file never ends in a partial batch.
        """
        data = raw if self._compressor is None else self._compressor.compress(raw)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab", buffering=0)
        start = self._file.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view) :]
        except OSError:
            try:
                self._file.truncate(start)
            except OSError:
                pass  # the reader then reports the partial frame
            raise
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file, file = None, self._file
            file.close()


def _encode(batch: list[dict]) -> bytes:
    return "".join(
        json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in batch
    ).encode("utf-8")


class TrajectoryWriter:
    """Background writer of trajectory records; ``put`` never touches the disk.

    Parameters
    ----------
    directory : str or os.PathLike
        Store directory, created on the first write; empty falls back to ``config.directory``.
    config : TrajectoryConfig, optional
        Cache size, threads and compression; defaults to ``TrajectoryConfig()``.
    name : str
        File name prefix; distinct per process sharing a directory (see the module doc).

    Raises
    ------
    ValueError
        No directory was given, or ``name`` is not a plain file name.
    TrajectoryStoreError
        A writer of ``(directory, name)`` is already open in this process, or zstd
        compression was asked for without the ``zstandard`` package.

    Notes
    -----
    After a thread fails (directory not creatable, file not writable, disk full, record not
    serialisable) the other threads keep draining the queue, but ``put``, ``flush`` and
    ``close`` raise :class:`TrajectoryStoreError` naming the file, the error and how many
    accepted records are not written. Usable as a context manager (``close`` on exit);
    records still queued when the interpreter exits without ``close`` are lost.
    """

    def __init__(self, directory, config: TrajectoryConfig | None = None, name: str = "rollout"):
        self.config = config if config is not None else TrajectoryConfig()
        directory = directory or self.config.directory
        if not directory:
            raise ValueError("trajectory.directory is empty: pass a directory to the writer")
        if not name or os.sep in name or name in (".", ".."):
            raise ValueError(f"trajectory writer name {name!r} must be a plain file name")
        self.directory, self.name = Path(directory), name
        zstd = self.config.compression == "zstd"
        level = self.config.compression_level if zstd else None
        suffix = SUFFIXES[0] if zstd else SUFFIXES[1]
        sinks = [
            _FileSink(self.directory / f"{name}-{i}{suffix}", level)
            for i in range(self.config.write_threads)
        ]
        self._key = (os.path.abspath(self.directory), name)
        with _ACTIVE_LOCK:
            if self._key in _ACTIVE:
                raise TrajectoryStoreError(
                    f"a trajectory writer named {name!r} is already open "
                    f"in {self.directory}: give each writer its own name"
                )
            _ACTIVE.add(self._key)
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._queue: deque[dict] = deque()
        self._stats = TrajectoryStats()
        self._accepted = 0
        self._error: str | None = None
        self._closed = False
        self._flushing = 0  # flush calls in progress
        self._threads = [
            threading.Thread(
                target=self._run, args=(s,), daemon=True, name=f"trajectory-{name}-{i}"
            )
            for i, s in enumerate(sinks)
        ]
        for thread in self._threads:
            thread.start()

    # -- producer side -------------------------------------------------------------------

    def put(self, record: dict) -> None:
        """Queue ``record`` for writing; returns at once unless the cache is full.

        Parameters
        ----------
        record : dict
            JSON-serialisable record; it must not be modified after ``put``.

        Raises
        ------
        TypeError
            ``record`` is not a dict.
        TrajectoryStoreError
            A writer thread has failed, or the writer is closed.
        """
        if not isinstance(record, dict):
            raise TypeError(f"trajectory record must be a dict, got {type(record).__name__}")
        with self._lock:
            self._check_usable()
            if len(self._queue) >= self.config.cache_size:
                start = time.perf_counter()
                while (
                    len(self._queue) >= self.config.cache_size
                    and self._error is None
                    and not self._closed
                ):
                    self._not_full.wait()
                self._stats.stall_seconds += time.perf_counter() - start
                self._check_usable()
            self._queue.append(record)
            self._accepted += 1
            self._not_empty.notify()

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every record put so far is on disk.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait at most; None waits without limit.

        Raises
        ------
        TrajectoryStoreError
            A writer thread has failed, or ``timeout`` expired (the message gives the count
            of records pending).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._flushing += 1  # lingering threads write what they have at once
            self._not_empty.notify_all()
            try:
                while self._error is None and self._pending() > 0:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TrajectoryStoreError(
                            f"trajectory flush of {self.directory} timed out after "
                            f"{timeout:g} s with {self._pending()} records pending"
                        )
                    self._progress.wait(remaining)
                self._check_error()
            finally:
                self._flushing -= 1

    def close(self, timeout: float = 60.0) -> None:
        """Write out the queue and stop the threads; calling it again is harmless.

        Parameters
        ----------
        timeout : float
            Seconds to wait at most for the threads to finish.

        Raises
        ------
        TrajectoryStoreError
            A writer thread has failed (raised by every call), or ``timeout`` expired.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = any(thread.is_alive() for thread in self._threads)
        if not alive:  # a timed-out writer keeps its name reserved: its threads still append
            with _ACTIVE_LOCK:
                _ACTIVE.discard(self._key)
        with self._lock:
            self._check_error()
            if alive:
                raise TrajectoryStoreError(
                    f"trajectory close of {self.directory} timed out after {timeout:g} s "
                    f"with {self._pending()} records pending"
                )

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except TrajectoryStoreError:
            if not isinstance(exc, TrajectoryStoreError):  # else already reported by put
                raise

    @property
    def stats(self) -> TrajectoryStats:
        """A snapshot of the counters (:class:`TrajectoryStats`)."""
        with self._lock:
            return dataclasses.replace(self._stats)

    @property
    def pending(self) -> int:
        """Records accepted by ``put`` and not yet on disk."""
        with self._lock:
            return self._pending()

    @property
    def error(self) -> str | None:
        """One-line message of the first thread failure (file and OSError), None if none."""
        with self._lock:
            return self._error

    def _pending(self) -> int:
        return self._accepted - self._stats.records_written

    def _check_error(self) -> None:
        if self._error is not None:
            raise TrajectoryStoreError(f"{self._error}; {self._pending()} records not written")

    def _check_usable(self) -> None:
        self._check_error()
        if self._closed:
            raise TrajectoryStoreError(
                f"trajectory writer {self.name!r} of {self.directory} is closed"
            )

    # -- writer threads ------------------------------------------------------------------

    def _run(self, sink: _FileSink) -> None:
        try:
            while (batch := self._take()) is not None:
                start = time.perf_counter()
                raw = _encode(batch)
                stored = sink.append(raw)
                self._done(len(batch), len(raw), stored, time.perf_counter() - start)
        except Exception as exc:  # stored and raised by the producer's next call
            self._fail(sink.path, exc)
        finally:
            try:
                sink.close()
            except OSError as exc:
                self._fail(sink.path, exc)

    def _take(self) -> list[dict] | None:
        """The next batch (after lingering for more records), or None once closed and empty."""
        enough = min(LINGER_RECORDS, self.config.cache_size)
        with self._lock:
            while True:
                while not self._queue and not self._closed:
                    self._not_empty.wait()
                if not self._queue:
                    return None
                deadline = time.monotonic() + self.config.linger_seconds
                while (
                    self._queue
                    and len(self._queue) < enough
                    and not self._closed
                    and not self._flushing
                    and time.monotonic() < deadline
                ):
                    self._not_empty.wait(deadline - time.monotonic())
                if self._queue:  # else another thread took them while this one waited
                    break
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
            self._not_full.notify_all()
            return batch

    def _done(self, records: int, raw: int, stored: int, seconds: float) -> None:
        with self._lock:
            s = self._stats
            s.records_written += records
            s.raw_bytes += raw
            s.stored_bytes += stored
            s.write_seconds += seconds
            s.frames += 1
            self._progress.notify_all()

    def _fail(self, path: Path, exc: BaseException) -> None:
        message = _one_line(
            f"trajectory writer could not write {path}: {type(exc).__name__}: {exc}"
        )
        with self._lock:
            self._stats.errors += 1
            self._error = self._error or message
            self._not_full.notify_all()
            self._progress.notify_all()


# -- reading ------------------------------------------------------------------------------


def read_trajectories(directory, pattern: str = "*") -> Iterator[dict]:
    """Every record of every ``*.jsonl.zst`` / ``*.jsonl`` file of a store, files by name.

    Parameters
    ----------
    directory : str or os.PathLike
        Store directory.
    pattern : str
        Glob of the file names to read, e.g. ``"rollout-*"``; files without one of the two
        suffixes are skipped.

    Yields
    ------
    dict
        The records, in file order within each file.

    Raises
    ------
    TrajectoryStoreError
        The directory is missing, or a file is corrupt or truncated (bad zstd data or
        checksum, incomplete last frame, invalid JSON, or a last line without newline); the
        message names the file and the 1-based record number. A file that a writer is
        appending to at the same time can end in an incomplete line or frame and then raises
        the same way.
    """
    root = Path(directory)
    if not root.is_dir():
        raise TrajectoryStoreError(f"trajectory directory {root} does not exist")
    paths = sorted(p for p in root.glob(pattern) if p.is_file() and p.name.endswith(SUFFIXES))
    for path in paths:
        yield from _read_file(path)


def _read_file(path: Path) -> Iterator[dict]:
    chunks = _zstd_chunks(path) if path.name.endswith(".zst") else _plain_chunks(path)
    number, tail = 0, b""
    while True:
        try:
            chunk = next(chunks, None)
        except Exception as exc:  # OSError, ZstdError, truncated frame
            raise _corrupt(path, number + 1, f"{type(exc).__name__}: {exc}") from exc
        if chunk is None:
            break
        *lines, tail = (tail + chunk).split(b"\n")
        for line in lines:
            number += 1
            yield _parse(path, number, line)
    if tail:
        raise _corrupt(path, number + 1, "truncated: last line has no newline")


def _parse(path: Path, number: int, line: bytes) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt(path, number, f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(record, dict):
        raise _corrupt(path, number, f"not a JSON object but {type(record).__name__}")
    return record


def _corrupt(path: Path, number: int, why: str) -> TrajectoryStoreError:
    return TrajectoryStoreError(
        _one_line(f"corrupt trajectory file {path} at record {number}: {why}")
    )


def _plain_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_READ_SIZE):
            yield chunk


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """Decompressed bytes of a sequence of zstd frames; a partial last frame raises.

    (``stream_reader(read_across_frames=True)`` ends silently at a truncated frame.)
    """
    dctx = _zstd().ZstdDecompressor()
    frame = None
    with open(path, "rb") as f:
        while chunk := f.read(_READ_SIZE):
            while chunk:
                if frame is None:
                    frame = dctx.decompressobj()
                yield frame.decompress(chunk)
                if not frame.eof:
                    break
                chunk, frame = frame.unused_data, None
    if frame is not None:
        raise ValueError("truncated zstd frame at end of file")
