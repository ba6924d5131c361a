"""Run user agents as the rollout workload: n sessions per prompt on an asyncio loop.

A user agent is ``async def run_agent_return_reward(data: dict, client) -> float`` (or a class
with such a method; a one-argument function gets its client from :func:`current_client`). It
talks to the model only through ``client`` — an :class:`~areal_fast.agent.client.AgentClient`
in-process, or ``openai.AsyncOpenAI`` pointed at the local endpoint in "http" mode — and
returns the reward. :class:`AgentRunner` runs ``n`` sessions per GRPO group concurrently with a
per-session timeout; an agent that raises, times out or returns a non-number is dropped with a
counted reason and a logged one-line message while the others go on.

:class:`EngineBridge` turns ``await generate(...)`` into :class:`GenRequest` s for an
:class:`~areal_fast.rollout.engine.AsyncInferenceEngine`. When a weight update aborts a
request, the bridge resubmits the prompt plus the partial output with the remaining budget
(the sample continues its random stream), so a model call spans versions token by token.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import importlib.util
import inspect
import itertools
import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from areal_fast.agent.client import AgentClient, ChatBackend, GenResult, SessionDefaults
from areal_fast.agent.session import EXPORT_MODES, Session
from areal_fast.rollout.engine import GenOutput, GenRequest, sample_seed

log = logging.getLogger("areal_fast.agent")
_CLIENT: contextvars.ContextVar = contextvars.ContextVar("areal_fast_agent_client")
AGENT_MODES = ("inprocess", "http")


@dataclass
class AgentConfig:
    """``agent.*``: which agent drives rollout and how its sessions become training data."""

    # "package.module:name" or "path/to/file.py:name" of run_agent_return_reward or of a
    # class with that method; "" = plain single-turn rollout without an agent
    path: str = ""
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the class's constructor
    mode: str = "inprocess"  # "inprocess" client, or "http": openai.AsyncOpenAI + endpoint
    host: str = "127.0.0.1"  # endpoint address in "http" mode (port chosen free)
    export: str = "concat"  # "concat" (one sequence per chain, env masked) | "per_turn"
    turn_discount: float = 1.0  # γ: a call k turns before the end gets γ^k of the reward
    timeout: float = 600.0  # seconds one session may run before it is dropped
    max_tokens_cap: int = 4096  # largest max_tokens a call may ask for
    max_prompt_tokens: int = 2048  # longest prompt a call may send, in tokens

    def __post_init__(self):
        if self.mode not in AGENT_MODES:
            raise ValueError(f"agent.mode = {self.mode!r} is not one of {AGENT_MODES}")
        if self.export not in EXPORT_MODES:
            raise ValueError(f"agent.export = {self.export!r} is not one of {EXPORT_MODES}")
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"agent.turn_discount = {self.turn_discount} must be in [0, 1]")
        if not self.timeout > 0:
            raise ValueError(f"agent.timeout = {self.timeout} must be > 0 seconds")
        for key in ("max_tokens_cap", "max_prompt_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"agent.{key} = {getattr(self, key)} must be >= 1")
        if self.path and ":" not in self.path:
            raise ValueError(f"agent.path = {self.path!r} must look like 'module:name' or "
                             f"'file.py:name'")


def current_client():
    """The client of the session the calling coroutine belongs to (for one-argument agents).

    Raises
    ------
    RuntimeError
        Outside an agent session.
    """
    try:
        return _CLIENT.get()
    except LookupError:
        raise RuntimeError("current_client() called outside an agent session") from None


def load_agent(path: str, kwargs: Optional[dict] = None) -> Callable:
    """The agent callable named by ``path`` ("module:name" or "file.py:name").

    A class is instantiated with ``kwargs`` and its ``run_agent_return_reward`` method is
    returned.

    Raises
    ------
    ValueError
        Naming ``agent.path``: the module or file cannot be imported, the name is missing, the
        class cannot be constructed with ``kwargs``, or it is not an async function taking (data) or (data, client).
    """
    where, _, name = path.rpartition(":")
    try:
        if where.endswith(".py"):
            file = Path(where)
            spec = importlib.util.spec_from_file_location(f"areal_fast_agent_{file.stem}", file)
            if spec is None or not file.is_file():
                raise FileNotFoundError(f"no file {file}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's path
        raise ValueError(f"agent.path = {path!r}: cannot import {where!r} "
                         f"({type(exc).__name__}: {exc})") from exc
    target = getattr(module, name, None)
    if target is None:
        raise ValueError(f"agent.path = {path!r}: {where!r} has no {name!r}")
    if inspect.isclass(target):
        try:
            instance = target(**(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise ValueError(f"agent.path = {path!r}: cannot construct {name} with agent.kwargs "
                             f"({type(exc).__name__}: {exc})") from exc
        target = getattr(instance, "run_agent_return_reward", None)
    if not inspect.iscoroutinefunction(target):
        raise ValueError(f"agent.path = {path!r} is not an async function (or a class with "
                         f"an async run_agent_return_reward method)")
    if len(inspect.signature(target).parameters) not in (1, 2):
        raise ValueError(f"agent.path = {path!r} must take (data) or (data, client)")
    return target


class EngineBridge:
    """``await generate(...)`` over a request-level engine (see the module docstring).

    Parameters
    ----------
    engine : AsyncInferenceEngine
    loop : asyncio.AbstractEventLoop
        The loop whose coroutines await :meth:`generate`.
    rids : iterator of int
        Request ids shared with other users of the engine (unique per engine).
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, rids=None):
        self.engine, self.loop = engine, loop
        self.rids = rids if rids is not None else itertools.count()
        self.pending: dict[int, tuple[asyncio.Future, GenRequest, GenResult]] = {}
        self.lock = threading.Lock()

    async def generate(self, input_ids: list[int], max_new_tokens: int, temperature: float,
                       top_p: float, seed: int) -> GenResult:
        """Sample one completion of ``input_ids`` (see :data:`~areal_fast.agent.client.
        GenerateFn`); cancelling the awaiting task forgets the request."""
        future = self.loop.create_future()
        request = GenRequest(next(self.rids), list(input_ids), max_new_tokens, temperature,
                             top_p, seed, 0)
        with self.lock:
            self.pending[request.rid] = (future, request, GenResult([], [], [], ""))
        self.engine.submit([request])
        try:
            return await future
        finally:
            with self.lock:
                for rid in [r for r, entry in self.pending.items() if entry[0] is future]:
                    del self.pending[rid]

    def owns(self, rid: int) -> bool:
        """Whether request ``rid`` is one of this bridge's (still awaited)."""
        with self.lock:
            return rid in self.pending

    def on_output(self, out: GenOutput) -> Optional[GenRequest]:
        """Take one engine output (any thread). Returns the resubmission of an aborted
        request with budget left (the caller submits it at the front), else None."""
        with self.lock:
            entry = self.pending.pop(out.rid, None)
            if entry is None:
                return None
            future, request, acc = entry
            acc.output_ids += out.output_ids
            acc.logprobs += out.logprobs
            acc.versions += out.versions
            done = len(acc.output_ids)
            if out.stop_reason == "abort" and done < request.max_new_tokens:
                again = GenRequest(next(self.rids), request.input_ids + acc.output_ids,
                                   request.max_new_tokens - done, request.temperature,
                                   request.top_p, request.seed, done)
                self.pending[again.rid] = (future, request, acc)
                return again
        acc.stop_reason = "length" if out.stop_reason == "abort" else out.stop_reason
        self.loop.call_soon_threadsafe(_resolve, future, acc)
        return None

    def pump(self, timeout: float = 0.5) -> None:
        """Route one batch of the engine's outputs (for callers without a rollout worker)."""
        again = [r for r in map(self.on_output, self.engine.get_outputs(timeout)) if r]
        if again:
            self.engine.submit(again, front=True)


