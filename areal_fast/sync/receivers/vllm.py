"""vLLM as an areal_fast weight-sync receiver: the ``"areal_fast"`` weight-transfer backend.

Built on vLLM 0.32's RL weight-sync API. The backend ``"areal_fast"``
(:func:`register_vllm_backend`) lives in vLLM's worker-side registry
``WeightTransferEngineFactory`` (vLLM 0.32 ``vllm/distributed/weight_transfer/factory.py``)
and is selected with ``LLM(..., weight_transfer_config={"backend": "areal_fast"})``. In every
vLLM worker it joins areal_fast's stand-alone sync group
(:func:`areal_fast.sync.transports.init_sync_group`; rank 0 is the trainer) and receives one
update per ``update_weights`` call with :class:`areal_fast.sync.receiver.WeightReceiver`:
header → accept round (every name, shape and dtype checked against the model's checkpoint
before any byte of weight moves, :func:`check_update_plan`) → buckets streamed into vLLM's
in-place reload (``initialize_layerwise_reload`` → ``model.load_weights`` →
``finalize_layerwise_reload``, the steps of ``model_runner.reload_weights(weights_iterator=
...)``, which redo vLLM's post-load weight processing) → completion round.

Failure semantics per worker: a rejected update (unknown name, wrong shape, uncastable dtype,
version mismatch) or one that never came leaves the model untouched. An update that fails
after weights started to load (the trainer died, a damaged bucket) leaves some layers new and
some old: the worker records it in ``failure`` (reported by the status RPC) and drops its sync
group, which must be re-created with ``init_weight_transfer_engine``. The engines turn this
into "refuse to generate" from the status RPC: the training loop's
(``rollout/vllm_async.py``, ``rollout/vllm_server.py``, which take the shared-memory path,
:meth:`_ReceiverEngineImpl.receive_shared`) and the benchmarks' ``OfflineVLLMEngine`` on a
sync group (``benches/_vllm_offline.py``).

How the backend reaches vLLM's workers: the registry is per process and vLLM's CPU platform
(and CUDA once initialised) starts its workers with ``spawn``, so registering in the driver
is not enough. Pass ``worker_extension_cls=`` :data:`WORKER_EXTENSION`; vLLM imports that
class in every worker before the model is loaded (``WorkerWrapperBase.init_worker``,
``vllm/v1/worker/worker_base.py``), and importing this module with vLLM loaded registers the
backend. The extension also adds the status RPC (:class:`AReaLFastWorkerExtension`).
:func:`vllm_llm_kwargs` returns both arguments for a bare ``vllm.LLM``.

This module imports without vLLM; vLLM is imported when the backend is registered or built.

Source: vLLM 0.32 ``vllm/distributed/weight_transfer/base.py`` (``WeightTransferEngine``),
``factory.py``, ``nccl_engine.py`` (the layerwise-reload pattern),
``vllm/v1/worker/gpu_worker.py`` (``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``), ``vllm/model_executor/model_loader/reload/``
(in-place reload).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from areal_fast.sync.buckets import WIRE_DTYPES as CASTABLE
from areal_fast.sync.receiver import WeightReceiver
from areal_fast.sync.shared_memory import SharedWeightBuffer, WeightBufferSpec, WeightEntry
from areal_fast.sync.transports import (
    TorchDistTransport,
    WeightSyncError,
    WeightSyncTimeout,
    init_sync_group,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAME",
    "WORKER_EXTENSION",
    "AReaLFastInitInfo",
    "AReaLFastUpdateInfo",
    "AReaLFastWorkerExtension",
    "ExpectedWeights",
    "check_update_plan",
    "expected_weights_from_checkpoint",
    "expected_weights_from_parameters",
    "buffer_spec_from_dict",
    "buffer_spec_to_dict",
    "register_vllm_backend",
    "vllm_llm_kwargs",
]

BACKEND_NAME = "areal_fast"
"""Name of the backend in vLLM's ``WeightTransferEngineFactory`` registry."""

ENGINE_CLASS_NAME = "AReaLFastWeightTransferEngine"
"""Attribute of this module that vLLM's lazy registry loads (built on first access)."""

