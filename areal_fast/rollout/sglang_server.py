"""An SGLang server as a rollout worker's engine (``rollout.engine: sglang_server``).

:class:`SGLangServerEngine` is a :class:`~areal_fast.rollout.loop_engine.LoopEngine` that
drives one running SGLang server over its HTTP API; it never starts one. Each sample is one
``POST /generate`` with token ids in (``input_ids``), ``return_logprob: true`` and
``sampling_params`` {temperature, top_p, max_new_tokens, sampling_seed}; the reply's
``output_ids``, ``meta_info.output_token_logprobs`` ([log-prob, token id, text] per token)
and ``meta_info.finish_reason`` ({"type": "stop" | "length" | "abort", ...}) become a
:class:`~areal_fast.rollout.engine.GenOutput`.

Behaviour log-probs: SGLang reports the log-prob of each sampled token after temperature
scaling unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (then before it);
the trainer recomputes them at the rollout temperature, so that variable must stay unset.

Pausing (``rollout.pause_mode``):

- ``abort``: ``POST /pause_generation {"mode": "abort"}``; SGLang aborts every running
  request, each ``/generate`` returns its partial tokens with finish reason "abort". Weight
  updates flush the prefix (radix) cache (``flush_cache: true``). Every token of such a
  request carries the version it started under.
- ``keep``: ``{"mode": "in_place"}``; requests stay in the scheduler with their KV cache and
  continue after ``POST /continue_generation`` under the new weights. The cache cannot be
  flushed while requests are kept, so the update is sent with ``flush_cache: false`` and
  every request carries ``cache_salt`` = the version it started under: a new request never
  reuses KV computed by other weights. The seam inside a kept request comes from
  ``meta_info.weight_versions`` (spans ``{"version", "start", "end"}`` over output tokens,
  reported by recent SGLang). A server that reports no spans cannot say where the seam
  is: a kept request that crossed an update then fails with an
  :class:`~areal_fast.rollout.loop_engine.EngineError` saying to use ``pause_mode: abort``
  (its tokens are never labelled with a guessed version).

Version labels: at start the engine sets the server's label to its version
(``POST /update_weight_version``) and every update carries ``weight_version: str(v)``.

Weights: SGLang documents no route that reads a shared-memory file of another process in
place. :meth:`update_weights` and :meth:`update_weights_from_buffer` (which maps the
trainer's slot and hands its tensors over) use ``POST /update_weights_from_tensor``: one
payload per tensor-parallel rank, made by SGLang's own ``MultiprocessingSerializer`` (CUDA
IPC handles for CUDA tensors, torch's shared-memory handles for CPU ones), so the rollout
worker needs ``sglang`` importable, or a ``serializer`` of the same format. A trainer on
other GPUs uses :meth:`update_weights_distributed` (``/update_weights_from_distributed``:
SGLang receives the trainer's NCCL broadcast; the group is set up through
:attr:`weight_client`, a :class:`~areal_fast.sync.receivers.sglang.SGLangWeightClient`).
A failed update leaves the server paused (it serves nothing) and the engine failed.

Source: SGLang HTTP API, ``python/sglang/srt/managers/io_struct.py`` @ sgl-project/sglang
001067fffe33 (GenerateReqInput, AbortReq, PauseGenerationReqInput,
UpdateWeightVersionReqInput), ``python/sglang/srt/utils/weight_versions.py``
(``meta_info.weight_versions``), ``python/sglang/srt/layers/sampler.py``
(``SGLANG_RETURN_ORIGINAL_LOGPROB``); the request schemas the contract tests check are in
tests/sync/receivers/sglang_schema.py and tests/rollout/sglang_generate_schema.py.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from areal_fast.rollout.engine import GenOutput, GenRequest
from areal_fast.rollout.http_json import JsonHttpClient, expect_dict, one_line
from areal_fast.rollout.loop_engine import EngineError, LoopEngine, spans_to_versions
from areal_fast.sync.receivers.sglang import SGLangWeightClient
from areal_fast.sync.shared_memory import SharedWeightBuffer, WeightBufferSpec

SGLANG_MISSING = (
    "rollout.engine = 'sglang_server' loads weights through SGLang's MultiprocessingSerializer, "
    "and sglang is not installed in this environment: `pip install sglang` (or pass a "
    "serializer)"
)

_FINISH_TYPES = ("stop", "length", "abort")
_SEED_MASK = (1 << 63) - 1


def _sglang_serializer(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise ImportError(SGLANG_MISSING) from exc
    return MultiprocessingSerializer.serialize(named_tensors)


def parse_generate_reply(reply: Any, where: str, rid: int, default_version: int) -> GenOutput:
    """A :class:`GenOutput` from SGLang's ``/generate`` reply (one request, not streamed).

    Parameters
    ----------
    reply : Any
        The decoded JSON reply: ``{"output_ids": [int], "meta_info": {"finish_reason":
        {"type": str, ...} | None, "output_token_logprobs": [[float, int, str | None]],
        "weight_versions": [{"version": str, "start": int, "end": int}] (optional)}}``.
    where : str
        Names the engine and endpoint in errors.
    rid : int
        The request's id.
    default_version : int
        Version of tokens no span covers (the version the request started under).

    Returns
    -------
    GenOutput
        ``versions`` from the spans when the reply has them, else ``default_version`` for
        every token; ``stop_reason`` "stop", "length" or "abort".

    Raises
    ------
    EngineError
        A reply without ``output_ids`` or ``meta_info``, log-probs that do not match the
        tokens, an unknown finish reason, or a span label that is not an integer.
    """
    reply = expect_dict(reply, where)
    tokens, meta = reply.get("output_ids"), reply.get("meta_info")
    if not isinstance(tokens, list) or not isinstance(meta, dict):
        raise EngineError(f"{where}: reply has no output_ids list or meta_info object")
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(tokens):
        raise EngineError(
            f"{where}: request {rid} returned {len(tokens)} tokens but {len(entries)} log-probs"
        )
    logprobs = []
    for token, entry in zip(tokens, entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[1] != token:
            raise EngineError(
                f"{where}: request {rid}: log-prob entry {one_line(entry)} does not belong to "
                f"token {token}"
            )
        logprobs.append(float(entry[0]))
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH_TYPES:
        raise EngineError(f"{where}: request {rid}: unknown finish_reason {one_line(finish)}")
    try:
        versions = spans_to_versions(meta.get("weight_versions"), len(tokens), default_version)
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"{where}: request {rid}: bad weight_versions: {exc}") from None
    return GenOutput(rid, [int(t) for t in tokens], logprobs, versions, kind)


class SGLangServerEngine(LoopEngine):
    """``rollout.engine: sglang_server``: a running SGLang server driven as an
    AsyncInferenceEngine (see the module docstring).

    Parameters
    ----------
    server_url : str
        ``http://host:port`` of the SGLang server.
    max_running : int
        Requests inside the server at most (>= 1).
    pause_mode : {"abort", "keep"}
        SGLang pause mode "abort" or "in_place".
    call_timeout : float
        Seconds any HTTP call may take, a whole ``/generate`` included.
    api_key : str, optional
        The server's ``--api-key`` (sent as a bearer token).
    initial_version : int
        Version label the server's current weights get at start.
    tp_size : int
        Tensor-parallel ranks of the server (payloads per tensor update).
    serializer : callable, optional
        ``[(name, tensor)] -> bytes`` in SGLang's ``MultiprocessingSerializer`` format
        (default: SGLang's own, imported when the first update runs).

    Raises
    ------
    ValueError
        A malformed ``server_url``, ``max_running`` < 1, an unknown ``pause_mode``,
        ``tp_size`` < 1.
    """

    def __init__(
        self,
        server_url: str,
        *,
        max_running: int,
        pause_mode: str = "abort",
        call_timeout: float = 600.0,
        api_key: Optional[str] = None,
        initial_version: int = 0,
        tp_size: int = 1,
        serializer: Optional[Callable[[list[tuple[str, torch.Tensor]]], bytes]] = None,
    ):
        name = f"SGLang server engine ({server_url})"
        super().__init__(name, max_running, pause_mode, initial_version, call_timeout)
        if tp_size < 1:
            raise ValueError(f"tp_size = {tp_size} must be >= 1")
        self.http = JsonHttpClient(server_url, name, call_timeout, api_key)
        self.weight_client = SGLangWeightClient(self.http.base_url, call_timeout, api_key)
        self.tp_size = int(tp_size)
        self._serializer = serializer or _sglang_serializer
        self._ids = itertools.count()
        self._kept_updates = 0  # updates installed while requests were kept in place

    # ------------------------------------------------------------ LoopEngine hooks

    async def _engine_open(self) -> None:
        await self.http.open()
        await self.http.post(
            "/update_weight_version",
            {"new_version": str(self.version), "abort_all_requests": False},
            empty_ok=True,
        )

    async def _engine_generate(self, request: GenRequest, salt: str) -> GenOutput:
        start_version, kept_updates = self.version, self._kept_updates
        payload = {
            "rid": f"areal-{request.rid}-{next(self._ids)}",
            "input_ids": list(request.input_ids),
            "sampling_params": {
                "temperature": float(request.temperature),
                "top_p": float(request.top_p),
                "max_new_tokens": int(request.max_new_tokens),
                # a resumed sample continues with a seed of its own position
                "sampling_seed": (request.seed ^ request.offset) & _SEED_MASK,
            },
            "return_logprob": True,
            "cache_salt": salt,
        }
        reply = await self.http.post("/generate", payload)
        where = f"{self.name}: POST /generate"
        output = parse_generate_reply(reply, where, request.rid, start_version)
        spans = expect_dict(reply, where)["meta_info"].get("weight_versions")
        if not spans and self._kept_updates != kept_updates:
            raise EngineError(
                f"{where}: request {request.rid} was kept across a weight update but the "
                "server reports no meta_info.weight_versions, so its seam is unknown; use "
                "rollout.pause_mode: abort with this SGLang version"
            )
        return output

    async def _engine_pause(self, keep: bool) -> None:
        await self.http.post(
            "/pause_generation", {"mode": "in_place" if keep else "abort"}, empty_ok=True
        )

    async def _engine_resume(self) -> None:
        await self.http.post("/continue_generation", {}, empty_ok=True)

    async def _engine_load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        tensors = [(name, tensor) for name, tensor in named_tensors]
        loop = asyncio.get_running_loop()
        payload = await loop.run_in_executor(None, self._serializer, tensors)
        encoded = base64.b64encode(bytes(payload)).decode("ascii")
        flush = not self._kept
        await loop.run_in_executor(
            None,
            lambda: self.weight_client.update_weights_from_tensor(
                [encoded] * self.tp_size, flush_cache=flush, weight_version=str(version)
            ),
        )
        if self._kept:
            self._kept_updates += 1

    async def _engine_load_buffer(self, spec: WeightBufferSpec, version: int) -> None:
        buffer = SharedWeightBuffer.attach(spec)
        try:
            await self._engine_load_tensors(buffer.named_tensors(), version)
        finally:
            buffer.close()

    async def _engine_close(self) -> None:
        await self.http.close()

    # ------------------------------------------------------------ distributed update

    def update_weights_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        broadcast: Callable[[], None],
        version: int,
        *,
        group_name: str = "areal_fast",
        load_format: Optional[str] = None,
    ) -> None:
        """Install weights the trainer broadcasts over the group set up with
        ``weight_client.init_weights_update_group`` (``/update_weights_from_distributed``),
        labelled ``version``; only while paused. ``broadcast`` runs in the caller's thread
        while SGLang receives (see :meth:`SGLangWeightClient.update_weights_from_distributed`
        for names, dtypes, shapes and ``load_format``).

        Raises
        ------
        RuntimeError
            Not paused.
        ValueError
            Bad names, dtypes or shapes (before anything is sent).
        EngineError
            The update failed (names the engine; the server stays paused).
        """
        self._require_paused("update_weights_distributed")
        self._raise_error()
        try:
            self.weight_client.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name,
                flush_cache=not self._kept,
                weight_version=str(int(version)),
                load_format=load_format,
                broadcast=broadcast,
            )
        except (RuntimeError, TimeoutError) as exc:
            raise EngineError(f"{self.name}: weight update to v{version} failed: {exc}") from exc
        if self._kept:
            self._kept_updates += 1
        self._version = int(version)
