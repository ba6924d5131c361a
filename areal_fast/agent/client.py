"""Chat completions recorded into sessions: the shared core and the in-process client.

:class:`ChatBackend` serves one chat-completion request of a :class:`Session`: it finds the
earlier call the request continues (its messages, then that call's reply, then new ones), builds
the prompt token ids (continuing that call's exact ids, or fresh), asks the engine for ``n``
samples through an async ``generate`` function, records each as a :class:`ModelCall` and returns
the OpenAI response object. The HTTP endpoint (:mod:`areal_fast.agent.server`) and
:class:`AgentClient` both call it.

:class:`AgentClient` has the call shape of ``openai.AsyncOpenAI``
(``await client.chat.completions.create(model=..., messages=..., tools=..., n=...)``) and
returns ``openai`` response objects, so an agent runs unchanged against it or against the
endpoint.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Awaitable, Callable, Optional

from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.protocol import (
    BadRequest,
    ChatRequest,
    chat_completion,
    choice,
    parse_chat_request,
)
from areal_fast.agent.session import ModelCall, Session
from areal_fast.rollout.engine import sample_seed


@dataclass
class GenResult:
    """What the engine produced for one sample.

    Attributes
    ----------
    output_ids : list[int]
    logprobs : list[float]
        Behaviour log-prob of each output token (fp32 nats).
    versions : list[int]
        Policy version of each output token.
    stop_reason : str
        "stop" or "length".
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str


# generate(input_ids, max_new_tokens, temperature, top_p, seed) -> GenResult
GenerateFn = Callable[[list[int], int, float, float, int], Awaitable[GenResult]]


