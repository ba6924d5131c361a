"""An OpenAI-compatible HTTP endpoint for agent sessions (aiohttp, JSON only).

Agents that speak the OpenAI API (``openai.AsyncOpenAI(base_url=server.url, api_key=token)``)
run unchanged against :class:`AgentServer`. It serves this subset of the API:

- ``POST /v1/chat/completions``: chat completions with ``tools``, ``n``, ``temperature``,
  ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``logprobs``, ``seed`` and
  ``stream`` (validated by :func:`~areal_fast.agent.protocol.parse_chat_request`; unsupported
  options are refused with 400, never silently ignored);
- ``POST /v1/responses``: the Responses API's text and function-tool subset (the OpenAI
  Agents SDK's default; :mod:`areal_fast.agent.responses`), recorded as the equivalent chat
  completion;
- ``GET /v1/models``: the one model name of the caller's session.

With ``stream: true`` the whole reply is sampled first and then sent as server-sent events
(chat: ``chat.completion.chunk`` objects and ``data: [DONE]``; responses: typed events
ending in ``response.completed``), so errors still come back as one JSON error.

Requests are routed to sessions by per-session bearer tokens: :meth:`AgentServer.open_session`
returns a fresh random token that the agent passes as its API key, and every request made with
it is served by :class:`~areal_fast.agent.client.ChatBackend` and recorded in that session.
Unknown, missing or closed tokens get 401. Errors use OpenAI's JSON shape ``{"error":
{"message", "type", "param", "code"}}``. The server binds the loopback interface unless told
otherwise and handles requests concurrently on the event loop that started it, which it never
blocks: large bodies are decoded on a worker thread, a request whose messages hold more text
than ``max_prompt_tokens`` tokens can is refused before anything is rendered, and prompts are
rendered and tokenised on a worker thread (:class:`~areal_fast.agent.client.ChatBackend`). A
request whose
client disconnects is cancelled (its ``generate`` calls see ``asyncio.CancelledError``), and so
are the running requests of a session when :meth:`AgentServer.close_session` revokes its token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from typing import Optional

from aiohttp import web

from areal_fast.agent.client import ChatBackend, SessionDefaults
from areal_fast.agent.protocol import (
    REQUEST_KEYS,
    BadRequest,
    ChatRequest,
    chat_completion_chunks,
    parse_chat_request,
)
from areal_fast.agent.responses import (
    RESPONSES_KEYS,
    parse_responses_request,
    response_events,
    response_object,
)
from areal_fast.agent.session import Session

logger = logging.getLogger("areal_fast.agent")

_PARAM_RE = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\]|\.\w+)*)(?=[\s=]|$)")
_UNKNOWN_KEY_RE = re.compile(r"^unknown request key '([^']*)'")
_THREAD_DECODE_BYTES = 64 << 10  # larger bodies are decoded and validated off the loop


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: Optional[str] = None,
    code: Optional[str] = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def _param_of(message: str, keys: frozenset = REQUEST_KEYS) -> Optional[str]:
    """The request key (one of ``keys``) a :class:`BadRequest` message names first, or None."""
    unknown = _UNKNOWN_KEY_RE.match(message)
    if unknown:
        return unknown.group(1)
    match = _PARAM_RE.match(message)
    if match and match.group(1) in keys:
        return match.group(1) + match.group(2)
    return None


def _bad_request(exc: BadRequest, keys: frozenset = REQUEST_KEYS) -> web.Response:
    message = str(exc).splitlines()[0] if str(exc) else "bad request"
    return _error(400, message, param=_param_of(message, keys))


def _decode(raw: bytes, parse):
    """``parse`` of the JSON body ``raw`` (BadRequest when it is not valid JSON)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: it is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    return body, parse(body)


