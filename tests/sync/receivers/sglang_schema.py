"""Copy of SGLang's weight-update request schemas, for the contract tests of the SGLang client.

Read from stored copies of github.com/sgl-project/sglang (an index of public repositories;
the stored files are not all at one commit, and none of the copies carries a release number):

* ``python/sglang/srt/managers/io_struct.py`` @ 001067fffe33427bee0ed2f007fb7551a1d76b44
  (recent main: requests are ``msgspec.Struct`` subclasses of ``BaseReq``; FastAPI builds
  their pydantic schemas). Classes copied: InitWeightsUpdateGroupReqInput,
  DestroyWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
  UpdateWeightsFromTensorReqInput, PauseGenerationReqInput, ContinueGenerationReqInput,
  FlushCacheReqInput, and the ``*ReqOutput`` {success: bool, message: str} replies.
* ``python/sglang/srt/entrypoints/http_server.py`` @ 0025436eab0556737d615b36a4dd3e1e26e82f3d
  (v0.5.x era) for the routes, methods and reply bodies; the newer route signatures of
  ``/pause_generation`` (body ``PauseGenerationReqInput``) and ``/continue_generation``
  (body ``ContinueGenerationReqInput``) from copies of recent upstream http_server.py. In the
  0.5.x file both take no body (FastAPI then ignores one), so sending {"mode": ...} is
  accepted by both.
* ``docs/advanced_features/sglang_for_rl.md`` @ 067bfe93626b99d33a934c78ac24c0c71e5e5e17:
  the documented request tables (same fields and defaults as io_struct.py), "pause_generation
  --- update weights --- continue_generation is the correct execution flow", and
  ``load_format`` of /update_weights_from_distributed: ``None`` or ``"flattened_bucket"``.
* ``python/sglang/srt/model_executor/model_runner.py`` and
  ``python/sglang/srt/weight_sync/tensor_bucket.py`` (@ 07e900094b64b6141157badd0f14bb4742cb9825)
  for what "flattened_bucket" means on the wire: the receiver allocates the listed tensors,
  ``torch.cat``s their ``flatten()``s in list order and receives ONE ``broadcast`` from
  group rank 0 into that buffer (so one dtype per bucket; mixed dtypes would be promoted).

Every request class also inherits ``BaseReq`` fields ``rid: Optional[str] = None`` and
``http_worker_ipc: Optional[str] = None`` (new in the msgspec era, absent in 0.5.x
dataclasses). They are internal routing fields, so the client never sends them and they are
left out of ``fields`` below (the validator rejects them as unknown on purpose).

Type notation of ``fields``: "str", "int", "bool", "float", "list[str]", "list[list[int]]",
"optional[str]", "optional[float]", "optional[bool]", "literal:a|b|c". ``required`` fields
have no default in io_struct.py; the rest carry the default SGLang uses.
"""

from __future__ import annotations

from typing import Any

_REQUIRED = object()