@dataclass
class SessionDefaults:
    """Sampling settings a request does not give, and the limits every request must meet.

    Attributes
    ----------
    temperature : float
    top_p : float
    max_tokens : int
        New tokens per call when the request gives none.
    max_tokens_cap : int
        Largest ``max_tokens`` a request may ask for.
    max_prompt_tokens : int
        Longest prompt (in tokens) a call may have; longer ones are refused.
    seed : int
        Session seed; call k's choice i samples with
        ``sample_seed(sample_seed(seed, k), i)`` unless the request gives ``seed``.
    model : str
        Model name echoed in responses.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    max_tokens_cap: int = 4096
    max_prompt_tokens: int = 8192
    seed: int = 0
    model: str = "areal-fast"


class ChatBackend:
    """Serves chat requests of sessions by sampling from an engine (see module docstring).

    Parameters
    ----------
    chat_format : ChatFormat
    generate : GenerateFn
        Async function sampling one completion of given token ids.
    """

    def __init__(self, chat_format: ChatFormat, generate: GenerateFn):
        self.chat_format, self.generate = chat_format, generate

    def _continued(
        self, session: Session, request: ChatRequest
    ) -> tuple[Optional[ModelCall], Optional[list[int]]]:
        """The call this request continues and the environment tokens after it.

        That is the call of the latest request whose messages start ``request.messages``,
        followed by its reply and at least one new message, with the same tools (the lowest
        choice index among equal replies). (None, None) when there is none or the template
        cannot extend it."""
        msgs = request.messages
        candidates = sorted(session.calls, key=lambda c: (-c.request, c.choice))
        for call in candidates:
            k = len(call.messages)
            if (
                k + 1 >= len(msgs)
                or call.tools != request.tools
                or msgs[:k] != call.messages
                or not call.is_reply(msgs[k])
            ):
                continue
            env = self.chat_format.continuation_ids(
                call.messages, msgs[k + 1 :], request.tools, call.output_ids
            )
            if env is not None:
                return call, env
        return None, None

    async def complete(
        self, session: Session, request: ChatRequest, defaults: SessionDefaults
    ) -> dict:
        """Sample ``request.n`` choices, record them in ``session``, return the response.

        Parameters
        ----------
        session : Session
            Must be running; the request is numbered before the engine is awaited.
        request : ChatRequest
        defaults : SessionDefaults

        Returns
        -------
        dict
            The ``chat.completion`` object.

        Raises
        ------
        BadRequest
            ``max_tokens`` above the cap, a prompt longer than ``max_prompt_tokens`` (one
            whose messages hold more characters than that many tokens can is refused before
            anything is rendered), or the session has ended (a late call of a dropped session
            is not recorded).

        Notes
        -----
        Rendering and tokenising run on a worker thread (``asyncio.to_thread``), so the event
        loop that serves every session of the worker is never blocked by a long prompt; the
        fast tokenizer releases the GIL while it encodes, and several threads may encode at
        once (plain ``encode`` without truncation or padding only reads its state).
        """
        max_tokens = request.max_tokens or defaults.max_tokens
        if max_tokens > defaults.max_tokens_cap:
            raise BadRequest(
                f"max_tokens (Responses: max_output_tokens) = {max_tokens} is above the cap of "
                f"{defaults.max_tokens_cap} (agent.max_tokens_cap, which defaults "
                f"to rollout.max_new_tokens)"
            )
        self._check_size(request, defaults)
        input_ids, parent = await asyncio.to_thread(self._prompt, session, request, defaults)
        number, session.next_call = session.next_call, session.next_call + 1
        base = sample_seed(defaults.seed, number)
        if request.seed is not None:  # mixed in, so the sessions of a group still differ
            base = sample_seed(base, request.seed)
        temperature = defaults.temperature if request.temperature is None else request.temperature
        top_p = defaults.top_p if request.top_p is None else request.top_p
        results = await asyncio.gather(
            *[
                self.generate(input_ids, max_tokens, temperature, top_p, sample_seed(base, i))
                for i in range(request.n)
            ]
        )
        _check_running(session)
        response_id = f"chatcmpl-{session.session_id[:8]}-{number}"
        choices = [
            self._record(session, request, response_id, number, i, input_ids, parent, res)
            for i, res in enumerate(results)
        ]
        return chat_completion(
            response_id,
            request.model or defaults.model,
            choices,
            len(input_ids),
            sum(len(r.output_ids) for r in results),
        )

    def _check_size(self, request: ChatRequest, defaults: SessionDefaults) -> None:
        """BadRequest if the messages hold more text than ``max_prompt_tokens`` tokens can."""
        chars = self.chat_format.text_chars(request.messages)
        per_token = self.chat_format.max_token_chars
        if chars > defaults.max_prompt_tokens * per_token:
            raise BadRequest(
                f"messages hold {chars} characters, more than agent.max_prompt_tokens = "
                f"{defaults.max_prompt_tokens} tokens of at most {per_token} characters can"
            )

    def _prompt(
        self, session: Session, request: ChatRequest, defaults: SessionDefaults
    ) -> tuple[list[int], Optional[ModelCall]]:
        """(prompt ids, the call it continues); runs on a worker thread."""
        _check_running(session)
        parent, env = self._continued(session, request)
        input_ids = (
            parent.full_ids + env
            if parent is not None
            else self.chat_format.prompt_ids(request.messages, request.tools)
        )
        if len(input_ids) > defaults.max_prompt_tokens:
            raise BadRequest(
                f"the prompt has {len(input_ids)} tokens, more than "
                f"agent.max_prompt_tokens = {defaults.max_prompt_tokens}"
            )
        return input_ids, parent

    def _record(
        self,
        session: Session,
        request: ChatRequest,
        response_id: str,
        number: int,
        index: int,
        input_ids: list[int],
        parent: Optional[ModelCall],
        res: GenResult,
    ) -> dict:
        """Append choice ``index`` to the session; returns its response entry."""
        content, calls = self.chat_format.parse_output(
            res.output_ids, parse_tools=bool(request.tools) and request.tool_choice != "none"
        )
        session.calls.append(
            ModelCall(
                f"{response_id}:{index}",
                list(input_ids),
                res.output_ids,
                res.logprobs,
                res.versions,
                res.stop_reason,
                request.messages,
                content,
                calls,
                parent.call_id if parent else None,
                tools=request.tools,
                request=number,
                choice=index,
            )
        )
        finish = "tool_calls" if calls and res.stop_reason == "stop" else res.stop_reason
        token_lps = (
            list(zip(self.chat_format.token_texts(res.output_ids), res.logprobs))
            if request.logprobs
            else None
        )
        return choice(index, content, calls, finish, token_lps)


def _check_running(session: Session) -> None:
    """BadRequest unless ``session`` is still running (a dropped one records nothing more)."""
    if session.status != "running":
        raise BadRequest(
            f"session {session.session_id[:8]} has ended ({session.drop_reason or session.status})"
        )


def _response_object(response: dict):
    """The response as openai's ``ChatCompletion`` (attribute access, ``model_dump``)."""
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_validate(response)


class AgentClient:
    """In-process chat client of one session, shaped like ``openai.AsyncOpenAI``.

    ``await client.chat.completions.create(messages=[...], tools=..., n=..., temperature=...,
    max_tokens=..., logprobs=...)`` returns a ``ChatCompletion``; every call is recorded in
    ``client.session``. Invalid arguments raise
    :class:`~areal_fast.agent.protocol.BadRequest` naming the key.

    Parameters
    ----------
    session : Session
    backend : ChatBackend
    defaults : SessionDefaults
    """

    def __init__(self, session: Session, backend: ChatBackend, defaults: SessionDefaults):
        self.session, self.backend, self.defaults = session, backend, defaults
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kwargs):
        body = {
            k: v
            for k, v in kwargs.items()
            if k not in ("extra_headers", "extra_query", "extra_body", "timeout")
        }
        body.update(kwargs.get("extra_body") or {})  # as openai merges it into the JSON body
        request = parse_chat_request(body)
        return _response_object(await self.backend.complete(self.session, request, self.defaults))

    def set_reward(self, completion_id: str, reward: float, index: int = 0) -> None:
        """Give choice ``index`` of a response its own (per-turn) reward.

        Parameters
        ----------
        completion_id : str
            The response's ``id``.
        reward : float
            Finite.
        index : int
            The choice.

        Raises
        ------
        KeyError
            No such response or choice in this session.
        ValueError
            ``reward`` is not a finite number.
        """
        self.session.set_reward(f"{completion_id}:{index}", reward)
