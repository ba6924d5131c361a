"""Worker processes of the local launcher: spawn, message, wait with deadlines, detect death.

Each worker is a ``spawn``-ed process connected to the controller by a duplex pipe. Messages
are the dataclasses of :mod:`areal_fast.wire.messages`, sent as msgpack
(:mod:`areal_fast.wire.codec`; nothing is unpickled). :func:`wait_messages` waits on
every pipe and every process sentinel at once, so a worker that dies is reported at once, by name, instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import selectors
import threading
import traceback
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Optional

from areal_fast.wire.codec import CodecError, MessageChannel
from areal_fast.wire.messages import WorkerFailed


class WorkerError(RuntimeError):
    """A worker died, failed, or did not answer in time; the message names it.

    Attributes
    ----------
    worker : str or None
        Name of the worker concerned (None when no single worker is to blame).
    died : bool
        The worker's process is gone (killed, crashed), or it reported a failure of its
        inference engine: a restart may help.
    """

    def __init__(self, message: str, worker: Optional[str] = None, died: bool = False):
        super().__init__(message)
        self.worker, self.died = worker, died


class WorkerHandle:
    """The controller's end of one worker: a :class:`MessageChannel` plus its process.

    Subclasses say how the process is watched and stopped: :class:`ProcessHandle` (a local
    ``spawn`` process) and the Ray launcher's actor handle.
    """

    name: str
    conn: MessageChannel
    node: Optional[str] = None  # where it runs when that is not this machine (a node IP)

    @property
    def sentinel(self):
        """An object ``multiprocessing.connection.wait`` reports when the process ends, or
        None (then death shows as the channel's end of file)."""
        return None

    @property
    def pid(self) -> Optional[int]:
        """Operating-system process id of the worker (None if unknown)."""
        return None

    def exit_status(self) -> str:
        """ "still running", "exit code N", or what else is known of its end."""
        return "exited"

    def send(self, message) -> None:
        """Send one message.

        Raises
        ------
        WorkerError
            The channel is broken (the worker died).
        """
        try:
            self.conn.send(message)
        except (OSError, ValueError) as exc:
            raise WorkerError(
                f"worker {self.name!r} is unreachable ({self.exit_status()}): {exc}",
                self.name,
                died=True,
            ) from exc

    def died_message(self, doing: str) -> str:
        """One line saying that this worker died and what it was doing."""
        where = f", node {self.node}" if self.node else ""
        return (
            f"worker {self.name!r} (pid {self.pid}{where}) died with {self.exit_status()} {doing}"
        )

    def reap(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a dead worker's exit status."""

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it has not after ``timeout`` seconds."""
        raise NotImplementedError


class ProcessHandle(WorkerHandle):
    """A worker in a local ``spawn`` process (see :func:`spawn_worker`)."""

    def __init__(self, name: str, process: mp.Process, conn: MessageChannel):
        self.name, self.process, self.conn = name, process, conn

    @property
    def sentinel(self):
        return self.process.sentinel

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def exit_status(self) -> str:
        code = self.process.exitcode
        return "still running" if code is None else f"exit code {code}"

    def reap(self, timeout: float) -> None:
        self.process.join(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        from areal_fast.wire.messages import Shutdown

        if self.process.is_alive():
            try:
                self.conn.send(Shutdown())
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():  # a local worker defers SIGTERM: it is killed
            self.process.kill()
            self.process.join(timeout)
        self.conn.close()


def _worker_entry(target, raw_conn, name: str, spec, authkey: bytes) -> None:
    """Run ``target(conn, name, spec, authkey)`` with ``conn`` a :class:`MessageChannel`
    over ``raw_conn``; report an exception before exiting."""
    conn = MessageChannel(raw_conn)
    try:
        target(conn, name, spec, authkey)
    except BaseException as exc:  # noqa: BLE001 - reported, then re-raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        try:
            restartable = bool(getattr(exc, "restartable", False))  # e.g. an EngineError
            conn.send(WorkerFailed(name, f"{type(exc).__name__}: {first}", restartable))
        except (OSError, ValueError):
            pass
        if os.environ.get("AREAL_FAST_DEBUG"):
            traceback.print_exc()
        raise


def spawn_worker(
    name: str, target, spec, authkey: bytes, env: Optional[dict[str, str]] = None
) -> ProcessHandle:
    """Start ``target(conn, name, spec, authkey)`` in a new ``spawn`` process.

    ``target`` and ``spec`` must be picklable (module-level function, dataclass spec).
    ``env``: variables the new interpreter starts with besides this process's environment
    (e.g. ``LD_PRELOAD``, which only an exec'd process takes); this process's own
    environment is restored as soon as the child has started.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(
        target=_worker_entry, args=(target, child, name, spec, authkey), name=name, daemon=True
    )
    if env:  # started lazily by the first spawn; it must not inherit ``env``
        resource_tracker.ensure_running()
    with _SPAWN_LOCK, _environment(env or {}):
        process.start()
    child.close()
    return ProcessHandle(name, process, MessageChannel(parent))


_SPAWN_LOCK = threading.Lock()  # one process start at a time while the environment is changed


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` with ``env`` set inside the block, as it was after it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _receive(handle: WorkerHandle, doing: str):
    """One message from ``handle`` (which is readable).

    Raises
    ------
    WorkerError
        The worker's channel is closed, the bytes are undecodable, or the message is a
        :class:`WorkerFailed`.
    """
    try:
        message = handle.conn.recv()
    except (EOFError, OSError):
        handle.reap(1.0)
        raise WorkerError(handle.died_message(doing), handle.name, died=True) from None
    except CodecError as exc:
        raise WorkerError(
            f"worker {handle.name!r} sent an undecodable message {doing}: {exc}", handle.name
        ) from None
    if isinstance(message, WorkerFailed):
        where = f" (node {handle.node})" if handle.node else ""
        raise WorkerError(
            f"worker {message.name!r}{where} failed {doing}: {message.message}",
            handle.name,
            died=message.restartable,
        )
    return message


def wait_messages(
    handles: list[WorkerHandle], timeout: float, doing: str
) -> list[tuple[WorkerHandle, object]]:
    """Every message that arrives within ``timeout`` seconds (at least one unless timed out).

    Returns a possibly empty list of (handle, message) when the time runs out.

    Raises
    ------
    WorkerError
        A worker process exited, or reported :class:`WorkerFailed`; the message names the
        worker and ``doing`` (what the controller was waiting for).
    """
    by_conn = {h.conn: h for h in handles}
    by_sentinel = {h.sentinel: h for h in handles if h.sentinel is not None}
    ready = wait(list(by_conn) + list(by_sentinel), timeout)
    out = []
    for obj in ready:
        if obj in by_conn:
            handle = by_conn[obj]
            while handle.conn.poll():
                out.append((handle, _receive(handle, doing)))
    for obj in ready:
        if obj in by_sentinel and not by_sentinel[obj].conn.poll():
            handle = by_sentinel[obj]
            handle.reap(1.0)
            raise WorkerError(handle.died_message(doing), handle.name, died=True)
    return out


class MessageWaiter:
    """:func:`wait_messages` over a fixed set of handles, their descriptors registered once
    (epoll on Linux): a call costs O(readable channels) instead of O(handles)
    (``multiprocessing.connection.wait`` registers every descriptor anew on each call).

    One message is read per readable channel per call; the selector is level-triggered, so
    the rest come with the next call.
    """

    def __init__(self, handles: list[WorkerHandle]):
        self._selector = selectors.DefaultSelector()
        self._failure: Optional[WorkerError] = None  # raised by the next call
        for handle in handles:
            self._selector.register(handle.conn.fileno(), selectors.EVENT_READ, (handle, False))
            if handle.sentinel is not None:
                try:
                    self._selector.register(handle.sentinel, selectors.EVENT_READ, (handle, True))
                except KeyError:  # a sentinel shared by several handles
                    pass

    def wait(self, timeout: float, doing: str) -> list[tuple[WorkerHandle, object]]:
        """As :func:`wait_messages` (same errors), at most one message per channel.

        A worker's death or failure never discards messages already read from the others
        in the same call: they are returned, and the error is raised by the next call.
        """
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        out, exited = [], []
        for key, _ in self._selector.select(timeout):
            handle, is_sentinel = key.data
            if is_sentinel:
                exited.append(handle)
                continue
            try:
                out.append((handle, _receive(handle, doing)))
            except WorkerError as exc:
                self._failure = self._failure or exc
        for handle in exited:
            if self._failure is None and not handle.conn.poll():  # last messages first
                handle.reap(1.0)
                self._failure = WorkerError(handle.died_message(doing), handle.name, died=True)
        if self._failure is not None and not out:
            failure, self._failure = self._failure, None
            raise failure
        return out

    def close(self) -> None:
        """Unregister every descriptor."""
        self._selector.close()