WORKER_EXTENSION = f"{__name__}.AReaLFastWorkerExtension"
"""Qualified name to pass as ``worker_extension_cls`` (registers the backend in each worker)."""


# --------------------------------------------------------------------------- wire payloads


@dataclass
class AReaLFastInitInfo:
    """``init_info`` of the ``"areal_fast"`` backend (the dict given to
    ``LLM.init_weight_transfer_engine({"init_info": {...}})``).

    Attributes
    ----------
    master_port : int
        Port of the sync group's TCP store, hosted by the trainer (rank 0).
    world_size : int
        Ranks in the sync group: 1 (the trainer) + every vLLM worker of every engine.
    rank_offset : int
        Engine ranks that come before this engine's workers. A worker's sync rank is
        ``1 + rank_offset + worker_index`` with ``worker_index = data_parallel_index *
        (TP * PP) + rank`` (so the first engine uses 0). Note: vLLM's own ``"nccl"`` backend
        counts the trainer in its ``rank_offset`` (first engine: 1); this one does not.
    master_address : str
        Address of the trainer's TCP store.
    backend : {"auto", "gloo", "nccl"}
        ``"auto"``: NCCL when the worker's device is CUDA, gloo otherwise.
    timeout : float
        Seconds for the rendezvous and for each step of every update (header, each bucket,
        each status round).
    """

    master_port: int
    world_size: int
    rank_offset: int = 0
    master_address: str = "127.0.0.1"
    backend: str = "auto"
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(
                f"areal_fast backend init: backend = {self.backend!r}, expected "
                "'auto', 'gloo' or 'nccl'"
            )
        if not (isinstance(self.world_size, int) and self.world_size >= 2):
            raise ValueError(
                f"areal_fast backend init: world_size = {self.world_size!r} must "
                "be an int >= 2 (trainer + at least one worker)"
            )
        if not (isinstance(self.rank_offset, int) and self.rank_offset >= 0):
            raise ValueError(
                f"areal_fast backend init: rank_offset = {self.rank_offset!r} must be an int >= 0"
            )
        if not self.timeout > 0:
            raise ValueError(f"areal_fast backend init: timeout = {self.timeout!r} must be > 0")


@dataclass
class AReaLFastUpdateInfo:
    """``update_info`` of the ``"areal_fast"`` backend (``LLM.update_weights({"update_info":
    {...}})``). Everything else (names, shapes, dtypes, version) arrives in the sender's header.

    Attributes
    ----------
    expected_version : int, optional
        Refuse (leaving the model untouched) an update whose header carries another version.
        With ``shared_buffer``: the version of the buffer's weights (required).
    timeout : float, optional
        Override of the init timeout for this update's steps.
    shared_buffer : dict, optional
        Read the update from a trainer's shared-memory slot on this machine instead of the
        sync group (no group needed): a :class:`~areal_fast.sync.shared_memory.WeightBufferSpec`
        as plain data (:func:`buffer_spec_to_dict`). The worker maps the file and loads from it
        in place; the accept check and the failure rules are those of a streamed update.
    """

    expected_version: Optional[int] = None
    timeout: Optional[float] = None
    shared_buffer: Optional[dict] = None

    def __post_init__(self) -> None:
        if self.shared_buffer is not None and self.expected_version is None:
            raise ValueError("update_info.shared_buffer needs update_info.expected_version")
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and 0 < self.timeout < float("inf")
        ):
            raise ValueError(
                f"update_info.timeout = {self.timeout!r} must be a positive, "
                f"finite number of seconds"
            )


def buffer_spec_to_dict(spec: WeightBufferSpec) -> dict[str, Any]:
    """A :class:`WeightBufferSpec` as JSON-able plain data (``update_info.shared_buffer``)."""
    return {
        "path": spec.path,
        "total_bytes": int(spec.total_bytes),
        "entries": [[e.name, list(e.shape), e.dtype, e.offset, e.nbytes] for e in spec.entries],
    }


