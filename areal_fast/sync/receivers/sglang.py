"""Weight updates of an SGLang server, driven over its HTTP API (stdlib only).

The trainer owns the tensors; SGLang receives them. For a trainer on other GPUs the path is
``/update_weights_from_distributed``: SGLang's ranks join a process group with the trainer
(``/init_weights_update_group``; the trainer is rank 0, SGLang TP rank ``i`` is
``rank_offset + i``), and each update request names the tensors the trainer is about to
``broadcast`` from rank 0. The request returns only after SGLang received and loaded them,
so the client posts it from a background thread while the caller's thread broadcasts. Give
the trainer's group a finite timeout: a receiver that never joins (e.g. the request was
rejected) otherwise leaves the trainer's ``broadcast`` waiting forever.

One version switch (:meth:`SGLangWeightClient.sync_version`) is

    pause_generation -> update_weights_from_distributed (+ trainer broadcast) -> continue

with ``flush_cache=True`` in the update, so SGLang drops its prefix (radix) cache, whose KV
was computed with the old weights, before the update call returns (SGLang asserts that this
flush succeeded). When any step fails the engine is left paused: a paused engine serves
nothing, while a resumed one could serve a mix of old and new weights (SGLang reports a
failed distributed update as "partially updated. Please discard the whole weights.").
Recovery is the caller's: retry the update, or reload and call :meth:`continue_generation`.

``load_format="flattened_bucket"`` (the only non-default value SGLang documents for this
route) lets one broadcast carry many tensors: SGLang allocates the listed tensors,
``torch.cat``s their ``flatten()``s in the order given and receives one broadcast into that
1-D buffer, then splits it back. The trainer must therefore broadcast exactly
``torch.cat([t.flatten() for t in bucket])`` with the same order, and a bucket must hold a
single dtype (``torch.cat`` would promote a mix; this client refuses one). With the default
``load_format=None`` the trainer broadcasts every tensor separately, in the order given.

Source: SGLang HTTP API, io_struct.py @ sgl-project/sglang 001067fffe33 (request classes),
http_server.py @ 0025436eab05 (routes), docs/advanced_features/sglang_for_rl.md; a copy of
the schemas with field types and defaults is in tests/sync/sglang_schema.py.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import operator
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Sequence

from areal_fast._replies import one_line as _one_line
from areal_fast._replies import server_message as _sglang_message

logger = logging.getLogger(__name__)

#: Where the request schemas were read (see tests/sync/sglang_schema.py for the copy).
SGLANG_SOURCE = (
    "SGLang HTTP API, io_struct.py @ sgl-project/sglang 001067fffe33 "
    "(routes: http_server.py @ 0025436eab05)"
)

#: Process-group name this client uses unless told otherwise (SGLang's own default is
#: "weight_update_group"; the name only has to agree between init, update and destroy).
DEFAULT_GROUP_NAME = "areal_fast"

#: ``PauseGenerationReqInput.mode`` values.
PAUSE_MODES = ("abort", "retract", "in_place")

#: ``load_format`` values SGLang documents for ``/update_weights_from_distributed``.
DISTRIBUTED_LOAD_FORMATS = (None, "flattened_bucket")

_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_JOIN_SLACK_S = 1.0


def _check_timeout(value: Any, what: str = "timeout") -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"SGLang client: {what} must be a number of seconds, got {value!r}"
        ) from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"SGLang client: {what} must be a finite number > 0, got {value!r}")
    return seconds


def _check_base_url(base_url: Any) -> str:
    if not isinstance(base_url, str):
        raise ValueError(f"SGLang base_url must be a str, got {type(base_url).__name__}")
    if not base_url or any(c.isspace() for c in base_url):
        raise ValueError(f"SGLang base_url {base_url!r} is empty or contains whitespace")
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"SGLang base_url {base_url!r}: scheme must be http or https")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ValueError(f"SGLang base_url {base_url!r}: malformed port") from None
    if not parts.hostname:
        raise ValueError(f"SGLang base_url {base_url!r} has no host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(
            f"SGLang base_url {base_url!r}: credentials, query and fragment are "
            "not allowed (pass api_key instead)"
        )
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"SGLang client: {what} must be a non-empty str, got {value!r}")
    return value


def _check_int(value: Any, what: str, low: int, high: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"SGLang client: {what} must be an int, got {value!r}") from None
    if number < low or (high is not None and number > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SGLang client: {what} must be {bound}, got {number}")
    return number


def _check_version_label(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(
            f"SGLang client: weight_version must be None or a non-empty str, got {value!r}"
        )
    return value


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or "torch.bfloat16" or "bfloat16" -> "bfloat16" (SGLang resolves
    the name with ``getattr(torch, name)``)."""
    name = str(dtype)
    name = name[len("torch.") :] if name.startswith("torch.") else name
    if not _DTYPE_NAME.match(name):
        raise ValueError(
            f"SGLang client: dtype {dtype!r} is not a torch dtype name such as 'bfloat16'"
        )
    return name


