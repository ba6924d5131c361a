"""The subset of OpenAI's Chat Completions API that agent sessions serve.

:func:`parse_chat_request` validates a request body (the JSON object of ``POST
/v1/chat/completions``, or the keyword arguments of ``client.chat.completions.create``) into a
:class:`ChatRequest`; :func:`chat_completion` builds the response object and
:func:`chat_completion_chunks` the same response as ``chat.completion.chunk`` objects for
``stream: true``. Field names and meanings follow the OpenAI API reference (``messages``,
``tools``, ``tool_choice``, ``parallel_tool_calls``, ``n``, ``temperature``, ``top_p``,
``max_tokens`` / ``max_completion_tokens``, ``logprobs``, ``seed``, ``stream``,
``stream_options``; response ``choices[i].message.tool_calls``, ``finish_reason``,
``logprobs.content``, ``usage``).

Not served, refused with a :class:`BadRequest` naming the key (silently ignoring them would
change what the agent gets): ``stop``, ``top_logprobs`` > 0, ``tool_choice`` "required" or a
named function, ``parallel_tool_calls`` false, ``response_format`` other than text,
``logit_bias``, ``presence_penalty`` / ``frequency_penalty`` other than 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from areal_fast.agent.chat_format import normalize_message

MAX_CHOICES = 64
# request metadata both OpenAI routes accept and the endpoint does not use
IGNORED_METADATA = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)
_IGNORED = IGNORED_METADATA | {"extra_body"}
_REFUSED = {
    "stop": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "functions": None,
    "function_call": None,
    "audio": None,
    "prediction": None,
    "modalities": None,
}


class BadRequest(ValueError):
    """A request the endpoint cannot serve; its message names the offending key.

    The message is cut to :data:`MESSAGE_LIMIT` characters: it may quote a value from the
    request, which can be megabytes long, and it goes back to the client and into logs.
    """

    def __init__(self, message: str):
        if len(message) > MESSAGE_LIMIT:
            message = message[: MESSAGE_LIMIT - 40] + f" … ({len(message)} characters in all)"
        super().__init__(message)


MESSAGE_LIMIT = 500  # characters of a BadRequest message at most


@dataclass
class ChatRequest:
    """A validated chat-completion request.

    Attributes
    ----------
    messages : list[dict]
        Normalised by :func:`~areal_fast.agent.chat_format.normalize_message`.
    tools : list[dict] or None
        OpenAI function tools ``{"type": "function", "function": {"name", ...}}``.
    tool_choice : str
        "auto" or "none" ("none" keeps the tools in the prompt but parses no calls).
    n : int
        Choices, 1..64.
    temperature : float or None
        None: the session default.
    top_p : float or None
    max_tokens : int or None
        New-token budget per choice; None: the session default.
    logprobs : bool
        Return the chosen tokens' log-probs.
    seed : int or None
        Sampling seed; None: derived from the session and the call number.
    model : str
        Echoed back.
    stream : bool
        Answer as server-sent events (the whole response once sampled, in chunks).
    include_usage : bool
        ``stream_options.include_usage``: a last chunk with ``usage`` and no choices.
    """

    messages: list[dict]
    tools: Optional[list[dict]] = None
    tool_choice: str = "auto"
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[int] = None
    logprobs: bool = False
    seed: Optional[int] = None
    model: str = ""
    stream: bool = False
    include_usage: bool = False


# every top-level key a request may carry (served, ignored or refused with a message)
REQUEST_KEYS = (
    frozenset(ChatRequest.__dataclass_fields__)
    | _IGNORED
    | set(_REFUSED)
    | {"max_completion_tokens", "top_logprobs", "response_format", "stream_options"}
    | {"parallel_tool_calls"}
)


def _number(body: dict, key: str, low: float, high: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{key} = {value!r} must be {kind} in [{low:g}, {high:g}]")
    return value


def _tools(body: dict) -> Optional[list[dict]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise BadRequest(
                f'tools[{i}] must be {{"type": "function", "function": '
                f'{{"name": ..., "parameters": ...}}}}'
            )
    return tools or None


def _refuse_unsupported(body: dict) -> None:
    for key, neutral in _REFUSED.items():
        if key in body and body[key] not in (neutral, None):
            raise BadRequest(f"{key} = {body[key]!r} is not supported by this endpoint")
    if body.get("top_logprobs"):
        raise BadRequest(
            "top_logprobs > 0 is not supported (only the chosen tokens' log-probs are returned)"
        )
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise BadRequest(f"response_format = {fmt!r} is not supported")
    check_tool_options(body)
    unknown = sorted(set(body) - REQUEST_KEYS)
    if unknown:
        raise BadRequest(f"unknown request key {unknown[0]!r}")


def check_tool_options(body: dict) -> None:
    """Refuse the tool options the endpoint cannot honour (shared with the Responses API).

    Raises
    ------
    BadRequest
        ``tool_choice`` other than "auto" / "none" (sampling is not constrained to a tool),
        or ``parallel_tool_calls`` false (a reply may hold several calls, and cutting some
        off would leave tokens the agent never saw in the trained sequence).
    """
    choice = "auto" if body.get("tool_choice") is None else body["tool_choice"]
    if choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice = {choice!r} is not supported (use 'auto' or 'none')")
    if body.get("parallel_tool_calls") not in (None, True):
        raise BadRequest(
            f"parallel_tool_calls = {body['parallel_tool_calls']!r} is not supported "
            "(a reply may hold several tool calls; omit it or pass true)"
        )


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request."""
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {stream!r} must be true or false")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise BadRequest(f"stream_options = {options!r} must be {{'include_usage': bool}}")
    usage = bool(options.get("include_usage"))
    if not stream:
        raise BadRequest("stream_options is only allowed with stream = true")
    return stream, usage


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a chat-completion request body.

    Parameters
    ----------
    body : dict
        The decoded JSON object (or ``create``'s keyword arguments).

    Returns
    -------
    ChatRequest

    Raises
    ------
    BadRequest
        One line naming the offending key: not an object, missing or empty ``messages``, a
        malformed message or tool, a number out of range, or an unsupported option.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    try:
        normalized = [normalize_message(m, i) for i, m in enumerate(messages)]
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest(f"{key} = {max_tokens!r} must be a positive integer")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed = {seed!r} must be an integer")
    logprobs = False if body.get("logprobs") is None else body["logprobs"]  # null: not given
    if not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs = {logprobs!r} must be true or false")
    stream, include_usage = _stream_options(body)
    return ChatRequest(
        messages=normalized,
        tools=_tools(body),
        tool_choice=body.get("tool_choice") or "auto",
        n=_number(body, "n", 1, MAX_CHOICES, integer=True) or 1,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-9, 1.0),
        max_tokens=max_tokens,
        logprobs=logprobs,
        seed=seed,
        model=str(body.get("model") or ""),
        stream=stream,
        include_usage=include_usage,
    )