def buffer_spec_from_dict(data: dict[str, Any]) -> WeightBufferSpec:
    """Inverse of :func:`buffer_spec_to_dict`.

    Raises
    ------
    ValueError
        A missing key or a malformed entry (names it).
    """
    try:
        entries = tuple(
            WeightEntry(str(n), tuple(int(x) for x in shape), str(dt), int(off), int(nb))
            for n, shape, dt, off, nb in data["entries"]
        )
        return WeightBufferSpec(str(data["path"]), int(data["total_bytes"]), entries)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"update_info.shared_buffer is malformed: {exc!r}") from None


# --------------------------------------------------------------------------- accept check


@dataclass
class ExpectedWeights:
    """The checkpoint-format weights a vLLM model loads, for the accept round.

    Attributes
    ----------
    shapes : dict[str, tuple[int, ...] or None]
        Name → full (unsharded) shape; ``None`` where the shape is unknown (see ``source``).
    dtypes : dict[str, str]
        Name → checkpoint dtype name (may be empty).
    required : frozenset[str]
        Names an update must contain (the whole model: vLLM's layerwise reload processes a
        fused layer, e.g. ``qkv_proj``, with whatever arrived, so a partial update would
        corrupt it).
    optional : frozenset[str]
        Names accepted but not required (e.g. ``lm_head.weight`` under tied embeddings, which
        vLLM's loaders skip).
    source : str
        ``"checkpoint"`` (names, shapes and dtypes read from the safetensors headers of the
        model directory) or ``"parameters"`` (names derived from the vLLM model's parameters
        and its ``packed_modules_mapping``; no shapes).
    """

    shapes: dict[str, Optional[tuple[int, ...]]]
    dtypes: dict[str, str]
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    source: str = "checkpoint"


def _spec_fields(spec: Any) -> tuple[str, tuple[int, ...], str]:
    if isinstance(spec, (tuple, list)):
        name, shape, dtype = spec
    else:
        name, shape, dtype = spec.name, spec.shape, spec.dtype
    return str(name), tuple(int(s) for s in shape), str(dtype).removeprefix("torch.")


def check_update_plan(specs: Iterable[Any], expected: ExpectedWeights) -> str:
    """The accept verdict for an incoming update: '' to accept, else a one-line reason.

    Checks, before any weight moves: every incoming name is a weight the model loads; its
    shape equals the checkpoint's (when known); its wire dtype equals the checkpoint's or
    both are in {float32, bfloat16, float16} (vLLM's loaders cast on copy); no name arrives
    twice; and every required name arrives (a complete update).

    Parameters
    ----------
    specs : iterable of TensorSpec or (name, shape, dtype-name)
        ``BucketPlan.specs`` of the update (:mod:`areal_fast.sync.buckets`).
    expected : ExpectedWeights

    Returns
    -------
    str
        '' or the reason naming the first offending tensor.
    """
    seen: set[str] = set()
    for spec in specs:
        name, shape, dtype = _spec_fields(spec)
        if name in seen:
            return f"tensor {name!r} arrives twice"
        seen.add(name)
        if name not in expected.shapes:
            return (
                f"tensor {name!r} is not a weight of this vLLM model "
                f"(checked against its {expected.source})"
            )
        want = expected.shapes[name]
        if want is not None and tuple(want) != shape:
            return f"tensor {name!r} has shape {shape}, the model's checkpoint has {tuple(want)}"
        have = expected.dtypes.get(name)
        if have is not None and have != dtype and not (have in CASTABLE and dtype in CASTABLE):
            return f"tensor {name!r} arrives as {dtype}, which cannot be cast to {have}"
        if have is None and dtype not in CASTABLE and dtype not in ("int64", "int32", "uint8"):
            return f"tensor {name!r} arrives as {dtype}, which vLLM cannot load here"
    missing = sorted(expected.required - seen)
    if missing:
        return (
            f"update misses {len(missing)} of the model's {len(expected.required)} weights, "
            f"first {missing[0]!r} (only complete updates are accepted)"
        )
    return ""