async def _send_events(request: web.Request, events: list[tuple[Optional[str], str]]):
    """A ``text/event-stream`` response of (event name or None, data) pairs."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await response.write(f"{head}data: {data}\n\n".encode())
    await response.write_eof()
    return response


def _describe(exc: BaseException) -> str:
    """``"<ExcType>: <first line>"`` (just the type when the message is empty)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class AgentServer:
    """OpenAI-compatible chat endpoint whose requests are recorded into sessions.

    Parameters
    ----------
    backend : ChatBackend
        Serves and records each chat request.
    host : str
        Interface to bind; loopback by default (bind others only on a trusted network).
    port : int
        TCP port; 0 picks a free one (see :attr:`url`).
    max_body_bytes : int
        Largest request body accepted; larger ones get 413.

    Notes
    -----
    HTTP statuses: 200 success; 400 a body that is not a JSON object (or nested too deeply)
    or a request the endpoint refuses (the message names the key, also given as ``param``);
    401 a missing, unknown or closed token, also a request still running when its session
    is closed (code ``"session_closed"``); 404 an unknown route; 405 a known route with the
    wrong method; 413 a body over ``max_body_bytes``; 500 the request could not be read
    (``"cannot read the request: <ExcType>: <first line>"``, a bug of the parser) or the
    engine failed (``"the engine failed: <ExcType>: <first line>"``); 500s are logged on the
    ``areal_fast.agent`` logger.
    """

    def __init__(
        self,
        backend: ChatBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 16 << 20,
    ):
        self.backend, self.host, self.port = backend, host, port
        self.max_body_bytes = max_body_bytes
        self._sessions: dict[str, tuple[Session, SessionDefaults]] = {}
        self._running: dict[str, set[asyncio.Task]] = {}  # token -> its requests' tasks
        self._runner: Optional[web.AppRunner] = None
        self._bound_port: Optional[int] = None
        self._closed = False

    async def start(self) -> None:
        """Start serving on the running event loop.

        Raises
        ------
        RuntimeError
            If the server was already started or closed.
        OSError
            If the address cannot be bound.
        """
        if self._runner is not None or self._closed:
            raise RuntimeError("AgentServer.start: the server was already started or closed")
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._json_errors])
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        # handler_cancellation: a request whose client disconnects is cancelled
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._bound_port = runner.addresses[0][1]

    @property
    def url(self) -> str:
        """Base URL of the API, ``http://<host>:<port>/v1`` (``base_url`` for openai clients).

        Raises
        ------
        RuntimeError
            Before :meth:`start`.
        """
        if self._bound_port is None:
            raise RuntimeError("AgentServer.url: the server has not been started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._bound_port}/v1"

    def open_session(self, session: Session, defaults: SessionDefaults) -> str:
        """Authorise requests for ``session``.

        Parameters
        ----------
        session : Session
            Receives every call made with the returned token.
        defaults : SessionDefaults
            Sampling defaults and limits of those calls.

        Returns
        -------
        str
            A fresh random bearer token (the agent's API key).
        """
        token = secrets.token_urlsafe(32)
        self._sessions[token] = (session, defaults)
        return token

    def close_session(self, token: str) -> None:
        """Revoke ``token``: later requests with it get 401, and its running requests are
        cancelled (they answer 401 too). Unknown tokens are ignored.

        Parameters
        ----------
        token : str
            From :meth:`open_session`.
        """
        self._sessions.pop(token, None)
        for task in self._running.pop(token, ()):
            task.cancel()

    async def close(self) -> None:
        """Stop serving and revoke every token; safe to call more than once.

        The sessions' running requests are cancelled at once (their ``generate`` calls see
        ``asyncio.CancelledError``; they answer 401), other requests after a one-second grace
        period.
        """
        self._closed = True
        for token in list(self._sessions):
            self.close_session(token)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ---- request handling --------------------------------------------------------------
    @web.middleware
    async def _json_errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
            return _error(exc.status, f"{request.method} {request.path}: {exc.reason}", code=code)

    def _authorise(self, request: web.Request):
        """((session, defaults), token) of the request's bearer token, or (None, a 401)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, _error(
                401,
                "missing bearer token in the Authorization header",
                "authentication_error",
                code="invalid_api_key",
            )
        entry = self._sessions.get(token.strip())
        if entry is None:
            return None, _error(
                401, "invalid or expired API key", "authentication_error", code="invalid_api_key"
            )
        return (entry, token.strip()), None

    async def _models(self, request: web.Request) -> web.Response:
        entry, denied = self._authorise(request)
        if denied is not None:
            return denied
        model = {"id": entry[0][1].model, "object": "model", "created": 0, "owned_by": "areal-fast"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat_request, REQUEST_KEYS, self._chat_reply)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(
            request, parse_responses_request, RESPONSES_KEYS, self._responses_reply
        )

    @staticmethod
    async def _chat_reply(request, chat: ChatRequest, body: dict, completion: dict):
        if not chat.stream:
            return web.json_response(completion)
        chunks = chat_completion_chunks(completion, chat.include_usage)
        events = [(None, json.dumps(c)) for c in chunks] + [(None, "[DONE]")]
        return await _send_events(request, events)

    @staticmethod
    async def _responses_reply(request, chat: ChatRequest, body: dict, completion: dict):
        response = response_object(completion, chat, body)
        if not chat.stream:
            return web.json_response(response)
        events = [(e["type"], json.dumps(e)) for e in response_events(response)]
        return await _send_events(request, events)

    async def _read(self, request: web.Request, session: Session, parse, keys):
        """(body, parsed request) or (None, an error response)."""
        if (request.content_length or 0) > self.max_body_bytes:
            return None, self._too_large()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return None, self._too_large()
        try:
            if len(raw) > _THREAD_DECODE_BYTES:  # decoding megabytes would stall the loop
                return await asyncio.to_thread(_decode, raw, parse), None
            return _decode(raw, parse), None
        except BadRequest as exc:
            return None, _bad_request(exc, keys)
        except RecursionError:
            return None, _error(400, "the request is nested too deeply")
        except Exception as exc:  # noqa: BLE001 - a parser bug, not the caller's or engine's
            logger.exception(
                "agent server: cannot read a request of session %s", session.session_id
            )
            return None, _error(
                500,
                f"cannot read the request: {_describe(exc)}",
                "server_error",
                code="internal_error",
            )

    async def _serve(self, request: web.Request, parse, keys, reply) -> web.StreamResponse:
        """Authorise, read, complete (cancellable with the session) and ``reply``."""
        entry, denied = self._authorise(request)
        if denied is not None:
            return denied
        (session, defaults), token = entry
        parsed, failed = await self._read(request, session, parse, keys)
        if failed is not None:
            return failed
        body, chat = parsed
        if token not in self._sessions:  # closed while the body was read
            return _error(
                401, "invalid or expired API key", "authentication_error", code="invalid_api_key"
            )
        task = asyncio.ensure_future(self.backend.complete(session, chat, defaults))
        running = self._running.setdefault(token, set())
        running.add(task)
        try:
            completion = await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the client went away, or shutdown
                raise
            return _error(
                401,
                "the session was closed while this request was running",
                "authentication_error",
                code="session_closed",
            )
        except BadRequest as exc:
            return _bad_request(exc, keys)
        except RecursionError:
            return _error(400, "the request is nested too deeply")
        except Exception as exc:  # noqa: BLE001 - any engine failure becomes a 500
            logger.exception("agent server: a completion of session %s failed", session.session_id)
            return _error(
                500, f"the engine failed: {_describe(exc)}", "server_error", code="engine_error"
            )
        finally:
            running.discard(task)
            if not running and self._running.get(token) is running:
                del self._running[token]
        return await reply(request, chat, body, completion)

    def _too_large(self) -> web.Response:
        return _error(
            413,
            f"the request body is larger than {self.max_body_bytes} bytes",
            code="request_too_large",
        )
