"""Sessions: every model call of one agent run, token-exact, and their export to training.

A :class:`Session` records each completion the engine produced for the agent as a
:class:`ModelCall`: the exact input and output token ids, the behaviour log-prob and policy
version of every output token, the stop reason, the tool calls parsed from the output, and the
chat messages the agent sent. When a call continues an earlier one (the agent sent back the
earlier reply plus new user/tool messages), its ``input_ids`` start with the earlier call's
input and output ids unchanged and only the new messages are tokenised; ``parent`` links the
two. The agent's final reward (and optional per-call rewards) is attached at the end.

Export (:meth:`Session.export`):

- ``"concat"``: one :class:`~areal_fast.rl.batch.Trajectory` per chain of calls (root to
  leaf): the root's input is the prompt; model-generated tokens are trained (``loss_mask``
  True) and the environment's tokens between turns are not.
- ``"per_turn"``: one trajectory per call (its input as the prompt, its output as the
  completion).

Rewards. Turn k of a session is its k-th chat request (numbered in the order the agent made
them). The episode's path holds the choices the agent went on with (a later request sent their
reply back) and every choice of the last request. The agent's final reward R goes to the last
request's choices; walking back, a call of turn k gets its own per-call reward plus γ times the
mean value of the path calls of turn k + 1 (γ = ``turn_discount``; with only R, the call K − 1 − k
turns before the last gets γ^(K−1−k) · R). Choices the agent never continued (with ``n`` > 1)
are not part of the episode: they are not exported unless the agent gave them their own reward.
A concatenated sequence gets the value of its first call (its return from there on).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Optional

from areal_fast.rl.batch import Trajectory

EXPORT_MODES = ("concat", "per_turn")
DROP_REASONS = ("agent_error", "timeout", "bad_reward", "no_calls", "cancelled")


@dataclass
class ModelCall:
    """One completion (one choice) the engine produced inside a session.

    Attributes
    ----------
    call_id : str
        ``"<response id>:<i>"`` for choice i of a response (the response id is
        ``chatcmpl-<session id[:8]>-<n>`` for the session's n-th request); unique in a session.
    input_ids : list[int]
        Prompt token ids exactly as the engine saw them.
    output_ids : list[int]
        Generated token ids (the stop token included when generation stopped on it).
    logprobs : list[float]
        Behaviour log-prob of each output token (fp32 nats at the request's temperature).
    versions : list[int]
        Policy version that generated each output token.
    stop_reason : str
        The engine's: "stop" or "length".
    messages : list[dict]
        The chat messages of the request (as the agent sent them, normalised).
    content : str
        Text the agent received (tool-call markup removed).
    tool_calls : list[dict]
        OpenAI-style tool calls parsed from the output (``{"id", "type", "function":
        {"name", "arguments"}}``); empty when none.
    parent : str, optional
        ``call_id`` of the call this one continues token-exactly; None for a fresh prompt.
    reward : float, optional
        Per-call reward set by the agent (see :meth:`Session.set_reward`).
    tools : list[dict], optional
        The request's tools (a continuation must offer the same ones).
    request : int
        Number of the chat request that produced it (0, 1, ... within the session).
    choice : int
        Its index among that request's choices.
    """

    call_id: str
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    messages: list[dict] = field(default_factory=list)
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    parent: Optional[str] = None
    reward: Optional[float] = None
    tools: Optional[list[dict]] = None
    request: int = 0
    choice: int = 0

    def __post_init__(self):
        if not (len(self.output_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"call {self.call_id}: output_ids ({len(self.output_ids)}), "
                f"logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have equal lengths"
            )

    @property
    def full_ids(self) -> list[int]:
        """Input followed by output token ids."""
        return self.input_ids + self.output_ids

    def is_reply(self, message: dict) -> bool:
        """Whether a normalised chat ``message`` is this call's reply as the agent got it
        (role assistant, same text up to surrounding whitespace, same tool calls)."""
        if (
            message.get("role") != "assistant"
            or (message.get("content") or "").strip() != self.content.strip()
        ):
            return False

        def key(calls):
            return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]

        return key(message.get("tool_calls") or []) == key(self.tool_calls)


@dataclass
class Session:
    """One agent run: its model calls, final reward and outcome.

    Attributes
    ----------
    session_id : str
    data : dict
        The agent's input (JSON-serialisable part), kept for analysis.
    group_id : int
        GRPO group (one per prompt; the n runs of a prompt share it).
    calls : list[ModelCall]
        In the order they were made.
    reward : float, optional
        What ``run_agent_return_reward`` returned (None until it has).
    status : str
        "running", "done" or "dropped".
    drop_reason : str
        One of :data:`DROP_REASONS` when dropped.
    error : str
        One line describing why the session was dropped.
    next_call : int
        Chat requests started so far (a request is numbered before it awaits the engine, so
        concurrent requests of one session never share ids or seeds).
    """

    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    data: dict = field(default_factory=dict)
    group_id: int = 0
    calls: list[ModelCall] = field(default_factory=list)
    reward: Optional[float] = None
    status: str = "running"
    drop_reason: str = ""
    error: str = ""
    next_call: int = 0

    def call(self, call_id: str) -> ModelCall:
        """The call named ``call_id``.

        Raises
        ------
        KeyError
            Naming ``call_id`` if the session has no such call.
        """
        for c in self.calls:
            if c.call_id == call_id:
                return c
        raise KeyError(f"session {self.session_id} has no call {call_id!r}")

    def set_reward(self, call_id: str, reward: float) -> None:
        """Attach a per-call (per-turn) reward.

        Parameters
        ----------
        call_id : str
        reward : float

        Raises
        ------
        KeyError
            No such call.
        ValueError
            ``reward`` is not a finite real number (bools are refused).
        """
        self.call(call_id).reward = _finite_reward(reward, f"reward of call {call_id!r}")

    def finish(self, reward) -> None:
        """Record the agent's final reward and mark the session done.

        Parameters
        ----------
        reward : float-like
            What ``run_agent_return_reward`` returned.

        Raises
        ------
        ValueError
            (Session unchanged.) Not a finite real number (bools are refused), or the session
            made no model call.
        """
        value = _finite_reward(reward, "run_agent_return_reward's return value")
        if not self.calls:
            raise ValueError("the agent returned a reward without calling the model")
        self.reward, self.status = value, "done"

    def drop(self, reason: str, error: str) -> None:
        """Mark the session dropped; it records no further calls.

        Parameters
        ----------
        reason : str
            One of :data:`DROP_REASONS`.
        error : str
            One line saying why.

        Raises
        ------
        ValueError
            Unknown ``reason``.
        """
        if reason not in DROP_REASONS:
            raise ValueError(f"drop reason {reason!r} is not one of {DROP_REASONS}")
        self.status, self.drop_reason, self.error = "dropped", reason, error

    # ---- rewards and export -----------------------------------------------------------
    def path(self) -> list[ModelCall]:
        """Calls on the episode's path: every choice the agent sent back in a later request,
        and every choice of the last request (see the module docstring)."""
        if not self.calls:
            return []
        last = max(c.request for c in self.calls)
        sent_back = set()
        for later in self.calls:
            for c in self.calls:
                if c.request < later.request and any(c.is_reply(m) for m in later.messages):
                    sent_back.add(c.call_id)
        return [c for c in self.calls if c.request == last or c.call_id in sent_back]

    def call_rewards(self, turn_discount: float = 1.0) -> dict[str, float]:
        """Value of each call that is on the path or has its own reward.

        Parameters
        ----------
        turn_discount : float
            γ in [0, 1].

        Returns
        -------
        dict[str, float]
            call_id → own reward (0 if unset) + R for the last request's choices, or + γ ·
            (mean value of the next request's path calls) for earlier ones.

        Raises
        ------
        ValueError
            The session has no final reward.
        """
        if self.reward is None:
            raise ValueError(f"session {self.session_id} has no final reward")
        on_path = {c.call_id for c in self.path()}
        requests = sorted({c.request for c in self.calls}, reverse=True)
        values: dict[str, float] = {}
        following = self.reward  # what the last request's calls receive
        for number in requests:
            calls = [c for c in self.calls if c.request == number]
            for c in calls:
                values[c.call_id] = (c.reward or 0.0) + following
            path_values = [values[c.call_id] for c in calls if c.call_id in on_path]
            following = turn_discount * (
                sum(path_values) / len(path_values) if path_values else 0.0
            )
        return {k: v for k, v in values.items() if k in on_path or self.call(k).reward is not None}

    def export(self, mode: str = "concat", turn_discount: float = 1.0) -> list[Trajectory]:
        """Trajectories for the trainer (see the module docstring).

        Parameters
        ----------
        mode : str
            "concat" (one sequence per chain of token-exact continuations, environment tokens
            masked out) or "per_turn" (one sequence per call).
        turn_discount : float
            γ in [0, 1].

        Returns
        -------
        list[Trajectory]
            ``group_id`` set to the session's, ``info`` holding the session and call ids.

        Raises
        ------
        ValueError
            Unknown mode, γ outside [0, 1], or the session has no final reward.
        """
        if mode not in EXPORT_MODES:
            raise ValueError(f"agent.export = {mode!r} is not one of {EXPORT_MODES}")
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"agent.turn_discount = {turn_discount} must be in [0, 1]")
        values = self.call_rewards(turn_discount)
        kept = [c for c in self.calls if c.call_id in values]
        if mode == "per_turn":
            return [self._trajectory([c], values[c.call_id]) for c in kept]
        return [self._trajectory(chain, values[chain[0].call_id]) for chain in self.chains(kept)]

    def chains(self, calls: Optional[list[ModelCall]] = None) -> list[list[ModelCall]]:
        """Chains of token-exact continuations among ``calls`` (default: all), first to last.

        A chain ends at a call that no call in ``calls`` continues; it starts at a call whose
        parent is not in ``calls`` (or that has none)."""
        calls = self.calls if calls is None else calls
        by_id = {c.call_id: c for c in calls}
        continued = {c.parent for c in calls if c.parent in by_id}
        chains = []
        for leaf in (c for c in calls if c.call_id not in continued):
            chain = [leaf]
            while chain[-1].parent in by_id:
                chain.append(by_id[chain[-1].parent])
            chains.append(chain[::-1])
        return chains

    def _trajectory(self, chain: list[ModelCall], reward: float) -> Trajectory:
        root = chain[0]
        ids, logprobs, versions, mask = [], [], [], []
        done = len(root.input_ids)
        for prev, c in zip([None] + chain[:-1], chain):
            assert prev is None or c.input_ids[:done] == prev.full_ids, "parent is not a prefix"
            env = c.input_ids[done:] if c is not root else []
            ids += env + c.output_ids
            logprobs += [0.0] * len(env) + c.logprobs
            versions += [-1] * len(env) + c.versions
            mask += [False] * len(env) + [True] * len(c.output_ids)
            done = len(c.input_ids) + len(c.output_ids)
        return Trajectory(
            list(root.input_ids),
            ids,
            logprobs,
            versions,
            chain[-1].stop_reason,
            self.group_id,
            reward,
            info={"session_id": self.session_id, "call_ids": [c.call_id for c in chain]},
            loss_mask=mask,
        )

    # ---- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable record (what the trajectory store writes).

        Shallow: the record shares the session's lists (token ids, log-probs, messages), so
        building it costs microseconds on the rollout loop; do not change a session after
        handing its record to the store.
        """
        record = dict(vars(self))
        record["calls"] = [dict(vars(c)) for c in self.calls]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "Session":
        """Inverse of :meth:`to_dict`."""
        fields_ = dict(record)
        fields_["calls"] = [ModelCall(**c) for c in record.get("calls", [])]
        return cls(**fields_)


def _finite_reward(value, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        and not hasattr(value, "__float__")
    ):
        raise ValueError(f"{what} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a number, got {value!r}") from exc
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    return number
