"""Error text from a server's reply, shared by the HTTP clients (one line, bounded)."""

from __future__ import annotations

import json
from typing import Any

MESSAGE_LIMIT = 300  # characters of a server's message kept in an error


def one_line(text: Any, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` on one line (whitespace runs become one space), cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def server_message(body: bytes) -> str:
    """The server's message in an error reply: ``message``, ``detail``, ``error`` (or
    ``error.message``) of a JSON object, else the text itself (FastAPI, SGLang, vLLM)."""
    text = body.decode("utf-8", "replace")
    try:
        reply = json.loads(text)
    except ValueError:
        return one_line(text) or "(empty body)"
    if isinstance(reply, dict):
        for key in ("message", "detail", "error"):
            value = reply.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return one_line(value)
    return one_line(text) or "(empty body)"