def _tensor_specs(
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
) -> tuple[list[str], list[str], list[list[int]]]:
    if load_format not in DISTRIBUTED_LOAD_FORMATS:
        raise ValueError(
            f"SGLang client: load_format {load_format!r} is not one of "
            f"{DISTRIBUTED_LOAD_FORMATS} for /update_weights_from_distributed"
        )
    for what, seq in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise ValueError(f"SGLang client: {what} must be a sequence, got {type(seq).__name__}")
    if not len(names) == len(dtypes) == len(shapes) or not len(names):
        raise ValueError(
            f"SGLang client: names, dtypes and shapes must be non-empty and of one "
            f"length, got {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    name_list = [_check_name(n, "tensor name") for n in names]
    if len(set(name_list)) != len(name_list):
        dup = next(n for n in name_list if name_list.count(n) > 1)
        raise ValueError(f"SGLang client: tensor name {dup!r} appears twice")
    dtype_list = [_dtype_name(d) for d in dtypes]
    shape_list = []
    for name, shape in zip(name_list, shapes):
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise ValueError(
                f"SGLang client: shape of {name!r} must be a sequence of ints, got {shape!r}"
            )
        shape_list.append([_check_int(d, f"a dimension of {name!r}", 0) for d in shape])
    if load_format == "flattened_bucket" and len(set(dtype_list)) != 1:
        raise ValueError(
            f"SGLang client: a flattened_bucket must hold one dtype, got "
            f"{sorted(set(dtype_list))} (send one bucket per dtype)"
        )
    return name_list, dtype_list, shape_list


class SGLangWeightClient:
    """Client of one SGLang server's weight-update endpoints.

    Parameters
    ----------
    base_url : str
        Server address, ``http://host:port`` or ``https://host:port`` (a path prefix is kept;
        a trailing slash is dropped). HTTP proxies from the environment are not used.
    timeout : float, default 60.0
        Seconds any one HTTP call may wait (connect, and each read of the reply). Weight
        updates may override it per call: they return only after the transfer and load.
    api_key : str or None, default None
        Sent as ``Authorization: Bearer <api_key>`` (SGLang's ``--api-key``; servers that
        also set ``--admin-api-key`` want the admin key for pause/continue).

    Raises
    ------
    ValueError
        A base URL that is not http(s)://host[:port][/path], or a timeout that is not > 0.

    Notes
    -----
    Every call raises ``TimeoutError`` naming the URL and the timeout when the server does
    not answer in time, and ``RuntimeError`` naming the URL and SGLang's message on an HTTP
    error, a reply with ``success: false`` or an unreachable server. Thread-safe: calls share
    no mutable state.

    Source: SGLang HTTP API, io_struct.py @ sgl-project/sglang 001067fffe33.
    """

    def __init__(self, base_url: str, timeout: float = 60.0, api_key: str | None = None):
        self.base_url = _check_base_url(base_url)
        self.timeout = _check_timeout(timeout)
        if api_key is not None and (
            not isinstance(api_key, str) or not api_key or any(c.isspace() for c in api_key)
        ):
            raise ValueError(
                "SGLang client: api_key must be None or a non-empty str without whitespace"
            )
        self._api_key = api_key
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"SGLangWeightClient({self.base_url!r}, timeout={self.timeout:g})"

    # ---------------------------------------------------------------- HTTP plumbing

    def _request(
        self, method: str, path: str, payload: dict | None, timeout: float | None = None
    ) -> bytes:
        seconds = self.timeout if timeout is None else _check_timeout(timeout)
        url = self.base_url + path
        where = f"SGLang {method} {url}"
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=seconds) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            try:
                body = exc.read()
            except (OSError, http.client.HTTPException):
                body = b""
            raise RuntimeError(
                f"{where} failed with HTTP {exc.code}: {_sglang_message(body)}"
            ) from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise TimeoutError(f"{where} timed out after {seconds:g} s") from exc
            raise RuntimeError(f"{where} failed: {_one_line(exc.reason)}") from exc
        except TimeoutError as exc:
            raise TimeoutError(f"{where} timed out after {seconds:g} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise RuntimeError(f"{where} failed: {type(exc).__name__}: {_one_line(exc)}") from exc

    def _json(self, method: str, path: str, body: bytes) -> dict:
        try:
            reply = json.loads(body)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise RuntimeError(
                f"SGLang {method} {self.base_url}{path} replied with no JSON "
                f"object: {_one_line(body.decode('utf-8', 'replace'))}"
            )
        return reply

    def _post_checked(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        reply = self._json("POST", path, self._request("POST", path, payload, timeout))
        if reply.get("success") is not True:
            message = _one_line(reply.get("message") or reply)
            raise RuntimeError(
                f"SGLang POST {self.base_url}{path} failed (success="
                f"{reply.get('success')!r}): {message}"
            )
        return reply

    def _post_while(
        self, path: str, payload: dict, during: Callable[[], None], timeout: float | None
    ) -> dict:
        """POST from a background thread while ``during()`` runs in the caller's thread (so
        a trainer's ``broadcast`` keeps its CUDA device); wait for both."""
        if not callable(during):
            raise ValueError(f"SGLang client: expected a callable, got {during!r}")
        seconds = self.timeout if timeout is None else _check_timeout(timeout)
        box: dict[str, Any] = {}

        def post() -> None:
            try:
                box["reply"] = self._post_checked(path, payload, seconds)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=post, name=f"sglang-post{path}", daemon=True)
        start = time.monotonic()
        thread.start()
        during_error = None
        try:
            during()
        except Exception as exc:  # noqa: BLE001 - reported together with the HTTP outcome
            during_error = exc
        thread.join(max(0.0, start + seconds - time.monotonic()) + _JOIN_SLACK_S)
        where = f"SGLang POST {self.base_url}{path}"
        if thread.is_alive():
            raise TimeoutError(f"{where} timed out after {seconds:g} s") from during_error
        if "error" in box:
            error = box["error"]
            if during_error is not None and isinstance(error, (RuntimeError, TimeoutError)):
                raise type(error)(
                    f"{error}; the trainer side also raised "
                    f"{type(during_error).__name__}: {_one_line(during_error)}"
                ) from error
            raise error
        if during_error is not None:
            raise RuntimeError(
                f"{where}: the trainer side raised {type(during_error).__name__}:"
                f" {_one_line(during_error)}"
            ) from during_error
        return box["reply"]

    # ---------------------------------------------------------------- endpoints

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        *,
        rendezvous: Callable[[], None] | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Make SGLang's ranks join a process group with the trainer (POST
        /init_weights_update_group).

        SGLang's TP rank ``i`` joins as rank ``rank_offset + i`` of a ``world_size`` group
        rendezvousing at ``tcp://master_address:master_port``; the call returns once the group
        is formed, so the trainer must join concurrently (pass its join as ``rendezvous``).

        Parameters
        ----------
        master_address : str
            Host of the rendezvous (the trainer's rank 0).
        master_port : int
            Port of the rendezvous, in [1, 65535].
        rank_offset : int
            Group rank of this server's TP rank 0; >= 0 and < world_size (the trainer is 0).
        world_size : int
            Size of the group: the trainer plus the TP ranks of every server that joins.
        group_name : str, default "areal_fast"
            Name the later update and destroy calls refer to.
        backend : str, default "nccl"
            torch.distributed backend.
        rendezvous : callable () -> None, optional
            The trainer's own join as rank 0, run in the caller's thread while the request
            is in flight. It must build the group the way SGLang builds its side (its
            ``init_custom_process_group``: TCP store of ``rendezvous("tcp://addr:port")``,
            wrapped in ``PrefixStore(group_name)``, then ``_new_process_group_helper`` with
            ``group_name``); a plain ``init_process_group`` uses other store keys and hangs.
        timeout : float, optional
            Seconds to wait for the reply (default: the client's timeout).

        Returns
        -------
        dict
            SGLang's reply, ``{"success": True, "message": str}``.

        Raises
        ------
        ValueError
            An argument out of range (before anything is sent).
        RuntimeError
            HTTP error, ``success: false``, unreachable server, or ``rendezvous`` raised.
        TimeoutError
            No reply within the timeout.

        Notes
        -----
        Source: SGLang HTTP API, io_struct.py @ 001067fffe33, InitWeightsUpdateGroupReqInput.
        """
        world_size = _check_int(world_size, "world_size", 2)
        payload = {
            "master_address": _check_name(master_address, "master_address"),
            "master_port": _check_int(master_port, "master_port", 1, 65535),
            "rank_offset": _check_int(rank_offset, "rank_offset", 0, world_size - 1),
            "world_size": world_size,
            "group_name": _check_name(group_name, "group_name"),
            "backend": _check_name(backend, "backend"),
        }
        if rendezvous is None:
            return self._post_checked("/init_weights_update_group", payload, timeout)
        return self._post_while("/init_weights_update_group", payload, rendezvous, timeout)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Make SGLang leave and destroy the named process group (POST
        /destroy_weights_update_group).

        Parameters
        ----------
        group_name : str, default "areal_fast"
            The group created by :meth:`init_weights_update_group`.

        Returns
        -------
        dict
            SGLang's reply, ``{"success": True, "message": str}``.

        Raises
        ------
        ValueError
            An empty group name.
        RuntimeError
            HTTP error (e.g. "The group to be destroyed does not exist."), unreachable server.
        TimeoutError
            No reply within the client's timeout.

        Notes
        -----
        Source: SGLang HTTP API, io_struct.py @ 001067fffe33,
        DestroyWeightsUpdateGroupReqInput.
        """
        payload = {"group_name": _check_name(group_name, "group_name")}
        return self._post_checked("/destroy_weights_update_group", payload)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        weight_version: str | None = None,
        *,
        load_format: str | None = None,
        broadcast: Callable[[], None] | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Have SGLang receive tensors broadcast by the trainer and load them (POST
        /update_weights_from_distributed).

        The reply comes after SGLang received every tensor from group rank 0 and loaded it,
        so the trainer's broadcasts must run while the request is in flight: pass them as
        ``broadcast`` (run in the caller's thread), or call this from another thread.

        Parameters
        ----------
        names : sequence of str, length n
            Parameter names as the served model's ``load_weights`` expects them (Hugging Face
            checkpoint names); unique.
        dtypes : sequence of str or torch.dtype, length n
            Dtype of each tensor ("bfloat16", "float32", or ``torch.bfloat16``).
        shapes : sequence of sequence of int, length n
            Full (unsharded) shape of each tensor.
        group_name : str, default "areal_fast"
            Process group from :meth:`init_weights_update_group`.
        flush_cache : bool, default True
            SGLang flushes its prefix cache after loading (asserting that it could).
        weight_version : str or None, default None
            Label SGLang records on success (``/get_weight_version`` then reports it).
        load_format : {None, "flattened_bucket"}, default None
            None: the trainer broadcasts each tensor in order. "flattened_bucket": it
            broadcasts ``torch.cat([t.flatten() for t in tensors])`` once; one dtype only.
        broadcast : callable () -> None, optional
            The trainer's sends, run in the caller's thread while the request is in flight.
        timeout : float, optional
            Seconds to wait for the reply (default: the client's timeout); covers the whole
            transfer and load.

        Returns
        -------
        dict
            SGLang's reply, ``{"success": True, "message": str}``.

        Raises
        ------
        ValueError
            Mismatched lengths, duplicate names, a bad dtype or shape, an unknown
            ``load_format``, or a flattened bucket of several dtypes (before anything is sent).
        RuntimeError
            HTTP error or ``success: false`` (SGLang then says the weights are partially
            updated), unreachable server, or ``broadcast`` raised.
        TimeoutError
            No reply within the timeout.

        Notes
        -----
        Source: SGLang HTTP API, io_struct.py @ 001067fffe33,
        UpdateWeightsFromDistributedReqInput; model_runner.py for the flattened_bucket layout.
        """
        payload = self._distributed_payload(
            names, dtypes, shapes, group_name, flush_cache, weight_version, load_format
        )
        if broadcast is None:
            return self._post_checked("/update_weights_from_distributed", payload, timeout)
        return self._post_while("/update_weights_from_distributed", payload, broadcast, timeout)

    @staticmethod
    def _distributed_payload(
        names, dtypes, shapes, group_name, flush_cache, weight_version, load_format
    ) -> dict:
        names, dtypes, shapes = _tensor_specs(names, dtypes, shapes, load_format)
        if not isinstance(flush_cache, bool):
            raise ValueError(f"SGLang client: flush_cache must be a bool, got {flush_cache!r}")
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": _check_name(group_name, "group_name"),
            "flush_cache": flush_cache,
            "weight_version": _check_version_label(weight_version),
        }
        if load_format is not None:
            payload["load_format"] = load_format
        return payload

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str | bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        *,
        timeout: float | None = None,
    ) -> dict:
        """Load tensors shared with SGLang through CUDA IPC handles (POST
        /update_weights_from_tensor), for a trainer on the same GPUs.

        Parameters
        ----------
        serialized_named_tensors : sequence of str or bytes, length tp_size
            One payload per SGLang TP rank, each made by SGLang's
            ``MultiprocessingSerializer.serialize`` (of a list of (name, tensor), or of a
            flattened-bucket dict); bytes are base64-encoded here, str must be base64 already.
        load_format : str or None, default None
            None (``load_weights``), "direct", "flattened_bucket", or a custom loader that the
            server was launched with.
        flush_cache : bool, default True
            SGLang flushes its prefix cache after loading.
        weight_version : str or None, default None
            Label SGLang records on success.
        timeout : float, optional
            Seconds to wait for the reply (default: the client's timeout).

        Returns
        -------
        dict
            SGLang's reply, ``{"success": True, "message": str}``.

        Raises
        ------
        ValueError
            An empty payload list or an element that is not str/bytes.
        RuntimeError
            HTTP error, ``success: false``, unreachable server.
        TimeoutError
            No reply within the timeout.

        Notes
        -----
        The tensors stay owned by the trainer process, which must keep them alive (and
        unmodified) until this call returns. Source: SGLang HTTP API, io_struct.py @
        001067fffe33, UpdateWeightsFromTensorReqInput.
        """
        if isinstance(serialized_named_tensors, (str, bytes)) or not serialized_named_tensors:
            raise ValueError(
                "SGLang client: serialized_named_tensors must be a non-empty list "
                "with one payload per TP rank"
            )
        encoded = []
        for item in serialized_named_tensors:
            if isinstance(item, (bytes, bytearray, memoryview)):
                encoded.append(base64.b64encode(bytes(item)).decode("ascii"))
            elif isinstance(item, str) and item:
                encoded.append(item)
            else:
                raise ValueError(
                    f"SGLang client: a serialized tensor payload must be non-empty "
                    f"str (base64) or bytes, got {type(item).__name__}"
                )
        if load_format is not None:
            _check_name(load_format, "load_format")
        if not isinstance(flush_cache, bool):
            raise ValueError(f"SGLang client: flush_cache must be a bool, got {flush_cache!r}")
        payload = {
            "serialized_named_tensors": encoded,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": _check_version_label(weight_version),
        }
        return self._post_checked("/update_weights_from_tensor", payload, timeout)

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop the server from running inference (POST /pause_generation).

        Parameters
        ----------
        mode : {"abort", "retract", "in_place"}, default "abort"
            "abort": running and waiting requests end now and return to their callers (as
            aborted). "retract": running requests go back to the waiting queue and will be
            prefilled again after :meth:`continue_generation`. "in_place": requests keep
            their KV cache, so the cache cannot be flushed while paused. SGLang 0.5.x routes
            take no body and always abort.

        Raises
        ------
        ValueError
            An unknown mode.
        RuntimeError
            HTTP error, unreachable server.
        TimeoutError
            No reply within the client's timeout (aborting waits for in-flight requests).

        Notes
        -----
        Source: SGLang HTTP API, io_struct.py @ 001067fffe33, PauseGenerationReqInput.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"SGLang client: pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        """Let a paused server run inference again (POST /continue_generation).

        Raises
        ------
        RuntimeError
            HTTP error, unreachable server.
        TimeoutError
            No reply within the client's timeout.

        Notes
        -----
        Sends an empty JSON object, so ``ContinueGenerationReqInput.torch_empty_cache`` keeps
        its default (True). Source: SGLang HTTP API, io_struct.py @ 001067fffe33,
        ContinueGenerationReqInput.
        """
        self._request("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        """Drop the server's prefix (radix) cache (POST /flush_cache).

        Raises
        ------
        RuntimeError
            HTTP 400: SGLang did not flush because requests are running or waiting (pause
            with "abort" or "retract" first); other HTTP errors, unreachable server.
        TimeoutError
            No reply within the client's timeout.

        Notes
        -----
        Weight updates flush by themselves when sent with ``flush_cache=True``.
        Source: SGLang HTTP API, http_server.py @ 0025436eab05, route /flush_cache.
        """
        self._request("POST", "/flush_cache", None)

    def get_weight_version(self) -> str | None:
        """The weight version label the server reports (GET /get_weight_version).

        Returns
        -------
        str or None
            The label of the last successful update that carried one, else the launch
            value (``--weight-version``, "default" unless set).

        Raises
        ------
        RuntimeError
            HTTP error (a server without the route answers 404), a reply without
            ``weight_version``, unreachable server.
        TimeoutError
            No reply within the client's timeout.

        Notes
        -----
        Source: SGLang HTTP API, http_server.py @ 0025436eab05, route /get_weight_version.
        """
        reply = self._json(
            "GET", "/get_weight_version", self._request("GET", "/get_weight_version", None)
        )
        if "weight_version" not in reply:
            raise RuntimeError(
                f"SGLang GET {self.base_url}/get_weight_version replied without "
                f"weight_version: {_one_line(reply)}"
            )
        version = reply["weight_version"]
        return None if version is None else str(version)

    # ---------------------------------------------------------------- one version switch

    def sync_version(
        self,
        version: int,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        broadcast: Callable[[], None],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        pause_mode: str = "abort",
        load_format: str | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Switch the server to policy ``version``: pause, receive and load the trainer's
        broadcast (flushing the prefix cache), continue.

        Parameters
        ----------
        version : int
            Policy version of the weights; recorded by SGLang as ``str(version)``.
        names, dtypes, shapes : sequences of length n
            As in :meth:`update_weights_from_distributed`.
        broadcast : callable () -> None
            The trainer's sends over the group (each tensor in order, or the one flattened
            bucket); runs in the caller's thread while the update request is in flight.
        group_name : str, default "areal_fast"
            Process group from :meth:`init_weights_update_group`.
        pause_mode : {"abort", "retract"}, default "abort"
            How running requests are paused. "in_place" is refused: those requests would
            resume on KV computed with the old weights, and it forbids the cache flush.
        load_format : {None, "flattened_bucket"}, default None
            As in :meth:`update_weights_from_distributed`.
        timeout : float, optional
            Seconds the update may take (default: the client's timeout).

        Returns
        -------
        dict
            SGLang's reply to the update, ``{"success": True, "message": str}``.

        Raises
        ------
        ValueError
            Bad arguments (checked before the server is paused).
        RuntimeError
            Pause, update (HTTP error, ``success: false``, ``broadcast`` raised) or continue
            failed; the message names the endpoint and SGLang's message.
        TimeoutError
            A call got no reply in time.

        Notes
        -----
        Atomic switch: after a failed pause or update :meth:`continue_generation` is not
        called, so the engine stays paused rather than serve partly updated weights. The
        caller retries the update (or reloads) and then continues. Source: SGLang HTTP API,
        io_struct.py @ 001067fffe33; docs/advanced_features/sglang_for_rl.md (pause ---
        update --- continue).
        """
        version = _check_int(version, "version", 0)
        if pause_mode not in ("abort", "retract"):
            raise ValueError(
                f"SGLang client: sync_version pause_mode must be 'abort' or "
                f"'retract', got {pause_mode!r}"
            )
        if not callable(broadcast):
            raise ValueError(f"SGLang client: broadcast must be callable, got {broadcast!r}")
        if timeout is not None:
            timeout = _check_timeout(timeout)
        payload = self._distributed_payload(
            names, dtypes, shapes, group_name, True, str(version), load_format
        )
        start = time.perf_counter()
        self.pause_generation(pause_mode)
        try:
            reply = self._post_while(
                "/update_weights_from_distributed", payload, broadcast, timeout
            )
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}; engine left paused before version {version}") from exc
        try:
            self.continue_generation()
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(
                f"{exc}; version {version} is loaded but the engine is still paused"
            ) from exc
        logger.info(
            "SGLang %s switched to version %d (%d tensors) in %.3f s",
            self.base_url,
            version,
            len(payload["names"]),
            time.perf_counter() - start,
        )
        return reply
