"""JSON over HTTP for the server engines (``vllm_server``, ``sglang_server``), with aiohttp.

:class:`JsonHttpClient` posts and gets JSON on one server. Every call has a timeout, and
every failure is one :class:`~areal_fast.rollout.loop_engine.EngineError` line that names
the engine, the method and the endpoint: an HTTP error status (with the server's own
message), a reply that is not JSON, a server nobody listens on, a connection dropped
mid-reply. A call that runs past its timeout raises ``TimeoutError`` naming the same.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp

from areal_fast._replies import one_line, server_message
from areal_fast.rollout.loop_engine import EngineError


class JsonHttpClient:
    """Client of one HTTP server that speaks JSON; lives on one asyncio loop.

    Parameters
    ----------
    base_url : str
        ``http://host:port`` (a trailing slash is dropped).
    name : str
        Names the engine in every error.
    timeout : float
        Seconds a call may take unless the call says otherwise (> 0).
    api_key : str, optional
        Sent as ``Authorization: Bearer <api_key>``.

    Raises
    ------
    ValueError
        A base URL that is not http(s)://..., or a timeout <= 0.
    """

    def __init__(self, base_url: str, name: str, timeout: float, api_key: Optional[str] = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{name}: server URL {base_url!r} must start with http:// or https://")
        if not timeout > 0:
            raise ValueError(f"{name}: timeout = {timeout} must be > 0")
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout = float(timeout)
        self._headers = {"Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: Optional[aiohttp.ClientSession] = None

    async def open(self) -> None:
        """Create the connection pool (on the loop that makes every later call)."""
        if self._session is None:
            # no proxies from the environment: the server is local or named exactly
            self._session = aiohttp.ClientSession(headers=self._headers, trust_env=False)

    async def close(self) -> None:
        """Close the connection pool (safe to call twice)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def post(
        self,
        path: str,
        payload: Any = None,
        *,
        params: Optional[dict] = None,
        timeout: Optional[float] = None,
        empty_ok: bool = False,
    ) -> Any:
        """POST ``payload`` as JSON to ``path``; the decoded JSON reply.

        Parameters
        ----------
        path : str
            Endpoint, e.g. ``"/generate"``.
        payload : JSON-able, optional
            The body (none when None).
        params : dict, optional
            Query parameters.
        timeout : float, optional
            Seconds for the whole call (default: the client's timeout).
        empty_ok : bool
            An empty reply body is fine (returns None) rather than malformed.

        Raises
        ------
        EngineError
            HTTP error, malformed JSON, unreachable server (names the endpoint).
        TimeoutError
            No complete reply within the timeout.
        """
        return await self._call("POST", path, payload, params, timeout, empty_ok)

    async def get(
        self, path: str, *, timeout: Optional[float] = None, empty_ok: bool = False
    ) -> Any:
        """GET ``path``; the decoded JSON reply (errors as :meth:`post`)."""
        return await self._call("GET", path, None, None, timeout, empty_ok)

    async def _call(self, method, path, payload, params, timeout, empty_ok) -> Any:
        if self._session is None:
            raise EngineError(f"{self.name}: {method} {path} before the client was opened")
        seconds = self.timeout if timeout is None else float(timeout)
        where = f"{self.name}: {method} {self.base_url}{path}"
        try:
            async with self._session.request(
                method,
                self.base_url + path,
                json=payload,
                params=params,
                timeout=aiohttp.ClientTimeout(total=seconds),
            ) as reply:
                body = await reply.read()
                status = reply.status
        except asyncio.TimeoutError:
            raise TimeoutError(f"{where} got no reply within {seconds:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise EngineError(f"{where} failed: cannot connect ({one_line(exc)})") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"{where} failed: {type(exc).__name__}: {one_line(exc)}") from exc
        if status >= 400:
            raise EngineError(f"{where} failed with HTTP {status}: {server_message(body)}")
        if not body.strip():
            if empty_ok:
                return None
            raise EngineError(f"{where} answered an empty body (expected JSON)")
        try:
            return json.loads(body)
        except ValueError:
            raise EngineError(
                f"{where} answered malformed JSON: {one_line(body.decode('utf-8', 'replace'))}"
            ) from None


def expect_dict(reply: Any, where: str) -> dict:
    """``reply`` when it is a JSON object, else an :class:`EngineError` naming ``where``."""
    if not isinstance(reply, dict):
        raise EngineError(f"{where} answered {one_line(reply)!r}, not a JSON object")
    return reply
