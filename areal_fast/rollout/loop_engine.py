"""The request-level engine skeleton over an asyncio engine client (vLLM, vLLM / SGLang servers).

:class:`LoopEngine` implements :class:`~areal_fast.rollout.engine.AsyncInferenceEngine` once
for every engine whose client is asynchronous: an ``AsyncLLM`` in this process, or an HTTP
server. It owns an asyncio event loop on a thread of its own, a waiting queue and the set of
running requests; a subclass only says how to run one request and how to pause, resume,
load weights and shut its engine down (the ``_engine_*`` coroutines).

At most ``max_running`` requests are inside the engine at a time (``rollout.max_batch_size``);
the rest wait here, so that :meth:`submit` with ``front=True`` and :meth:`drop_queued` act on
requests the engine has not seen. A request enters the engine as soon as another leaves it:
the engine batches continuously, so a new request joins the running batch at its next step.

Pausing, two modes (``rollout.pause_mode``):

- ``abort``: the engine aborts every running request; each comes back from
  :meth:`get_outputs` with its partial tokens and stop_reason "abort" (the rollout worker
  resubmits prompt + partial with the remaining budget: the KV cache is recomputed under the
  new weights). :meth:`pause` returns once no request is inside the engine.
- ``keep``: the engine freezes its running requests in place; they continue after
  :meth:`resume` with their KV cache, computed by the old weights for the tokens before the
  seam, and the tokens after it carry the new version. :meth:`pause` returns once the
  engine has stopped stepping.

Every request carries a cache salt naming the version it started under (``"v<version>"``),
so the engine's prefix cache never serves KV computed by other weights to a new request.

Errors: a request that fails, or an engine that dies, stores an :class:`EngineError` naming
the engine; every later call re-raises it (the rollout worker then fails and the
controller's recovery restarts it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Iterable, Optional

import torch

from areal_fast.rollout.engine import GenOutput, GenRequest, check_requests
from areal_fast.sync.shared_memory import WeightBufferSpec

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "keep")
WATCH_INTERVAL_S = 1.0  # how often the engine's liveness is checked


class EngineError(RuntimeError):
    """An inference engine failed (its process died, a request or an update failed); the
    message names the engine. ``restartable``: a rollout worker that fails with it is
    replaced by the controller's recovery (a new worker builds a new engine)."""

    restartable = True


def spans_to_versions(spans: Optional[list], num_tokens: int, default: int) -> list[int]:
    """Per-token versions from weight-version spans over output-token indexes.

    Parameters
    ----------
    spans : list of objects or dicts with ``version``, ``start``, ``end``, or None
        vLLM's ``CompletionOutput.weight_versions`` (``WeightVersionSpan``: tokens
        ``[start, end)`` were sampled by weights labelled ``version``).
    num_tokens : int
        Output tokens of the request.
    default : int
        Version of tokens no span covers (the version the request ran under).

    Returns
    -------
    list[int]
        ``[num_tokens]`` versions.

    Raises
    ------
    ValueError
        A span label that is not an integer.
    """
    versions = [default] * num_tokens
    for span in spans or []:
        get = span.get if isinstance(span, dict) else lambda k, s=span: getattr(s, k)
        label = get("version")
        try:
            version = int(label)
        except (TypeError, ValueError):
            raise ValueError(f"weight-version span label {label!r} is not an integer") from None
        start, end = max(0, int(get("start"))), min(num_tokens, int(get("end")))
        versions[start:end] = [version] * max(0, end - start)
    return versions


