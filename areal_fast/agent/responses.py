"""The subset of OpenAI's Responses API that agent sessions serve, on top of chat completions.

``POST /v1/responses`` is what the OpenAI Agents SDK calls by default
(``OpenAIResponsesModel``). :func:`parse_responses_request` turns a request into the
equivalent :class:`~areal_fast.agent.protocol.ChatRequest`, so it is sampled and recorded
(token-exactly, continuing earlier calls) exactly as a chat completion would be;
:func:`response_object` turns the chat completion back into a ``response`` object and
:func:`response_events` into the server-sent events of ``stream: true``.

Mapping (field names as in the OpenAI API reference):

- ``instructions`` → a leading system message; ``input`` (a string, or a list of items) →
  messages: ``message`` items (roles user / system / developer / assistant; text content or
  ``input_text`` / ``output_text`` parts) keep their role; an assistant message and the
  ``function_call`` items after it become one assistant message with ``tool_calls`` (id =
  ``call_id``); a ``function_call_output`` item becomes a tool message.
- ``tools``: function tools ``{"type": "function", "name", "description", "parameters"}``.
- ``max_output_tokens``, ``temperature``, ``top_p``, ``tool_choice`` ("auto" / "none"),
  ``parallel_tool_calls`` (true), ``stream``.
- The output: a ``message`` item with one ``output_text`` part (when the reply has text),
  then one ``function_call`` item per tool call; ``usage`` with input / output / total
  tokens; ``status`` "incomplete" (``incomplete_details.reason`` "max_output_tokens") when
  the reply was cut off by the token budget, as the OpenAI API reports it.

Refused with a :class:`~areal_fast.agent.protocol.BadRequest` naming the field: stored
state (``previous_response_id``, ``conversation``, ``store`` true is accepted but nothing is
stored), ``background``, ``prompt``, ``reasoning``, structured ``text.format``, ``include``
entries, ``top_logprobs``, ``max_tool_calls``, ``truncation`` "auto", built-in tools and
input items other than the three above.
"""

from __future__ import annotations

from typing import Any

from areal_fast.agent.chat_format import normalize_message
from areal_fast.agent.protocol import (
    IGNORED_METADATA,
    BadRequest,
    ChatRequest,
    check_tool_options,
    parse_chat_request,
)