def _checkpoint_files(model: str, revision: Optional[str]) -> list[Path]:
    """The safetensors files vLLM loads for ``model`` (a local directory, or a hub id already
    in the local Hugging Face cache); [] when none can be found without the network."""
    path = Path(model).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(
                snapshot_download(
                    model,
                    revision=revision,
                    local_files_only=True,
                    allow_patterns=["*.safetensors", "*.json"],
                )
            )
        except Exception:  # not cached, no huggingface_hub, offline: fall back
            return []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({path / f for f in weight_map.values()})
    return sorted(path.glob("*.safetensors"))


def expected_weights_from_checkpoint(
    model: str, revision: Optional[str] = None, tie_word_embeddings: bool = False
) -> Optional[ExpectedWeights]:
    """Names, shapes and dtypes of ``model``'s safetensors checkpoint (headers only, cheap).

    Parameters
    ----------
    model : str
        Local model directory, or a hub id present in the local Hugging Face cache.
    revision : str, optional
    tie_word_embeddings : bool
        The model ties ``lm_head`` to the input embedding: ``lm_head.weight`` becomes
        optional (vLLM's loaders skip it) with the embedding's shape.

    Returns
    -------
    ExpectedWeights or None
        ``None`` when no safetensors checkpoint is found.
    """
    files = _checkpoint_files(model, revision)
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, Optional[tuple[int, ...]]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shapes[name] = tuple(int(s) for s in piece.get_shape())
                dtypes[name] = _safetensors_dtype(piece.get_dtype())
    # Buffers some exporters save that vLLM computes itself.
    required = {n for n in shapes if not n.endswith("rotary_emb.inv_freq")}
    optional: set[str] = set(shapes) - required
    if tie_word_embeddings:
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        head = "lm_head.weight"
        if head not in shapes and embed is not None:
            shapes[head], dtypes[head] = shapes[embed], dtypes[embed]
        required.discard(head)
        optional.add(head)
    return ExpectedWeights(
        shapes, dtypes, frozenset(required), frozenset(optional), source="checkpoint"
    )


_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _safetensors_dtype(code: str) -> str:
    return _ST_DTYPES.get(code, code.lower())


def expected_weights_from_parameters(
    model: torch.nn.Module, tie_word_embeddings: bool = False
) -> ExpectedWeights:
    """Fallback when no checkpoint is on disk: checkpoint names derived from the vLLM model.

    Each parameter name whose module is a fused one in ``model.packed_modules_mapping``
    (e.g. ``qkv_proj`` → ``q_proj, k_proj, v_proj``) is expanded into the checkpoint names.
    Only names are checked (fused and sharded shapes differ from the checkpoint's), and only
    for models whose vLLM names equal their Hugging Face names up to that fusion.

    Returns
    -------
    ExpectedWeights
        ``source = "parameters"``, all shapes ``None``.
    """
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    names: set[str] = set()
    for name, _ in model.named_parameters():
        name = name.replace(".base_layer.", ".")
        parts = name.split(".")
        expanded = False
        for i, part in enumerate(parts):
            if part in packed:
                for sub in packed[part]:
                    names.add(".".join(parts[:i] + [sub] + parts[i + 1 :]))
                expanded = True
                break
        if not expanded:
            names.add(name)
    optional = set()
    if tie_word_embeddings:
        names.discard("lm_head.weight")
        optional.add("lm_head.weight")
    shapes: dict[str, Optional[tuple[int, ...]]] = {n: None for n in names | optional}
    return ExpectedWeights(shapes, {}, frozenset(names), frozenset(optional), source="parameters")


# --------------------------------------------------------------------------- worker backend


