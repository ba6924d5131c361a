"""Run user agents as the rollout workload: n sessions per prompt on an asyncio loop.

A user agent is ``async def run_agent_return_reward(data: dict, client) -> float`` (or a class
with such a method; a one-argument function gets its client from :func:`current_client`). It
talks to the model only through ``client`` — an :class:`~areal_fast.agent.client.AgentClient`
in-process, or ``openai.AsyncOpenAI`` pointed at the local endpoint in "http" mode — and
returns the reward. :class:`AgentRunner` runs ``n`` sessions per GRPO group concurrently with a
per-session timeout; an agent that raises, times out or returns a non-number is dropped with a
counted reason and a logged one-line message while the others go on. Each session gets its own
deep copy of the group's ``data``. A group is reported at the latest ``agent.timeout`` +
:data:`CANCEL_GRACE_S` seconds after it started, even if an agent ignores cancellation.

Model calls reach the engine through :class:`~areal_fast.agent.bridge.EngineBridge`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import inspect
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional

from areal_fast._user_code import import_attribute
from areal_fast.agent.client import AgentClient, SessionDefaults
from areal_fast.agent.session import EXPORT_MODES, Session
from areal_fast.rollout.engine import sample_seed

log = logging.getLogger("areal_fast.agent")
_CLIENT: contextvars.ContextVar = contextvars.ContextVar("areal_fast_agent_client")
AGENT_MODES = ("inprocess", "http")
CANCEL_GRACE_S = 10.0  # how long after agent.timeout a session that ignores cancellation runs


@dataclass
class AgentConfig:
    """``agent.*``: which agent drives rollout and how its sessions become training data.

    Attributes
    ----------
    path : str
        ``package.module:name`` or ``path/to/file.py:name`` (relative to the working
        directory) of ``run_agent_return_reward`` or of a class with that method; "" runs the
        plain single-turn rollout without an agent.
    kwargs : dict
        Keyword arguments of the class's constructor (refused for a function).
    mode : str
        "inprocess" (:class:`~areal_fast.agent.client.AgentClient`) or "http"
        (``openai.AsyncOpenAI`` against the local endpoint).
    host : str
        Endpoint address in "http" mode (a free port is chosen); 127.0.0.1 by default.
    export : str
        "concat" or "per_turn" (see :meth:`~areal_fast.agent.session.Session.export`).
    turn_discount : float
        γ in [0, 1] of the export (the agent's own reward may discount turns already).
    timeout : float
        Seconds one session may run before it is dropped.
    max_tokens_cap : int or None
        Largest ``max_tokens`` a call may ask for; None: ``rollout.max_new_tokens``.
    max_prompt_tokens : int
        Longest prompt of a call, in tokens.
    dropped_reward : float or None
        None: dropped sessions are not trained; a number: a dropped session that made a
        model call (not a cancelled one) is trained with this reward.

    Raises
    ------
    ValueError
        A field out of range; the message names it as ``agent.<field>``.
    """

    # "package.module:name" or "path/to/file.py:name" of run_agent_return_reward or of a
    # class with that method; "" = plain single-turn rollout without an agent
    path: str = ""
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the class's constructor
    mode: str = "inprocess"  # "inprocess" client, or "http": openai.AsyncOpenAI + endpoint
    host: str = "127.0.0.1"  # endpoint address in "http" mode (port chosen free)
    export: str = "concat"  # "concat" (one sequence per chain, env masked) | "per_turn"
    turn_discount: float = 1.0  # γ: a call k turns before the end gets γ^k of the reward
    timeout: float = 600.0  # seconds one session may run before it is dropped
    # largest max_tokens a call may ask for; None: rollout.max_new_tokens (the default budget)
    max_tokens_cap: Optional[int] = None
    max_prompt_tokens: int = 2048  # longest prompt a call may send, in tokens
    # reward of a dropped session that made a model call (timeout, agent error, bad reward;
    # never "cancelled"): None = dropped sessions are not trained; a number (e.g. 0) trains
    # them with it, which penalises timeouts and endless tool loops instead of training only
    # on the sessions that survived
    dropped_reward: Optional[float] = None

    def __post_init__(self):
        if self.mode not in AGENT_MODES:
            raise ValueError(f"agent.mode = {self.mode!r} is not one of {AGENT_MODES}")
        if self.export not in EXPORT_MODES:
            raise ValueError(f"agent.export = {self.export!r} is not one of {EXPORT_MODES}")
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"agent.turn_discount = {self.turn_discount} must be in [0, 1]")
        if not self.timeout > 0:
            raise ValueError(f"agent.timeout = {self.timeout} must be > 0 seconds")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(
                f"agent.max_tokens_cap = {self.max_tokens_cap} must be >= 1 "
                f"(or null: rollout.max_new_tokens)"
            )
        if self.max_prompt_tokens < 1:
            raise ValueError(f"agent.max_prompt_tokens = {self.max_prompt_tokens} must be >= 1")
        if self.dropped_reward is not None and (
            isinstance(self.dropped_reward, bool)
            or not isinstance(self.dropped_reward, (int, float))
            or not math.isfinite(self.dropped_reward)
        ):
            raise ValueError(
                f"agent.dropped_reward = {self.dropped_reward!r} must be a finite number or null"
            )
        if self.path and ":" not in self.path:
            raise ValueError(
                f"agent.path = {self.path!r} must look like 'module:name' or 'file.py:name'"
            )

    def tokens_cap(self, max_new_tokens: int) -> int:
        """The effective ``max_tokens`` cap: ``max_tokens_cap``, or ``max_new_tokens`` (the
        rollout's budget) when unset."""
        return max_new_tokens if self.max_tokens_cap is None else self.max_tokens_cap


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


def load_agent(path: str, kwargs: Optional[dict] = None, construct: bool = True) -> Callable:
    """The agent named by ``path`` ("module:name" or "file.py:name").

    Parameters
    ----------
    path : str
        ``agent.path``: an async function taking (data) or (data, client), or a class whose
        async ``run_agent_return_reward`` method takes them.
    kwargs : dict, optional
        ``agent.kwargs``, the class's constructor arguments.
    construct : bool
        True: a class is instantiated with ``kwargs`` and its bound method is returned.
        False: only check it (import the module, find the name, check that it is an async
        function or a class with such a method, and the signature) and return the function
        or the class; no user code runs but the module's import (the launcher checks
        ``agent.path`` in the controller process this way).

    Returns
    -------
    callable
        The agent function (or, with ``construct`` False, possibly the class).

    Raises
    ------
    ValueError
        Naming ``agent.path``: the module or file cannot be imported, the name is missing, the
        class cannot be constructed with ``kwargs``, ``kwargs`` are given for a function, or it
        is not an async function taking
        (data) or (data, client).
    """
    target = import_attribute(path, "agent.path")
    name = path.rpartition(":")[2]
    if kwargs and not inspect.isclass(target):
        raise ValueError(
            f"agent.kwargs = {kwargs!r} is set but agent.path = {path!r} names a "
            f"function, which takes no constructor arguments"
        )
    if inspect.isclass(target) and not construct:
        method = getattr(target, "run_agent_return_reward", None)
        raw = inspect.getattr_static(target, "run_agent_return_reward", None)
        # a plain method also takes self; a static or class method does not
        bound = isinstance(raw, staticmethod) or inspect.ismethod(method)
        _check_agent_function(path, method, 0 if bound else 1)
        return target
    if inspect.isclass(target):
        try:
            instance = target(**(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise ValueError(
                f"agent.path = {path!r}: cannot construct {name} with agent.kwargs "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        target = getattr(instance, "run_agent_return_reward", None)
    _check_agent_function(path, target, 0)
    return target


def _check_agent_function(path: str, target, self_params: int) -> None:
    """ValueError naming ``agent.path`` unless ``target`` is an async function taking (data)
    or (data, client) after ``self_params`` leading parameters (1: an unbound method)."""
    if not inspect.iscoroutinefunction(target):
        raise ValueError(
            f"agent.path = {path!r} is not an async function (or a class with "
            f"an async run_agent_return_reward method)"
        )
    if len(inspect.signature(target).parameters) - self_params not in (1, 2):
        what = "(self, data) or (self, data, client)" if self_params else "(data) or (data, client)"
        raise ValueError(f"agent.path = {path!r} must take {what}")


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
    grace : float
        Seconds after ``config.timeout`` that a session which ignores its cancellation may
        still run before its group is reported without it (the session dropped as "timeout").
    """

    def __init__(
        self,
        agent: Callable,
        backend_factory: Callable,
        config: AgentConfig,
        on_group_done: Callable[[GroupSessions], None],
        grace: float = CANCEL_GRACE_S,
    ):
        self.agent, self.config, self.on_group_done = agent, config, on_group_done
        self.grace = grace
        self.takes_client = len(inspect.signature(agent).parameters) == 2
        self.loop = asyncio.new_event_loop()
        self.backend, self.bridge = backend_factory(self.loop)
        self.server = None
        self.tasks: dict[int, list[asyncio.Task]] = {}  # running groups' session tasks
        self._gatherers: set[asyncio.Task] = set()  # strong references to _gather tasks
        self._abandoned: set[asyncio.Task] = set()  # sessions that ignored cancellation
        self._tokens: dict[str, str] = {}  # session id -> endpoint token ("http" mode)
        self._stuck = False  # the loop did not answer in time once: close() does not wait
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)

    def start(self) -> None:
        """Start the loop thread (and the endpoint in "http" mode)."""
        self.thread.start()
        if self.config.mode == "http":
            from areal_fast.agent.server import AgentServer

            self.server = AgentServer(self.backend, host=self.config.host)
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)

    def submit_group(
        self, group_id: int, data: dict, n: int, seed: int, defaults: SessionDefaults
    ) -> None:
        """Start ``n`` sessions of ``data`` (thread-safe).

        Parameters
        ----------
        group_id : int
        data : dict
            The agent's input; each session's agent gets its own deep copy, and its
            ``Session.data`` is a JSON-safe copy (values JSON cannot hold become strings).
        n : int
            Sessions (the GRPO group size).
        seed : int
            Session i samples with the seed ``sample_seed(seed, i)``.
        defaults : SessionDefaults

        Notes
        -----
        The group is always reported through ``on_group_done`` (unless :meth:`cancel_all`
        cancels it): if its sessions cannot even start (e.g. ``data`` cannot be deep-copied),
        every session is dropped as "agent_error".
        """

        def start():
            try:
                self._start_group(group_id, data, n, seed, defaults)
            except Exception as exc:  # noqa: BLE001 - reported as the group's failure
                self._fail_group(group_id, data, n, exc)

        self.loop.call_soon_threadsafe(start)

    def _start_group(
        self, group_id: int, data: dict, n: int, seed: int, defaults: SessionDefaults
    ) -> None:
        inputs = [copy.deepcopy(data) for _ in range(n)]
        sessions = _new_sessions(group_id, data, n)
        self.tasks[group_id] = [
            self.loop.create_task(self._run(s, d, _with_seed(defaults, seed, i)))
            for i, (s, d) in enumerate(zip(sessions, inputs))
        ]
        gatherer = self.loop.create_task(self._gather(group_id, sessions, self.tasks[group_id]))
        self._gatherers.add(gatherer)
        gatherer.add_done_callback(self._gatherers.discard)

    def _fail_group(self, group_id: int, data, n: int, exc: Exception) -> None:
        for task in self.tasks.pop(group_id, []):
            task.cancel()
        error = f"the sessions could not start: {type(exc).__name__}: {_first_line(exc)}"
        log.warning("agent group %d: %s", group_id, error)
        sessions = _new_sessions(group_id, data, n)
        for session in sessions:
            session.drop("agent_error", error)
        self.on_group_done(GroupSessions(group_id, sessions))

    async def _gather(self, group_id: int, sessions: list[Session], tasks) -> None:
        _, pending = await asyncio.wait(tasks, timeout=self.config.timeout + self.grace)
        if self.tasks.pop(group_id, None) is None:
            return  # cancelled by cancel_all: not reported
        reported = []
        for session, task in zip(sessions, tasks):
            if task in pending:  # ignored its cancellation after agent.timeout
                self._abandon(session, task)
                session = copy.deepcopy(session)  # what it does later changes nothing
            elif session.status == "running":  # _run itself failed
                exc = None if task.cancelled() else task.exception()
                why = (
                    "its task was cancelled"
                    if exc is None
                    else f"{type(exc).__name__}: {_first_line(exc)}"
                )
                self._drop(session, "agent_error", f"the session failed: {why}")
            reported.append(session)
        self.on_group_done(GroupSessions(group_id, reported))

    def _abandon(self, session: Session, task: asyncio.Task) -> None:
        self._drop(
            session,
            "timeout",
            f"did not finish within agent.timeout = "
            f"{self.config.timeout:g} s and ignored cancellation "
            f"for {self.grace:g} s more",
        )
        task.cancel()
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        token = self._tokens.pop(session.session_id, None)
        if token is not None:
            self.server.close_session(token)  # cancels its requests; later ones get 401

    async def _run(self, session: Session, data: dict, defaults: SessionDefaults) -> None:
        try:
            client, token = self._client(session, defaults)
        except Exception as exc:  # noqa: BLE001 - e.g. openai is not installed
            return self._drop(
                session,
                "agent_error",
                f"cannot create the session's client: {type(exc).__name__}: {_first_line(exc)}",
            )
        _CLIENT.set(client)
        if token is not None:
            self._tokens[session.session_id] = token
        started = time.monotonic()
        try:
            args = (data, client) if self.takes_client else (data,)
            reward = await asyncio.wait_for(self.agent(*args), self.config.timeout)
        except asyncio.TimeoutError:
            return self._drop(
                session,
                "timeout",
                f"did not finish within agent.timeout = {self.config.timeout:g} s",
            )
        except asyncio.CancelledError:
            return self._drop(session, "cancelled", "cancelled by the controller", quiet=True)
        except Exception as exc:  # noqa: BLE001 - a failing agent only drops its session
            return self._drop(session, "agent_error", f"{type(exc).__name__}: {_first_line(exc)}")
        finally:
            if token is not None:
                if self._tokens.pop(session.session_id, None) is not None:
                    self.server.close_session(token)
                await client.close()
        if session.status != "running":
            return  # reported as dropped already (it ignored its cancellation)
        took = time.monotonic() - started
        if took > self.config.timeout:  # only possible if the agent blocked the event loop
            return self._drop(
                session,
                "timeout",
                f"took {took:.1f} s, more than agent.timeout "
                f"= {self.config.timeout:g} s, while blocking "
                f"the event loop (run blocking work with "
                f"await asyncio.to_thread(...))",
            )
        try:
            session.finish(reward)
        except ValueError as exc:
            self._drop(session, "bad_reward" if session.calls else "no_calls", str(exc))

    def _client(self, session: Session, defaults: SessionDefaults):
        if self.config.mode == "inprocess":
            return AgentClient(session, self.backend, defaults), None
        import openai

        token = self.server.open_session(session, defaults)
        return openai.AsyncOpenAI(
            base_url=self.server.url, api_key=token, max_retries=0, timeout=self.config.timeout
        ), token

    @staticmethod
    def _drop(session: Session, reason: str, error: str, quiet: bool = False) -> None:
        """Drop a running session (one that has ended already keeps its outcome)."""
        if session.status != "running":
            return
        session.drop(reason, error)
        if not quiet:
            log.warning(
                "agent session %s (group %d) dropped (%s): %s",
                session.session_id[:8],
                session.group_id,
                reason,
                error,
            )

    def cancel_all(self, timeout: float = 30.0) -> int:
        """Cancel every running session; their groups are not reported.

        Parameters
        ----------
        timeout : float
            Seconds to wait for the sessions to stop. Sessions that ignore their
            cancellation for most of it are left running (logged); they report nothing.

        Returns
        -------
        int
            How many groups were cancelled.

        Raises
        ------
        RuntimeError
            The event loop did not get to the cancellation within ``timeout`` (an agent
            blocks it).
        """

        async def cancel():
            groups = list(self.tasks.values())
            self.tasks.clear()
            for task in self._abandoned:  # had their chance: not waited for again
                task.cancel()
            tasks = [t for ts in groups for t in ts]
            for task in tasks:
                task.cancel()
            if tasks:  # leaves time to answer before the caller's deadline
                _, pending = await asyncio.wait(tasks, timeout=0.8 * timeout)
                if pending:
                    log.warning(
                        "%d agent sessions ignored cancellation for %g s; they are "
                        "left running and report nothing",
                        len(pending),
                        0.8 * timeout,
                    )
                    for task in pending:
                        self._abandoned.add(task)
                        task.add_done_callback(self._abandoned.discard)
            return len(groups)

        return self._on_loop(cancel(), timeout)

    def _on_loop(self, coro, timeout: float):
        """Run ``coro`` on the loop; a one-line RuntimeError if it has not ended in
        ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            result = future.result(timeout)
        except concurrent.futures.TimeoutError:  # (it still runs if the loop frees up)
            self._stuck = True
            raise RuntimeError(
                f"agent sessions did not stop within {timeout:g} s of being "
                f"cancelled: an agent blocks the event loop or ignores "
                f"cancellation (run blocking work with "
                f"'await asyncio.to_thread(...)')"
            ) from None
        self._stuck = False
        return result

    def close(self, timeout: float = 30.0) -> None:
        """Cancel sessions, stop the endpoint and the loop thread.

        Raises
        ------
        RuntimeError
            As :meth:`cancel_all` (the loop thread is then left behind, a daemon).
        """
        if not self.thread.is_alive():
            return
        if self._stuck:  # already reported by the call that timed out
            self.loop.call_soon_threadsafe(self.loop.stop)
            return
        stopped = False
        try:
            self.cancel_all(timeout)
            if self.server is not None:
                self._on_loop(self.server.close(), timeout)
            stopped = True
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if stopped:
                self.thread.join(timeout)


def _new_sessions(group_id: int, data, n: int) -> list[Session]:
    """``n`` fresh sessions of a group, each holding its own JSON-safe copy of ``data``."""
    stored = _json_record(data)
    return [Session(data=json.loads(stored), group_id=group_id) for _ in range(n)]


def _with_seed(defaults: SessionDefaults, seed: int, index: int) -> SessionDefaults:
    return replace(defaults, seed=sample_seed(seed, index))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _json_record(data) -> str:
    """``data`` as JSON text for the session record: values JSON cannot hold become their
    ``str``; data that cannot be written at all (a cycle, non-string keys) is replaced by a
    note saying why (the agent still gets the data itself)."""
    try:
        return json.dumps(data, default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        return json.dumps({"unserialisable": f"{type(exc).__name__}: {_first_line(exc)}"})