#: endpoint path -> method, request class name, fields {name: (type, default or _REQUIRED)}
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/init_weights_update_group": {
        "method": "POST",
        "request": "InitWeightsUpdateGroupReqInput",
        "fields": {
            "master_address": ("str", _REQUIRED),
            "master_port": ("int", _REQUIRED),
            "rank_offset": ("int", _REQUIRED),
            "world_size": ("int", _REQUIRED),
            "group_name": ("str", "weight_update_group"),
            "backend": ("str", "nccl"),
        },
        # reply: {"success": bool, "message": str}; HTTP 200, or 400 when success is false
        "reply": "success_message",
    },
    "/destroy_weights_update_group": {
        "method": "POST",
        "request": "DestroyWeightsUpdateGroupReqInput",
        "fields": {"group_name": ("str", "weight_update_group")},
        "reply": "success_message",
    },
    "/update_weights_from_distributed": {
        "method": "POST",
        "request": "UpdateWeightsFromDistributedReqInput",
        "fields": {
            "names": ("list[str]", _REQUIRED),
            "dtypes": ("list[str]", _REQUIRED),  # torch attribute names: "bfloat16", ...
            "shapes": ("list[list[int]]", _REQUIRED),
            "group_name": ("str", "weight_update_group"),
            "flush_cache": ("bool", True),
            "abort_all_requests": ("bool", False),
            "weight_version": ("optional[str]", None),
            "load_format": ("optional[str]", None),  # None or "flattened_bucket"
            "torch_empty_cache": ("bool", False),  # recent main only
        },
        # reply: {"success", "message"}; on success with weight_version the message gains
        # " Weight version updated to <v>." and /get_weight_version reports <v>
        "reply": "success_message",
    },
    "/update_weights_from_tensor": {
        "method": "POST",
        "request": "UpdateWeightsFromTensorReqInput",
        "fields": {
            # one MultiprocessingSerializer payload per TP rank; base64 strings over HTTP
            "serialized_named_tensors": ("list[str]", _REQUIRED),
            "load_format": ("optional[str]", None),  # None, "direct", "flattened_bucket", ...
            "flush_cache": ("bool", True),
            "abort_all_requests": ("bool", False),
            "weight_version": ("optional[str]", None),
            "disable_draft_model": ("optional[bool]", None),
            "torch_empty_cache": ("bool", False),  # recent main only
        },
        "reply": "success_message",
    },
    "/pause_generation": {
        "method": "POST",
        "request": "PauseGenerationReqInput",
        "fields": {"mode": ("literal:abort|retract|in_place", "abort")},
        # reply: {"message": "Generation paused successfully.", "status": "ok"}, HTTP 200
        "reply": "status_ok",
    },
    "/continue_generation": {
        "method": "POST",
        "request": "ContinueGenerationReqInput",
        "fields": {"torch_empty_cache": ("bool", True)},  # recent main only
        "reply": "status_ok",
    },
    "/flush_cache": {
        # route takes GET or POST and no JSON body; FlushCacheReqInput.timeout_s
        # (optional[float], default None) exists in io_struct.py but is not a body field of
        # the 0.5.x route. Reply: plain text, HTTP 200, or 400 when requests are still
        # running or waiting ("the operation will not be performed").
        "method": "POST",
        "request": None,
        "fields": {},
        "reply": "text",
    },
    "/get_weight_version": {
        # GET, no body; reply {"weight_version": optional[str]} (ServerArgs.weight_version,
        # "default" unless set at launch or by a successful update carrying weight_version)
        "method": "GET",
        "request": None,
        "fields": {},
        "reply": "weight_version",
    },
}


def _type_ok(value: Any, spec: str) -> bool:
    if spec.startswith("optional["):
        return value is None or _type_ok(value, spec[len("optional[") : -1])
    if spec.startswith("literal:"):
        return isinstance(value, str) and value in spec[len("literal:") :].split("|")
    if spec == "str":
        return isinstance(value, str)
    if spec == "bool":
        return isinstance(value, bool)
    if spec == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spec == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.startswith("list[") and spec.endswith("]"):
        return isinstance(value, list) and all(_type_ok(v, spec[5:-1]) for v in value)
    raise ValueError(f"unknown type spec {spec!r}")


def validate(path: str, method: str, payload: Any) -> list[str]:
    """Problems of one request against the copied schema; an empty list when it conforms.

    Parameters
    ----------
    path : str
        Endpoint path, e.g. "/update_weights_from_distributed".
    method : str
        HTTP method used.
    payload : Any
        Decoded JSON body, or None when the request had no body.

    Returns
    -------
    list of str
        One line per problem: unknown endpoint, wrong method, body on a body-less route,
        missing required field, unknown field, wrong type.
    """
    spec = ENDPOINTS.get(path)
    if spec is None:
        return [f"unknown endpoint {path}"]
    problems = []
    if method != spec["method"]:
        problems.append(f"{path}: method {method}, expected {spec['method']}")
    fields = spec["fields"]
    if spec["request"] is None:
        if payload not in (None, {}):
            problems.append(f"{path}: takes no body, got {payload!r}")
        return problems
    if not isinstance(payload, dict):
        return problems + [f"{path}: body must be a JSON object, got {type(payload).__name__}"]
    for name, (_, default) in fields.items():
        if default is _REQUIRED and name not in payload:
            problems.append(f"{path}: missing required field {name!r}")
    for name, value in payload.items():
        if name not in fields:
            problems.append(f"{path}: unknown field {name!r}")
        elif not _type_ok(value, fields[name][0]):
            problems.append(f"{path}: field {name!r}={value!r} is not {fields[name][0]}")
    return problems