def _tied_secondary_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding a parameter that an earlier module (in ``named_modules`` order) owns,
    e.g. a tied ``lm_head`` sharing ``embed_tokens.weight``."""
    owner: dict[int, str] = {}
    tied: list[tuple[str, torch.nn.Module]] = []
    for module_name, module in model.named_modules():
        for param in module._parameters.values():
            if param is None:
                continue
            if id(param) in owner and owner[id(param)] != module_name:
                tied.append((module_name, module))
                break
            owner.setdefault(id(param), module_name)
    return tied


def _reprocess_tied(tied: list[tuple[str, torch.nn.Module]]) -> None:
    """Redo the post-load processing of tied modules the checkpoint does not name.

    vLLM's loaders skip ``lm_head.weight`` under tied embeddings, so the layerwise reload
    never processes the ``lm_head`` module; on the CPU backend its processing packed the
    (old) embedding into a oneDNN / SGL GEMM handle (``dispatch_cpu_unquantized_gemm``,
    vLLM 0.32 ``model_executor/layers/utils.py``), so logits would keep using the old head.
    Only unquantized methods are redone (their processing is idempotent: it rebuilds the
    handle from the current weight).
    """
    for _, module in tied:
        method = getattr(module, "quant_method", None)
        if method is None or "Unquantized" not in type(method).__name__:
            continue
        process = getattr(method, "process_weights_after_loading", None)
        if callable(process):
            process(module)


class _ReceiverEngineImpl:
    """The logic of the ``"areal_fast"`` backend; mixed into vLLM's ``WeightTransferEngine``
    by :func:`_build_engine_class` (so this module imports without vLLM).

    State (per vLLM worker): the sync endpoint, the weight version installed last, and
    ``failure`` — non-empty from an update that failed after weights started to load until
    a complete update lands.
    """

    init_info_cls = AReaLFastInitInfo
    update_info_cls = AReaLFastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)  # type: ignore[call-arg]
        self._transport: Optional[TorchDistTransport] = None
        self._receiver: Optional[WeightReceiver] = None
        self._init: Optional[AReaLFastInitInfo] = None
        self._rank: Optional[int] = None
        self._expected: Optional[ExpectedWeights] = None
        self.weight_version: Optional[int] = None
        self.failure = ""
        self.last: dict[str, Any] = {}
        self._buffers: dict[str, SharedWeightBuffer] = {}  # mapped trainer slots, by path

    # -- lifecycle ------------------------------------------------------------------------

    def _worker_index(self) -> int:
        pc = self.parallel_config  # type: ignore[attr-defined]
        dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        return dp_index * int(pc.world_size) + int(pc.rank)

    def init_transfer_engine(self, init_info: AReaLFastInitInfo) -> None:
        """Join the trainer's sync group (blocks until every rank joined or the timeout).

        Raises
        ------
        ValueError
            This worker's rank does not fit ``world_size``.
        WeightSyncTimeout, WeightSyncError
            The rendezvous failed.
        """
        self.shutdown()
        device = torch.device(self.device)  # type: ignore[attr-defined]
        backend = init_info.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        rank = 1 + init_info.rank_offset + self._worker_index()
        if rank >= init_info.world_size:
            raise ValueError(
                f"areal_fast backend: worker sync rank {rank} (rank_offset "
                f"{init_info.rank_offset}) does not fit world_size "
                f"{init_info.world_size}"
            )
        group = init_sync_group(
            rank,
            init_info.world_size,
            init_info.master_port,
            master_addr=init_info.master_address,
            backend=backend,
            timeout=init_info.timeout,
            device=device if backend == "nccl" else None,
        )
        self._transport = TorchDistTransport(
            group, backend, device=device if backend == "nccl" else torch.device("cpu")
        )
        self._receiver = WeightReceiver(self._transport, timeout=init_info.timeout)
        self._init, self._rank = init_info, rank
        logger.info(
            "areal_fast weight sync: worker joined as rank %d of %d (%s)",
            rank,
            init_info.world_size,
            backend,
        )

    def start_weight_update(self) -> None:
        """No-op: the layerwise reload starts inside :meth:`receive_weights` (or
        :meth:`receive_shared`), after the accept check, so a rejected or timed-out update
        never touches the model. A streamed update without a sync group fails there."""

    def finish_weight_update(self) -> None:
        """No-op: :meth:`receive_weights` finalises the reload itself (also on failure)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse ``update_info`` and receive one complete update.

        Overrides the base method, whose ``torch.accelerator.synchronize()`` raises on a CPU
        build ("Cannot access accelerator device when none is available").
        """
        typed = self.parse_update_info(update_info)  # type: ignore[attr-defined]
        if typed.shared_buffer is not None:
            self.receive_shared(typed)
        else:
            self.receive_weights(typed)
        if torch.device(self.device).type == "cuda":  # type: ignore[attr-defined]
            torch.cuda.synchronize(self.device)  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Close the sync endpoint (the worker keeps serving)."""
        if self._transport is not None:
            try:
                self._transport.close()
            except Exception:  # a broken group may fail to shut down; it is dropped anyway
                pass
        self._transport, self._receiver = None, None

    # -- the update -----------------------------------------------------------------------

    def expected_weights(self) -> ExpectedWeights:
        """What the accept round checks against (computed once, while parameters are real)."""
        if self._expected is None:
            mc = self.model_config  # type: ignore[attr-defined]
            text_config = getattr(mc, "hf_text_config", None) or mc.hf_config
            tied = bool(getattr(text_config, "tie_word_embeddings", False))
            expected = None
            try:
                expected = expected_weights_from_checkpoint(
                    str(mc.model), getattr(mc, "revision", None), tied
                )
            except Exception as exc:  # unreadable checkpoint: fall back to parameter names
                logger.warning(
                    "areal_fast weight sync: cannot read the checkpoint index of "
                    "%s (%s); checking names only",
                    mc.model,
                    exc,
                )
            self._expected = expected or expected_weights_from_parameters(self.model, tied)
        return self._expected

    def receive_weights(self, update_info: AReaLFastUpdateInfo) -> None:
        """Receive one update and load it in place.

        Steps: header + accept round (:func:`check_update_plan`; the model is untouched if
        anyone rejects) → version check → ``initialize_layerwise_reload`` →
        ``model.load_weights(session.named_tensors())`` (buckets stream in while earlier
        tensors load) → ``finalize_layerwise_reload`` (always, so no layer stays on the meta
        device) → check that every parameter was loaded → ``session.finish``.

        The sync group survives a rejection, a version mismatch and a load failure whose
        completion round still ran (:meth:`ReceiveSession.finish` drained the buckets and
        reported); it is dropped (``status()["connected"]`` False; re-create it with
        ``init_weight_transfer_engine``) when the transport broke: a timeout, the trainer
        died, a failed collective (``Transport.broken``).

        Raises
        ------
        RuntimeError
            Not connected.
        WeightSyncError, WeightSyncTimeout
            Rejected or timed out (model untouched; ``self.failure`` unchanged), or failed
            part-way (``self.failure`` set: some layers hold new weights).
        """
        if self._receiver is None:
            raise RuntimeError(
                "areal_fast weight sync is not connected: call init_weight_transfer_engine first"
            )
        receiver, init = self._receiver, self._init
        assert init is not None
        receiver.timeout = float(
            update_info.timeout if update_info.timeout is not None else init.timeout
        )
        expected = self.expected_weights()
        start = time.perf_counter()
        self.last = {
            "outcome": "receiving",
            "version": None,
            "message": "",
            "seconds": 0.0,
            "num_tensors": 0,
        }
        try:
            session = receiver.start(accept=lambda plan: check_update_plan(plan.specs, expected))
        except BaseException as exc:
            # A clean rejection ran the accept round on every rank: the group stays usable.
            # Anything else (timeout, broken transport, a header that never parsed) may leave
            # a half-finished collective: drop the group.
            rejected = (
                isinstance(exc, WeightSyncError)
                and not isinstance(exc, WeightSyncTimeout)
                and str(exc).startswith("weight update rejected")
                and receiver.transport.broken is None
            )
            if not rejected:
                self.shutdown()
            self._record("rejected" if rejected else "no-update", None, str(exc), start, 0)
            raise
        start = time.perf_counter()  # header received: time the transfer + load from here
        if (
            update_info.expected_version is not None
            and session.version != update_info.expected_version
        ):
            message = (
                f"engine expected weight version {update_info.expected_version}, "
                f"the trainer sent {session.version}"
            )
            if not self._finish_quietly(session, message):
                self.shutdown()
            self._record("rejected", session.version, message, start, 0)
            raise WeightSyncError(f"weight update rejected, nothing changed: {message}")

        count = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in session.named_tensors():
                count[0] += 1
                yield name, tensor

        try:
            loaded = self._load(counted())
            missing = self._unloaded(loaded)
            if missing:
                raise WeightSyncError(
                    f"vLLM did not load {len(missing)} parameters, first {missing[0]!r}"
                )
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            self.failure = (
                f"update to v{session.version} failed after weights started to load ({message})"
            )
            if not self._finish_quietly(session, message):
                self.shutdown()
            self._record("failed", session.version, message, start, count[0])
            raise WeightSyncError(self.failure) from exc
        try:
            session.finish("")
        except Exception as exc:  # installed completely; only the report got lost
            logger.warning(
                "areal_fast weight sync: v%d installed, but reporting it failed: %s",
                session.version,
                exc,
            )
            self.shutdown()
        self.weight_version, self.failure = session.version, ""
        self._record("installed", session.version, "", start, count[0])

    def receive_shared(self, update_info: AReaLFastUpdateInfo) -> None:
        """Load one complete update from a trainer's shared-memory slot, in place.

        Steps: map the slot (cached by path: the trainer alternates two) → accept check of
        its layout (:func:`check_update_plan`; nothing changes if it fails) → the layerwise
        reload from views of the mapped file (the only copy is into vLLM's parameters) →
        check that every parameter was loaded.

        Raises
        ------
        WeightSyncError
            Rejected, or the slot is gone (the model is untouched; ``failure`` unchanged), or
            the load failed part-way (``failure`` set: some layers hold new weights).
        """
        assert update_info.shared_buffer is not None and update_info.expected_version is not None
        version = int(update_info.expected_version)
        start = time.perf_counter()
        try:
            spec = buffer_spec_from_dict(update_info.shared_buffer)
            specs = [(e.name, e.shape, e.dtype) for e in spec.entries]
            verdict = check_update_plan(specs, self.expected_weights())
            if verdict:
                raise WeightSyncError(verdict)
            buffer = self._buffers.get(spec.path)
            if buffer is None or buffer.spec != spec:
                buffer = self._buffers[spec.path] = SharedWeightBuffer.attach(spec)
                for path in list(self._buffers)[:-2]:  # keep the two newest slots mapped
                    self._buffers.pop(path).close()
        except (WeightSyncError, ValueError, OSError) as exc:
            message = str(exc)
            self._record("rejected", version, message, start, 0)
            raise WeightSyncError(f"weight update rejected, nothing changed: {message}") from None
        count = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in buffer.named_tensors():
                count[0] += 1
                yield name, tensor

        try:
            missing = self._unloaded(self._load(counted()))
            if missing:
                raise WeightSyncError(
                    f"vLLM did not load {len(missing)} parameters, first {missing[0]!r}"
                )
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            self.failure = f"update to v{version} failed after weights started to load ({message})"
            self._record("failed", version, message, start, count[0])
            raise WeightSyncError(self.failure) from exc
        self.weight_version, self.failure = version, ""
        self._record("installed", version, "", start, count[0])

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Optional[set]:
        """``model_runner.reload_weights(weights_iterator=...)`` semantics (vLLM 0.32
        ``model_loader/reload/inplace.py``), with the finalize step also run on failure."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        try:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )
        except ImportError:  # older/newer layouts
            from contextlib import nullcontext as disable_mtp_completeness_check

        model = self.model  # type: ignore[attr-defined]
        tied = _tied_secondary_modules(model)
        initialize_layerwise_reload(model)
        try:
            with disable_mtp_completeness_check():
                return model.load_weights(weights)
        finally:
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
            _reprocess_tied(tied)

    def _unloaded(self, loaded: Optional[set]) -> list[str]:
        if loaded is None:
            return []
        lora = getattr(self.vllm_config, "lora_config", None)  # type: ignore[attr-defined]
        names = {
            n.replace(".base_layer.", ".") if lora else n for n, _ in self.model.named_parameters()
        }  # type: ignore[attr-defined]
        return sorted(names - set(loaded))

    @staticmethod
    def _finish_quietly(session, message: str) -> bool:
        """``session.finish(message)``; False (logged, not raised) when the completion round
        could not run, i.e. the group is broken (the sender died, a collective failed)."""
        try:
            session.finish(message)
        except Exception as exc:  # the trainer is likely gone; the original error matters
            logger.warning("areal_fast weight sync: could not report failure: %s", exc)
            return False
        return True

    def _record(
        self, outcome: str, version: Optional[int], message: str, start: float, num_tensors: int
    ) -> None:
        self.last = {
            "outcome": outcome,
            "version": version,
            "message": message[:2000],
            "seconds": time.perf_counter() - start,
            "num_tensors": num_tensors,
        }

    def status(self) -> dict[str, Any]:
        """Plain-data state of this worker's receiver (sent back over ``collective_rpc``)."""
        return {
            "connected": self._receiver is not None,
            "rank": self._rank,
            "weight_version": self.weight_version,
            "failure": self.failure,
            "last": dict(self.last),
            "checked_against": self._expected.source if self._expected else None,
        }