_IGNORED = IGNORED_METADATA | {"stream_options"}
_REFUSED = {  # key -> the values that mean "not used"
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "prompt": (None,),
    "reasoning": (None, {}),
    "include": (None, []),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "text": (None, {}, {"format": {"type": "text"}}),
}
RESPONSES_KEYS = frozenset(
    {"input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "stream"}
    | {"max_output_tokens", "temperature", "top_p"}
    | _IGNORED
    | set(_REFUSED)
)


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            raise BadRequest(
                f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": ...}} '
                "(built-in tools are not served)"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out or None


def _text(content: Any, where: str, field: str = "content") -> str:
    """The text of an item's ``field`` (a string or text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.{field} must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(part.get("text"), str)
        ):
            raise BadRequest(
                f'{where}.{field}[{j}] must be a text part {{"type": "input_text", "text": ...}}'
            )
        parts.append(part["text"])
    return "".join(parts)


def _function_call(item: dict, where: str) -> dict:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
        raise BadRequest(f"{where} must have string name, call_id and arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def input_messages(body: dict) -> list[dict]:
    """Chat messages of a request's ``instructions`` and ``input`` (see the module docstring).

    Parameters
    ----------
    body : dict
        The request object.

    Returns
    -------
    list[dict]
        Normalised chat messages, not empty.

    Raises
    ------
    BadRequest
        Naming ``input[i]`` (or ``instructions``) and what is wrong with it.
    """
    instructions, items = body.get("instructions"), body.get("input")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message = {"role": item.get("role"), "content": _text(item.get("content"), where)}
            try:
                messages.append(normalize_message(message, i))
            except ValueError as exc:
                raise BadRequest(str(exc).replace(f"messages[{i}]", where, 1)) from None
        elif kind == "function_call":
            last = messages[-1] if messages else {}
            if last.get("role") != "assistant":
                messages.append(last := {"role": "assistant", "content": ""})
            last.setdefault("tool_calls", []).append(_function_call(item, where))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}.call_id must be a string")
            text = output if isinstance(output, str) else _text(output, where, "output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise BadRequest(
                f"{where}.type = {kind!r} is not served (use message, function_call or "
                "function_call_output items)"
            )
    return messages


def parse_responses_request(body: Any) -> ChatRequest:
    """Validate a ``POST /v1/responses`` body into the equivalent chat request.

    Parameters
    ----------
    body : dict
        The decoded JSON object.

    Returns
    -------
    ChatRequest
        One choice; ``tools`` in chat form; ``stream`` as requested.

    Raises
    ------
    BadRequest
        One line naming the offending field (see the module docstring for what is refused).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key, neutral in _REFUSED.items():
        if key in body and body[key] not in neutral:
            raise BadRequest(f"{key} = {body[key]!r} is not supported by this endpoint")
    unknown = sorted(set(body) - RESPONSES_KEYS)
    if unknown:
        raise BadRequest(f"unknown request key {unknown[0]!r}")
    check_tool_options(body)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest(f"max_output_tokens = {max_tokens!r} must be a positive integer")
    chat = {
        "messages": input_messages(body),
        "tool_choice": body.get("tool_choice"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_tokens": max_tokens,
        "model": body.get("model"),
    }
    request = parse_chat_request({k: v for k, v in chat.items() if v is not None})
    request.tools = _tools(body.get("tools"))
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {stream!r} must be true or false")
    request.stream = stream
    return request


def response_object(completion: dict, request: ChatRequest, body: dict) -> dict:
    """The ``response`` object of a chat completion of a Responses request.

    Parameters
    ----------
    completion : dict
        The ``chat.completion`` (one choice) the backend returned.
    request : ChatRequest
        From :func:`parse_responses_request`.
    body : dict
        The request object (echoed fields: ``instructions``, ``tools``, ``metadata``, ...).

    Returns
    -------
    dict
        ``id`` is ``resp_`` + the completion id's suffix; output items as in the module
        docstring.
    """
    [c] = completion["choices"]
    suffix = completion["id"].removeprefix("chatcmpl-")
    output = []
    if c["message"]["content"]:
        text = {"type": "output_text", "text": c["message"]["content"], "annotations": []}
        message = {"type": "message", "id": f"msg_{suffix}", "role": "assistant"}
        output.append({**message, "status": "completed", "content": [text]})
    for j, call in enumerate(c["message"].get("tool_calls") or []):
        fn = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{suffix}-{j}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    usage = completion["usage"]
    cut = c["finish_reason"] == "length"
    return {
        "id": f"resp_{suffix}",
        "object": "response",
        "created_at": float(completion["created"]),
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "model": completion["model"],
        "output": output,
        "parallel_tool_calls": True,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": request.tool_choice,
        "tools": body.get("tools") or [],
        "max_output_tokens": request.max_tokens,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "user": body.get("user"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def response_events(response: dict) -> list[dict]:
    """The server-sent events of a streamed response, in order.

    ``response.created`` and ``response.in_progress`` (no output yet), per output item
    ``response.output_item.added``, its text (``response.content_part.added``,
    ``response.output_text.delta`` with the whole text, ``response.output_text.done``,
    ``response.content_part.done``) or arguments (``response.function_call_arguments.delta``
    / ``.done``), ``response.output_item.done``; then ``response.completed`` (or
    ``response.incomplete``) with the whole response. Each event has its ``type`` and a
    ``sequence_number`` counting from 0.

    Parameters
    ----------
    response : dict
        Built by :func:`response_object`.

    Returns
    -------
    list[dict]
    """
    start = {**response, "status": "in_progress", "output": [], "usage": None}
    start["incomplete_details"] = None
    events = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for i, item in enumerate(response["output"]):
        at = {"output_index": i, "item_id": item["id"]}
        events.append(
            {"type": "response.output_item.added", "output_index": i, "item": _opening(item)}
        )
        if item["type"] == "message":
            part = item["content"][0]
            empty = {**part, "text": ""}
            loc = {**at, "content_index": 0}
            events += [
                {"type": "response.content_part.added", **loc, "part": empty},
                {"type": "response.output_text.delta", **loc, "delta": part["text"]},
                {"type": "response.output_text.done", **loc, "text": part["text"]},
                {"type": "response.content_part.done", **loc, "part": part},
            ]
            events[-3]["logprobs"] = events[-2]["logprobs"] = []
        else:
            args = item["arguments"]
            events += [
                {"type": "response.function_call_arguments.delta", **at, "delta": args},
                {"type": "response.function_call_arguments.done", **at, "arguments": args},
            ]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": final, "response": response})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def _opening(item: dict) -> dict:
    """An output item as ``response.output_item.added`` shows it (nothing generated yet)."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    return {**item, "status": "in_progress", "arguments": ""}