class LoopEngine:
    """:class:`~areal_fast.rollout.engine.AsyncInferenceEngine` over an asyncio client.

    Subclasses implement the coroutines ``_engine_open``, ``_engine_generate``,
    ``_engine_pause``, ``_engine_resume``, ``_engine_load_buffer`` (and optionally
    ``_engine_load_tensors``) and ``_engine_close``; they run on the engine's loop thread.

    Parameters
    ----------
    name : str
        Names the engine in every error (e.g. ``"vLLM engine (AsyncLLM)"``).
    max_running : int
        Requests inside the engine at most (>= 1).
    pause_mode : {"abort", "keep"}
        What :meth:`pause` does with running requests (see the module docstring).
    initial_version : int
        Version label of the weights the engine starts with.
    call_timeout : float
        Seconds any control call (pause, resume, weight update) may take.
    startup_timeout : float, optional
        Seconds :meth:`start` may take to open the engine (default: ``call_timeout``).

    Raises
    ------
    ValueError
        ``max_running`` < 1 or an unknown ``pause_mode``.
    """

    def __init__(
        self,
        name: str,
        max_running: int,
        pause_mode: str = "abort",
        initial_version: int = 0,
        call_timeout: float = 600.0,
        startup_timeout: Optional[float] = None,
    ):
        if max_running < 1:
            raise ValueError(f"max_running = {max_running} must be >= 1")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode = {pause_mode!r}: expected one of {PAUSE_MODES}")
        self.name = name
        self.max_running = int(max_running)
        self.pause_mode = pause_mode
        self.call_timeout = float(call_timeout)
        self.startup_timeout = float(startup_timeout or call_timeout)
        self._version = int(initial_version)
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: dict[int, asyncio.Task] = {}
        self._outputs: queue.Queue = queue.Queue()
        self._paused = False
        self._kept = False  # paused in keep mode: requests frozen inside the engine
        self._error: Optional[BaseException] = None
        self._idle: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._watch: Optional[asyncio.Task] = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ the subclass's part

    async def _engine_open(self) -> None:
        """Build or connect to the engine (on the loop)."""
        raise NotImplementedError

    async def _engine_generate(self, request: GenRequest, salt: str) -> GenOutput:
        """Run one request to its end (finished, or aborted by :meth:`_engine_pause`)."""
        raise NotImplementedError

    async def _engine_pause(self, keep: bool) -> None:
        """Stop the engine stepping; abort its running requests unless ``keep``."""
        raise NotImplementedError

    async def _engine_resume(self) -> None:
        """Let the engine step again."""
        raise NotImplementedError

    async def _engine_load_buffer(self, spec: WeightBufferSpec, version: int) -> None:
        """Load a complete set of weights from a shared-memory buffer, labelled ``version``."""
        raise NotImplementedError

    async def _engine_load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load weights handed over as tensors (engines that read shared memory need not)."""
        raise NotImplementedError(f"{self.name} takes weights from a shared-memory buffer only")

    async def _engine_close(self) -> None:
        """Shut the engine (or the connection) down."""
        raise NotImplementedError

    def _engine_dead(self) -> Optional[str]:
        """Why the engine is gone (its process died), or None; polled every
        ``WATCH_INTERVAL_S`` seconds on the loop, so a dead engine fails every waiting call
        within that time instead of at the call's timeout."""
        return None

    # ------------------------------------------------------------ AsyncInferenceEngine

    @property
    def version(self) -> int:
        """Policy version of the weights being served."""
        return self._version

    def start(self) -> None:
        """Start the loop thread and open the engine (blocks until it serves).

        Raises
        ------
        RuntimeError
            Already started.
        EngineError
            The engine could not be opened (names the engine).
        TimeoutError
            It took more than ``startup_timeout``.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{type(self).__name__}-loop", daemon=True
        )
        self._thread.start()
        self._call(self._open(), "start", self.startup_timeout)

    async def _open(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        await self._engine_open()
        self._watch = asyncio.ensure_future(self._watch_engine())

    async def _watch_engine(self) -> None:
        while self._error is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            reason = self._engine_dead()
            if reason:
                self._fail(EngineError(f"{self.name}: {reason}"), "watch")
                for task in list(self._running.values()):
                    task.cancel()

    def submit(self, requests: list[GenRequest], front: bool = False) -> None:
        """Queue requests; they enter the engine while fewer than ``max_running`` run.

        Raises
        ------
        ValueError
            A malformed request (see :func:`check_requests`).
        EngineError
            The stored failure of the engine.
        """
        check_requests(requests)
        self._raise_error()
        self._require_started()
        self._loop.call_soon_threadsafe(self._enqueue, list(requests), front)

    def get_outputs(self, timeout: float) -> list[GenOutput]:
        """Finished or aborted requests, waiting up to ``timeout`` seconds for the first.

        Raises
        ------
        ValueError
            ``timeout`` < 0.
        EngineError
            The stored failure of the engine (re-raised on every call).
        """
        if timeout < 0:
            raise ValueError(f"timeout = {timeout} must be >= 0")
        outputs = []
        try:
            outputs.append(self._outputs.get(timeout=timeout))
            while True:
                outputs.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        outputs = [o for o in outputs if o is not None]  # None: a wake-up after a failure
        if not outputs:
            self._raise_error()
        return outputs

    def pause(self, timeout: float, keep: Optional[bool] = None) -> None:
        """Stop starting requests and pause the engine (see the module docstring's modes).

        Parameters
        ----------
        timeout : float
            Seconds until the engine is idle (abort) or stopped (keep).
        keep : bool, optional
            Freeze running requests in place instead of aborting them; default: the
            engine's ``pause_mode``.

        Raises
        ------
        TimeoutError
            The engine did not get there within ``timeout`` (it stays paused).
        EngineError
            The stored failure of the engine.
        """
        keep = self.pause_mode == "keep" if keep is None else bool(keep)
        self._call(self._pause(keep, timeout), "pause", timeout + 5.0)

    async def _pause(self, keep: bool, timeout: float) -> None:
        self._paused = True
        if self._kept and not keep:  # frozen requests must now come back as aborted
            await self._engine_resume()
            self._kept = False
        await self._engine_pause(keep)
        self._kept = keep and bool(self._running)
        if not keep:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"{self.name}: {len(self._running)} requests still running {timeout} s "
                    "after an aborting pause"
                ) from None

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Install a complete set of named weights carrying ``version`` (only while paused).

        Raises
        ------
        RuntimeError
            Not paused.
        NotImplementedError
            The engine takes weights from shared memory only
            (:meth:`update_weights_from_buffer`).
        EngineError
            The update failed (names the engine).
        """
        self._require_paused("update_weights")
        self._call(self._engine_load_tensors(named_tensors, int(version)), "weight update")
        self._version = int(version)

    def update_weights_from_buffer(self, spec: WeightBufferSpec, version: int) -> None:
        """Install the complete set of weights in the shared-memory buffer ``spec`` (the
        trainer's slot of this version), labelled ``version``; only while paused. The engine
        reads the buffer in place: only ``spec`` crosses to it.

        Raises
        ------
        RuntimeError
            Not paused.
        EngineError
            The update failed (names the engine; what the engine serves then is its own rule,
            e.g. vLLM's refuses to generate until a complete update arrives).
        """
        self._require_paused("update_weights_from_buffer")
        self._call(self._engine_load_buffer(spec, int(version)), "weight update")
        self._version = int(version)

    def resume(self) -> None:
        """Resume the engine (frozen requests continue) and start queued requests.

        Raises
        ------
        EngineError
            The stored failure of the engine.
        """
        self._call(self._resume(), "resume")

    async def _resume(self) -> None:
        await self._engine_resume()
        self._paused, self._kept = False, False
        self._dispatch()

    def drop_queued(self) -> int:
        """Forget queued requests the engine has not seen; returns how many."""
        return self._call(self._drop_queued(), "drop_queued")

    async def _drop_queued(self) -> int:
        dropped = len(self._waiting)
        self._waiting.clear()
        return dropped

    def close(self) -> None:
        """Cancel running requests, shut the engine down and stop the loop thread. Safe to
        call twice or without :meth:`start`; an error while shutting down is logged."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(self.call_timeout)
        except Exception as exc:  # noqa: BLE001 - the engine may already be gone
            log.warning("%s: shutting down failed: %s: %s", self.name, type(exc).__name__, exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None

    async def _close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._waiting.clear()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        await self._engine_close()

    # ------------------------------------------------------------ internals (loop thread)

    def _enqueue(self, requests: list[GenRequest], front: bool) -> None:
        if front:
            self._waiting.extendleft(reversed(requests))
        else:
            self._waiting.extend(requests)
        self._dispatch()

    def _dispatch(self) -> None:
        while (
            not self._paused
            and self._error is None
            and self._waiting
            and len(self._running) < self.max_running
        ):
            request = self._waiting.popleft()
            self._idle.clear()
            self._running[request.rid] = asyncio.ensure_future(self._run(request))

    async def _run(self, request: GenRequest) -> None:
        try:
            output = await self._engine_generate(request, f"v{self._version}")
            self._outputs.put(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - stored, re-raised by every call
            self._fail(exc, f"request {request.rid}")
        finally:
            self._running.pop(request.rid, None)
            if not self._running:
                self._idle.set()
            self._dispatch()

    def _fail(self, exc: BaseException, what: str) -> None:
        if self._error is None:
            error = exc if isinstance(exc, EngineError) else None
            if error is None:
                error = EngineError(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            self._error = error
            log.error("%s", error)
        self._outputs.put(None)  # wake get_outputs

    # ------------------------------------------------------------ internals (any thread)

    def _require_started(self) -> None:
        if self._loop is None:
            raise RuntimeError(f"{self.name}: not started (call start() first)")

    def _require_paused(self, what: str) -> None:
        if not self._paused:
            raise RuntimeError(f"{self.name}: {what} needs pause() first")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _call(self, coroutine, what: str, timeout: Optional[float] = None) -> Any:
        """Run ``coroutine`` on the loop and wait for it, in slices so that a dead engine
        fails the call at once; errors become :class:`EngineError` (``TimeoutError``,
        ``ValueError`` and ``NotImplementedError`` pass unchanged)."""
        try:
            self._require_started()
            self._raise_error()
        except BaseException:
            coroutine.close()  # never scheduled
            raise
        timeout = self.call_timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout
        while not future.done():
            left = deadline - time.monotonic()
            if self._error is not None or left <= 0:
                future.cancel()
                self._raise_error()
                raise TimeoutError(f"{self.name}: {what} took more than {timeout:g} s")
            concurrent.futures.wait([future], min(WATCH_INTERVAL_S, left))
        try:
            return future.result()
        except (EngineError, TimeoutError, ValueError, NotImplementedError):
            raise
        except concurrent.futures.CancelledError:
            self._raise_error()
            raise EngineError(f"{self.name}: {what} was cancelled") from None
        except Exception as exc:
            raise EngineError(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}") from exc