_ENGINE_CLASS: Optional[type] = None


def _build_engine_class() -> type:
    """``AReaLFastWeightTransferEngine(_ReceiverEngineImpl, WeightTransferEngine)``."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine

        class AReaLFastWeightTransferEngine(_ReceiverEngineImpl, WeightTransferEngine):
            """vLLM weight-transfer engine of the ``"areal_fast"`` backend (the logic is
            :class:`_ReceiverEngineImpl`).

            Source: vLLM 0.32 vllm/distributed/weight_transfer/base.py (WeightTransferEngine).
            """

        AReaLFastWeightTransferEngine.__module__ = __name__
        _ENGINE_CLASS = AReaLFastWeightTransferEngine
    return _ENGINE_CLASS


def __getattr__(name: str):  # PEP 562: vLLM's lazy registry loads the class by name
    if name == ENGINE_CLASS_NAME:
        return _build_engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_vllm_backend() -> None:
    """Register ``"areal_fast"`` in vLLM's ``WeightTransferEngineFactory`` (idempotent).

    Uses ``WeightTransferEngineFactory.register_engine(name, module_path, class_name)``, the
    lazy form: the engine class is built when vLLM first creates an engine.

    Raises
    ------
    ImportError
        vLLM is not installed.

    Source
    ------
    vLLM 0.32 vllm/distributed/weight_transfer/factory.py.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, ENGINE_CLASS_NAME)
    except ValueError:  # "already registered" (this module, imported again)
        pass