def chat_completion(
    response_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int
) -> dict:
    """A ``chat.completion`` response object (a JSON-serialisable dict).

    Parameters
    ----------
    response_id : str
    model : str
    choices : list[dict]
        Built by :func:`choice`.
    prompt_tokens, completion_tokens : int
        Token counts for ``usage`` (completion tokens over all choices).
    """
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }


def chat_completion_chunks(response: dict, include_usage: bool) -> list[dict]:
    """A ``chat.completion`` as the ``chat.completion.chunk`` objects of ``stream: true``.

    Per choice one chunk with the whole message (role, content, ``tool_calls`` with their
    ``index``, log-probs) and one with its ``finish_reason``; then, with ``include_usage``,
    one with no choices and the ``usage``. Every chunk carries ``usage: null`` otherwise, as
    the OpenAI API sends them.

    Parameters
    ----------
    response : dict
        Built by :func:`chat_completion`.
    include_usage : bool
        ``stream_options.include_usage``.

    Returns
    -------
    list[dict]
        The chunks in order (each sent as one ``data:`` event, then ``data: [DONE]``).
    """
    head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"
    chunks = []
    for c in response["choices"]:
        message = c["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {"index": j, **call} for j, call in enumerate(message["tool_calls"])
            ]
        first = {"index": c["index"], "delta": delta, "finish_reason": None}
        first["logprobs"] = c["logprobs"]
        last = {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}
        chunks += [{**head, "choices": [first], "usage": None}]
        chunks += [{**head, "choices": [{**last, "logprobs": None}], "usage": None}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def choice(
    index: int,
    content: str,
    tool_calls: list[dict],
    finish_reason: str,
    token_logprobs: Optional[list[tuple[str, float]]],
) -> dict:
    """One entry of ``choices``; ``token_logprobs`` is (token text, log-prob) per token or
    None when log-probs were not requested."""
    message = {"role": "assistant", "content": content or None if tool_calls else content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    logprobs = None
    if token_logprobs is not None:
        logprobs = {
            "content": [
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [],
                }
                for text, lp in token_logprobs
            ]
        }
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }
