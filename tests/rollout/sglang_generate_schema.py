"""SGLang's generation request schemas, added to the weight-route copy in
tests/sync/receivers/sglang_schema.py, for the contract tests of SGLangServerEngine.

Read from stored copies of github.com/sgl-project/sglang:

* ``python/sglang/srt/managers/io_struct.py`` @ 001067fffe33427bee0ed2f007fb7551a1d76b44:
  ``GenerateReqInput`` (only the fields a token-in client may send are listed: rid,
  input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num, stream,
  cache_salt; the rest of its ~70 fields are left out, so the validator rejects them),
  ``AbortReq`` (rid, abort_all, finished_reason, abort_message), and
  ``UpdateWeightVersionReqInput`` (new_version: str required, abort_all_requests: bool =
  True).
* ``python/sglang/srt/sampling/sampling_params.py`` (``SamplingParams.__init__``, the keys of
  ``sampling_params``): max_new_tokens (128), temperature (1.0), top_p (1.0), top_k (-1),
  min_p (0.0), n (1), stop, stop_token_ids, ignore_eos (False), skip_special_tokens (True),
  sampling_seed (None).
* ``python/sglang/srt/managers/tokenizer_manager.py``: the reply of a single, not streamed
  ``/generate``: ``{"text": str, "output_ids": [int], "meta_info": {"id": str,
  "finish_reason": {"type": "stop", "matched": int | str} | {"type": "length", "length":
  int} | {"type": "abort", "message": str} | None, "prompt_tokens": int,
  "completion_tokens": int, "cached_tokens": int, "output_token_logprobs": [[logprob,
  token_id, text | None]], "weight_version": str, "weight_versions": [{"version": str,
  "start": int, "end": int}]}}`` (``weight_versions`` from ``utils/weight_versions.py``,
  recent main only). ``/abort_request`` answers HTTP 200 with an empty body,
  ``/update_weight_version`` ``{"success": bool, "message": str}``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def _load_weight_schema():
    path = Path(__file__).parents[1] / "sync" / "receivers" / "sglang_schema.py"
    spec = importlib.util.spec_from_file_location("_areal_fast_sglang_schema_rollout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


schema = _load_weight_schema()
_REQUIRED = schema._REQUIRED

schema.ENDPOINTS.update(
    {
        "/generate": {
            "method": "POST",
            "request": "GenerateReqInput",
            "fields": {
                "rid": ("optional[str]", None),
                "input_ids": ("list[int]", None),
                "sampling_params": ("sampling_params", None),
                "return_logprob": ("optional[bool]", None),
                "logprob_start_len": ("optional[int]", None),
                "top_logprobs_num": ("optional[int]", None),
                "stream": ("bool", False),
                "cache_salt": ("optional[str]", None),
            },
            "reply": "generate",
        },
        "/abort_request": {
            "method": "POST",
            "request": "AbortReq",
            "fields": {
                "rid": ("optional[str]", None),
                "abort_all": ("bool", False),
                "finished_reason": ("optional[str]", None),
                "abort_message": ("optional[str]", None),
            },
            "reply": "empty",
        },
        "/update_weight_version": {
            "method": "POST",
            "request": "UpdateWeightVersionReqInput",
            "fields": {
                "new_version": ("str", _REQUIRED),
                "abort_all_requests": ("bool", True),
            },
            "reply": "success_message",
        },
    }
)

#: ``sampling_params`` keys (SamplingParams.__init__) and their types.
SAMPLING_PARAMS = {
    "max_new_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "n": "int",
    "stop": "list[str]",
    "stop_token_ids": "list[int]",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "sampling_seed": "optional[int]",
}


def validate(path: str, method: str, payload: Any) -> list[str]:
    """Problems of one request (weight and generation routes); empty when it conforms.

    ``sampling_params`` of ``/generate`` is checked key by key against
    :data:`SAMPLING_PARAMS`; ``input_ids`` must be a non-empty list of ints >= 0.
    """
    if path != "/generate" or not isinstance(payload, dict):
        return schema.validate(path, method, payload)
    body = dict(payload)
    params = body.pop("sampling_params", None)
    problems = schema.validate(path, method, body)
    if "input_ids" not in body or not body["input_ids"]:
        problems.append("/generate: input_ids missing or empty (this client sends no text)")
    elif any(not isinstance(t, int) or t < 0 for t in body["input_ids"]):
        problems.append("/generate: input_ids must be ints >= 0")
    if params is not None:
        if not isinstance(params, dict):
            return problems + [f"/generate: sampling_params must be an object, got {params!r}"]
        for key, value in params.items():
            if key not in SAMPLING_PARAMS:
                problems.append(f"/generate: unknown sampling_params key {key!r}")
            elif not schema._type_ok(value, SAMPLING_PARAMS[key]):
                problems.append(
                    f"/generate: sampling_params.{key}={value!r} is not {SAMPLING_PARAMS[key]}"
                )
    return problems