class AReaLFastWorkerExtension:
    """vLLM worker extension (``worker_extension_cls=WORKER_EXTENSION``).

    Importing it in a worker registers the backend (module import side effect, see the
    module docstring); its methods are called with ``LLM.collective_rpc(name)``.

    Source: vLLM 0.32 vllm/v1/worker/worker_base.py (``worker_extension_cls`` injection).
    """

    def areal_fast_sync_status(self) -> dict[str, Any]:
        """This worker's receiver state (:meth:`_ReceiverEngineImpl.status`), or
        ``{"configured": False}`` when the worker has no areal_fast backend."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not isinstance(engine, _ReceiverEngineImpl):
            return {"configured": False}
        return {"configured": True, **engine.status()}

    def areal_fast_after_update(self) -> None:
        """Drop worker caches computed with the old weights (encoder / multimodal)."""
        for method in ("reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self, method, None)
            if callable(fn):
                fn()


def vllm_llm_kwargs() -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments that switch the backend on (for a bare ``LLM``)::

        LLM(model=..., **vllm_llm_kwargs())

    Returns
    -------
    dict
        ``weight_transfer_config`` and ``worker_extension_cls``.
    """
    return {
        "weight_transfer_config": {"backend": BACKEND_NAME},
        "worker_extension_cls": WORKER_EXTENSION,
    }


if "vllm" in sys.modules:  # inside a vLLM worker (or a driver that imported vLLM already)
    try:
        register_vllm_backend()
    except ImportError:  # a partial vLLM install: the backend is simply not available
        pass
