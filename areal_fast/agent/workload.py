"""The agent side of a rollout worker: groups of sessions in, trajectories and records out.

A rollout worker whose spec names an agent hands each training
:class:`~areal_fast.wire.messages.GroupRequest` to :meth:`AgentWorkload.submit`, which
starts ``n`` sessions of the request's ``data`` on the :class:`AgentRunner`. The sessions'
model calls go to the worker's engine through an :class:`EngineBridge`; the worker routes the
engine's outputs back with :meth:`AgentWorkload.route`. When every session of a group has
ended, the worker calls :meth:`AgentWorkload.finish`: the sessions are written to the
trajectory store (dropped ones too, for analysis) and the finished ones are exported as
trajectories for the trainer (with ``agent.dropped_reward`` set, dropped sessions that called
the model are exported too, with that reward).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from areal_fast.agent.bridge import EngineBridge
from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.client import ChatBackend, SessionDefaults
from areal_fast.agent.runner import AgentConfig, AgentRunner, GroupSessions, load_agent
from areal_fast.agent.session import DROP_REASONS
from areal_fast.agent.store import TrajectoryConfig, TrajectoryStats, TrajectoryWriter
from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import GenOutput, GenRequest

# the running totals of :meth:`AgentWorkload.finish`, all in every report (docs/agents.md)
TOTALS_KEYS = (
    "agent/sessions",
    "agent/sessions_dropped",
    *(f"agent/dropped_{reason}" for reason in DROP_REASONS),
    "agent/dropped_trained",
    "agent/model_calls",
    "agent/tool_calls",
    "agent/unlinked_calls",
    "agent/finish_seconds",
)


@dataclass
class AgentWorkloadSpec:
    """What a rollout worker needs to run agents (picklable).

    Attributes
    ----------
    agent : AgentConfig
    tokenizer_path : str
        Tokenizer (and chat template) of the served model.
    trajectory : TrajectoryConfig
        ``trajectory.*``; with ``enabled`` the sessions are written under ``directory``.
    """

    agent: AgentConfig
    tokenizer_path: str
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)


class AgentWorkload:
    """Runs a worker's agent sessions and turns finished groups into trajectories.

    Parameters
    ----------
    spec : AgentWorkloadSpec
    engine : AsyncInferenceEngine
        The worker's engine (its outputs for this workload's requests come back through
        :meth:`route`).
    rids : iterator of int
        The worker's request-id counter (shared, so ids stay unique in the engine).
    name : str
        Worker name (the trajectory files' prefix).
    on_group_done : callable (GroupSessions) -> None
        Called from the runner's thread; the worker queues the group for :meth:`finish`.

    Raises
    ------
    ValueError
        ``agent.path`` cannot be loaded (see :func:`load_agent`), or the tokenizer has no
        chat template.
    """

    def __init__(
        self,
        spec: AgentWorkloadSpec,
        engine,
        rids,
        name: str,
        on_group_done: Callable[[GroupSessions], None],
    ):
        from areal_fast.models.loading import load_tokenizer

        self.spec = spec
        agent = load_agent(spec.agent.path, spec.agent.kwargs)
        chat_format = ChatFormat(load_tokenizer(spec.tokenizer_path))
        self.bridge: Optional[EngineBridge] = None

        def backend(loop):
            self.bridge = EngineBridge(engine, loop, rids)
            return ChatBackend(chat_format, self.bridge.generate), self.bridge

        self.runner = AgentRunner(agent, backend, spec.agent, on_group_done)
        self.writer = None
        if spec.trajectory.enabled:
            self.writer = TrajectoryWriter(
                Path(spec.trajectory.directory), spec.trajectory, name=name
            )
        # every key present from the first record on, 0 until something happens
        self.totals: Counter = Counter({key: 0 for key in TOTALS_KEYS})

    def start(self) -> None:
        """Start the runner's loop (and the endpoint in "http" mode)."""
        self.runner.start()

    def submit(self, request) -> None:
        """Start the ``request.params.n`` sessions of a training GroupRequest.

        Parameters
        ----------
        request : GroupRequest
            Its sampling parameters are the sessions' defaults; a call may ask for up to
            ``agent.max_tokens_cap`` new tokens (``rollout.max_new_tokens`` when unset).
        """
        p, cfg = request.params, self.spec.agent
        defaults = SessionDefaults(
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_new_tokens,
            max_tokens_cap=cfg.tokens_cap(p.max_new_tokens),
            max_prompt_tokens=cfg.max_prompt_tokens,
        )
        data = dict(request.data) or {"answer": request.answer, "uid": request.uid}
        self.runner.submit_group(request.group_id, data, p.n, request.seed, defaults)

    def route(self, out: GenOutput) -> Optional[GenRequest]:
        """Hand an engine output that no plain sample claimed to the sessions; returns a
        resubmission (aborted by a weight update, budget left) or None."""
        return self.bridge.on_output(out)

    def finish(self, group: GroupSessions) -> tuple[list[Trajectory], dict]:
        """Store the group's sessions and export the finished ones.

        Parameters
        ----------
        group : GroupSessions

        Returns
        -------
        trajectories : list[Trajectory]
            Possibly empty (every session dropped). With ``agent.dropped_reward`` set, a
            dropped session that made a model call (and was not cancelled) is exported too,
            with that reward; its stored record keeps its drop reason and no reward.
        stats : dict[str, float]
            Running totals of this worker: ``agent/sessions``, ``agent/sessions_dropped``,
            ``agent/dropped_<reason>``, ``agent/dropped_trained`` (dropped sessions trained
            with ``agent.dropped_reward``), ``agent/model_calls``, ``agent/tool_calls``,
            ``agent/unlinked_calls`` (calls of a session's later requests that do not
            continue an earlier call token-exactly, so they start a fresh prompt),
            ``agent/resumed_calls`` (model calls resumed after a weight update interrupted
            them), ``agent/finish_seconds`` (time the worker's loop spent here: export and
            handing records to the store), and the trajectory store's counters.

        Raises
        ------
        TrajectoryStoreError
            The store's writer failed (the run must stop rather than lose sessions).
        """
        cfg = self.spec.agent
        start = time.perf_counter()
        trajectories = []
        for session in group.sessions:
            if self.writer is not None:  # first: the record keeps how the session ended
                self.writer.put(session.to_dict())
            self.totals["agent/sessions"] += 1
            self.totals["agent/model_calls"] += len(session.calls)
            self.totals["agent/tool_calls"] += sum(len(c.tool_calls) for c in session.calls)
            self.totals["agent/unlinked_calls"] += _unlinked_calls(session)
            if session.status == "done":
                trajectories += session.export(cfg.export, cfg.turn_discount)
                continue
            self.totals["agent/sessions_dropped"] += 1
            self.totals[f"agent/dropped_{session.drop_reason}"] += 1
            if (
                cfg.dropped_reward is not None
                and session.calls
                and session.drop_reason != "cancelled"
            ):
                scored = replace(session, reward=float(cfg.dropped_reward), status="done")
                trajectories += scored.export(cfg.export, cfg.turn_discount)
                self.totals["agent/dropped_trained"] += 1
        self.totals["agent/finish_seconds"] += time.perf_counter() - start
        stats = {k: float(v) for k, v in self.totals.items()}
        stats["agent/resumed_calls"] = float(self.bridge.resumed if self.bridge else 0)
        # without a store its counters stay 0, so every record has the same keys
        stats.update((self.writer.stats if self.writer else TrajectoryStats()).as_dict())
        return trajectories, stats

    def cancel_all(self) -> int:
        """Cancel every running session; returns how many groups were cancelled.

        Raises
        ------
        RuntimeError
            The sessions did not stop (see :meth:`AgentRunner.cancel_all`).
        """
        return self.runner.cancel_all()

    def flush(self, timeout: float = 300.0) -> None:
        """Wait until every session handed to the store is written (no-op without a store).

        Parameters
        ----------
        timeout : float
            Seconds to wait at most.

        Raises
        ------
        TrajectoryStoreError
            The store's writer failed, or ``timeout`` expired.
        """
        if self.writer is not None:
            self.writer.flush(timeout)

    def close(self) -> None:
        """Stop the sessions, then flush and close the store (both are attempted).

        Raises
        ------
        RuntimeError
            The sessions did not stop (see :meth:`AgentRunner.close`).
        TrajectoryStoreError
            The store's writer failed. The first of the two errors is raised.
        """
        first = None
        try:
            self.runner.close()
        except Exception as exc:  # noqa: BLE001 - the store is closed all the same
            first = exc
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as exc:  # noqa: BLE001 - raised below unless one came first
                first = first or exc
        if first is not None:
            raise first


def _unlinked_calls(session) -> int:
    """Calls of requests after the session's first whose prompt was built fresh (``parent``
    None): a continuation the chat format could not extend token-exactly, or a new
    conversation."""
    if not session.calls:
        return 0
    first = _request_of(session.calls[0].call_id)
    return sum(c.parent is None and _request_of(c.call_id) != first for c in session.calls)


def _request_of(call_id: str) -> str:
    """The response id of a call (its id is ``"<response id>:<choice>"``)."""
    return call_id.rsplit(":", 1)[0]