def _resolve(future: asyncio.Future, result: GenResult) -> None:
    if not future.done():
        future.set_result(result)


@dataclass
class GroupSessions:
    """The finished sessions of one GRPO group (what :class:`AgentRunner` reports)."""

    group_id: int
    sessions: list[Session]


class AgentRunner:
    """Runs agent sessions on an asyncio loop in a thread of its own.

    Parameters
    ----------
    agent : callable
        From :func:`load_agent`.
    backend_factory : callable (loop) -> (ChatBackend, EngineBridge or None)
        Builds the chat backend on the runner's loop (the bridge's futures belong to it).
    config : AgentConfig
    on_group_done : callable (GroupSessions) -> None
        Called from the runner's thread when every session of a group has ended.
    """

    def __init__(self, agent: Callable, backend_factory: Callable, config: AgentConfig,
                 on_group_done: Callable[[GroupSessions], None]):
        self.agent, self.config, self.on_group_done = agent, config, on_group_done
        self.takes_client = len(inspect.signature(agent).parameters) == 2
        self.loop = asyncio.new_event_loop()
        self.backend, self.bridge = backend_factory(self.loop)
        self.server = None
        self.tasks: dict[int, list[asyncio.Task]] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop",
                                       daemon=True)

    def start(self) -> None:
        """Start the loop thread (and the endpoint in "http" mode)."""
        self.thread.start()
        if self.config.mode == "http":
            from areal_fast.agent.server import AgentServer

            self.server = AgentServer(self.backend, host=self.config.host)
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)

    def submit_group(self, group_id: int, data: dict, n: int, seed: int,
                     defaults: SessionDefaults) -> None:
        """Start ``n`` sessions of ``data`` (thread-safe); session i samples with the seed
        ``sample_seed(seed, i)``."""
        def start():
            sessions = [Session(data=_jsonable(data), group_id=group_id) for _ in range(n)]
            tasks = [self.loop.create_task(self._run(s, _with_seed(defaults, seed, i)))
                     for i, s in enumerate(sessions)]
            self.tasks[group_id] = tasks
            self.loop.create_task(self._gather(group_id, sessions, tasks))
        self.loop.call_soon_threadsafe(start)

    async def _gather(self, group_id: int, sessions: list[Session], tasks) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.tasks.pop(group_id, None) is not None:
            self.on_group_done(GroupSessions(group_id, sessions))

    async def _run(self, session: Session, defaults: SessionDefaults) -> None:
        client, token = self._client(session, defaults)
        _CLIENT.set(client)
        try:
            args = (dict(session.data), client) if self.takes_client else (dict(session.data),)
            reward = await asyncio.wait_for(self.agent(*args), self.config.timeout)
        except asyncio.TimeoutError:
            return self._drop(session, "timeout", f"did not finish within agent.timeout = "
                                                  f"{self.config.timeout:g} s")
        except asyncio.CancelledError:
            return session.drop("cancelled", "cancelled by the controller")
        except Exception as exc:  # noqa: BLE001 - a failing agent only drops its session
            return self._drop(session, "agent_error", f"{type(exc).__name__}: "
                                                      f"{_first_line(exc)}")
        finally:
            if token is not None:
                self.server.close_session(token)
                await client.close()
        try:
            session.finish(reward)
        except ValueError as exc:
            self._drop(session, "bad_reward" if session.calls else "no_calls", str(exc))

    def _client(self, session: Session, defaults: SessionDefaults):
        if self.config.mode == "inprocess":
            return AgentClient(session, self.backend, defaults), None
        import openai

        token = self.server.open_session(session, defaults)
        return openai.AsyncOpenAI(base_url=self.server.url, api_key=token, max_retries=0,
                                  timeout=self.config.timeout), token

    @staticmethod
    def _drop(session: Session, reason: str, error: str) -> None:
        session.drop(reason, error)
        log.warning("agent session %s (group %d) dropped (%s): %s", session.session_id[:8],
                    session.group_id, reason, error)

    def cancel_all(self, timeout: float = 30.0) -> int:
        """Cancel every running session; their groups are not reported. Returns how many
        groups were cancelled."""
        async def cancel():
            groups = list(self.tasks.items())
            self.tasks.clear()
            for _, tasks in groups:
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*[t for _, ts in groups for t in ts], return_exceptions=True)
            return len(groups)
        return asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel sessions, stop the endpoint and the loop thread."""
        if not self.thread.is_alive():
            return
        self.cancel_all(timeout)
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


def _with_seed(defaults: SessionDefaults, seed: int, index: int) -> SessionDefaults:
    from dataclasses import replace

    return replace(defaults, seed=sample_seed(seed, index))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _jsonable(data: dict) -> dict:
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool, list, dict,
                                                                 type(None)))}
