"""A ``vllm.LLM`` (vLLM's offline engine) receiving areal_fast weight updates over a sync group.

The engine of ``vllm_sync_demo.py`` and of the vLLM-lane test of the weight-transfer backend's
sync-group path (``tests/sync/receivers/test_vllm.py``). The training loop's vLLM engines are
``areal_fast/rollout/vllm_async.py`` and ``vllm_server.py``, which read the trainer's
shared-memory slot through the same backend instead.

:class:`OfflineVLLMEngine` builds a ``vllm.LLM`` with the ``"areal_fast"`` weight-transfer
backend switched on (:mod:`areal_fast.sync.receivers.vllm`) and adds

- a token-in/token-out :meth:`OfflineVLLMEngine.generate` whose every :class:`Completion`
  carries the weight version that produced it, and :meth:`OfflineVLLMEngine.prompt_logprobs`
  (one forward pass);
- the trainer-facing :meth:`OfflineVLLMEngine.init_weight_sync` /
  :meth:`OfflineVLLMEngine.update_weights`, which run in a background thread (the trainer
  sends concurrently) and return futures (:class:`UpdateResult` on success).

Atomic-switch rule: the engine never serves a mix of old and new weights. A rejected update
(unknown name, wrong shape, uncastable dtype, version mismatch, no trainer) leaves the model
untouched and it keeps serving the previous version. An update that fails after weights
started to load (the trainer died, a damaged bucket) leaves some layers new and some old: the
engine then refuses to generate (``RuntimeError`` naming the failure) until a complete update
arrives. A failure that broke the sync group (the trainer died, a timeout; the workers'
``sync_status()`` then say ``connected: False``) needs a new group first
(:meth:`OfflineVLLMEngine.init_weight_sync`); after any other failure the next update can
follow at once.

This module imports without vLLM; vLLM is imported when an engine is built.

Source: vLLM 0.32 ``vllm/entrypoints/rl/offline.py`` (the ``LLM`` weight-transfer methods:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``update_weight_version``), ``vllm/outputs.py`` (per-output
``weight_versions``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from areal_fast.sync.receivers.vllm import (
    AReaLFastInitInfo,
    register_vllm_backend,
    vllm_llm_kwargs,
)
from areal_fast.sync.transports import WeightSyncError

logger = logging.getLogger(__name__)

__all__ = ["Completion", "UpdateResult", "OfflineVLLMEngine"]


@dataclass
class Completion:
    """One sampled completion.

    Attributes
    ----------
    token_ids : list[int]
        Generated tokens (length <= ``max_tokens``).
    logprobs : list[float] or None
        Log-probability of each generated token under the weights of ``version``, as vLLM's
        ``logprobs_mode`` defines it (default ``"raw_logprobs"``: the model's log-softmax,
        before temperature / top-p); ``None`` unless requested.
    finish_reason : str or None
        ``"stop"`` / ``"length"``.
    version : int
        Weight version that produced every token (from vLLM's per-output
        ``weight_versions`` spans).
    """

    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]
    version: int


@dataclass
class UpdateResult:
    """Outcome of one successful :meth:`OfflineVLLMEngine.update_weights`.

    Attributes
    ----------
    version : int
        The version now served.
    seconds : float
        Driver wall time from the call, including the wait for the trainer's header, the
        transfer, the load and the cache reset.
    worker_seconds : list[float]
        Per worker: header received → update installed (transfer + load + processing).
    num_tensors : int
        Tensors received by the first worker.
    """

    version: int
    seconds: float
    worker_seconds: list[float] = field(default_factory=list)
    num_tensors: int = 0


class OfflineVLLMEngine:
    """A ``vllm.LLM`` that receives areal_fast weight updates and tags outputs with versions.

    Build it under ``if __name__ == "__main__":`` (vLLM starts processes with ``spawn``).
    Generation and updates are serialised by one lock: a generate call waits for an update in
    flight and vice versa, so no request ever sees a mix of weights.

    Parameters
    ----------
    model : str
        Model directory, hub id, or ``"demo:SmolLM2-135M-Instruct"`` (see
        :func:`areal_fast.models.loading.resolve_model_path`).
    dtype : str
        vLLM dtype ("auto", "float32", "bfloat16", "float16").
    gpu_memory_utilization : float
        Fraction of GPU memory (on CPU: of RAM, for the KV cache) vLLM may use; keep it
        <= 0.3 on a shared CPU machine.
    max_model_len : int, optional
    enforce_eager : bool
    seed : int
    initial_version : int
        Version label of the weights loaded from ``model``.
    **llm_kwargs
        Passed on to ``vllm.LLM`` (not ``weight_transfer_config`` / ``worker_extension_cls``,
        which this class sets).

    Raises
    ------
    ImportError
        vLLM is not installed.
    ValueError
        ``llm_kwargs`` tries to set the weight-transfer backend or worker extension.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        max_model_len: Optional[int] = None,
        enforce_eager: bool = True,
        seed: int = 0,
        initial_version: int = 0,
        **llm_kwargs: Any,
    ):
        for key in ("weight_transfer_config", "worker_extension_cls"):
            if key in llm_kwargs:
                raise ValueError(
                    f"OfflineVLLMEngine sets {key} itself (to the areal_fast backend); "
                    "subclass areal_fast.sync.receivers.vllm."
                    "AReaLFastWorkerExtension to add worker methods"
                )
        register_vllm_backend()
        from vllm import LLM

        from areal_fast.models.loading import resolve_model_path

        kwargs = dict(
            model=resolve_model_path(model),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            **vllm_llm_kwargs(),
            **llm_kwargs,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(**kwargs)
        self._lock = threading.RLock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal-fast-vllm")
        self._version = int(initial_version)
        self._failure: Optional[str] = None
        self.llm.update_weight_version(str(self._version))

    # -- state ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The version served now (the last complete update, or ``initial_version``)."""
        return self._version

    @property
    def failure(self) -> Optional[str]:
        """Why the engine refuses to generate (a failed update), or ``None`` when serving."""
        return self._failure

    def sync_status(self) -> list[dict[str, Any]]:
        """Per-worker receiver state, one dict per vLLM worker.

        Returns
        -------
        list[dict]
            :meth:`areal_fast.sync.receivers.vllm.AReaLFastWorkerExtension.areal_fast_sync_status`
            of every worker: ``connected``, ``rank``, ``weight_version``, ``failure``,
            ``last`` (outcome, version, message, seconds, num_tensors of the last update) and
            ``checked_against`` (``"checkpoint"`` / ``"parameters"``).
        """
        with self._lock:
            return list(self.llm.collective_rpc("areal_fast_sync_status"))

    def _check_serving(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"vLLM engine refuses to generate: {self._failure}. It holds "
                "a mix of old and new weights until a complete update arrives "
                "(update_weights; init_weight_sync first if the sync group "
                "broke, see sync_status())."
            )

    # -- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int = 16,
        logprobs: bool = True,
        top_p: float = 1.0,
        seed: Optional[int] = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of every prompt.

        Parameters
        ----------
        prompts_token_ids : sequence of sequence of int
            ``[num_prompts][prompt_len]`` token ids.
        n, temperature, max_tokens, top_p, seed
            vLLM ``SamplingParams``.
        logprobs : bool
            Return the log-prob of every sampled token.

        Returns
        -------
        list[list[Completion]]
            ``[num_prompts][n]``.

        Raises
        ------
        RuntimeError
            A failed update left the weights incomplete (see :attr:`failure`), or vLLM
            reported more than one weight version inside one output.
        """
        from vllm import SamplingParams

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0 if logprobs else None,
            seed=seed,
        )
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts_token_ids]
        with self._lock:
            self._check_serving()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            served = self._version
        results = []
        for out in outputs:
            row = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                lps = None
                if logprobs:
                    lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
                row.append(
                    Completion(
                        list(c.token_ids), lps, c.finish_reason, self._output_version(c, served)
                    )
                )
            results.append(row)
        return results

    @staticmethod
    def _output_version(completion: Any, served: int) -> int:
        spans = getattr(completion, "weight_versions", None) or []
        labels = {span.version for span in spans}
        if len(labels) > 1:
            raise RuntimeError(
                f"one vLLM output was produced by several weight versions {sorted(labels)}"
            )
        if labels:
            label = labels.pop()
            try:
                return int(label)
            except ValueError:
                pass
        return served

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], return_version: bool = False
    ):
        """Log-probs of ``completion_ids`` after ``prompt_ids`` under the current weights.

        One forward pass over prompt + completion (``SamplingParams(prompt_logprobs=0,
        max_tokens=1)``); vLLM returns the log-prob of every prompt token given its prefix.

        Parameters
        ----------
        prompt_ids, completion_ids : sequence of int
            Non-empty prompt; ``len(prompt) + len(completion) < max_model_len``.
        return_version : bool
            Also return the weight version used.

        Returns
        -------
        list[float] or (list[float], int)
            ``[len(completion_ids)]`` log-probs (raw, temperature-free).

        Raises
        ------
        RuntimeError
            A failed update left the weights incomplete.
        ValueError
            Empty prompt.
        """
        from vllm import SamplingParams

        if not prompt_ids:
            raise ValueError("prompt_logprobs: the prompt must not be empty")
        ids = [int(t) for t in prompt_ids] + [int(t) for t in completion_ids]
        params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
        with self._lock:
            self._check_serving()
            out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            served = self._version
        start = len(prompt_ids)
        values = [float(out.prompt_logprobs[i][ids[i]].logprob) for i in range(start, len(ids))]
        if return_version:
            return values, self._output_version(out.outputs[0], served)
        return values

    # -- weight sync ------------------------------------------------------------------------

    def init_weight_sync(
        self,
        master_port: int,
        rank_offset: int = 0,
        world_size: int = 2,
        timeout: float = 60.0,
        master_address: str = "127.0.0.1",
        backend: str = "auto",
    ) -> "Future[None]":
        """Join the trainer's sync group, in the background (the trainer joins concurrently).

        Parameters
        ----------
        master_port : int
            The port the trainer passes to ``init_sync_group(0, world_size, master_port)``.
        rank_offset : int
            Engine ranks before this engine's workers (first engine: 0; see
            :class:`AReaLFastInitInfo`).
        world_size : int
            1 + all workers of all engines.
        timeout : float
            Rendezvous and per-step timeout of later updates (seconds).
        master_address : str
        backend : {"auto", "gloo", "nccl"}

        Returns
        -------
        concurrent.futures.Future
            Resolves to ``None`` once every worker joined; raises the rendezvous error
            (``Exception`` carrying vLLM's message, e.g. a WeightSyncTimeout text).
        """
        info = asdict(
            AReaLFastInitInfo(
                master_port=int(master_port),
                world_size=int(world_size),
                rank_offset=int(rank_offset),
                master_address=master_address,
                backend=backend,
                timeout=float(timeout),
            )
        )

        def run() -> None:
            with self._lock:
                self.llm.init_weight_transfer_engine({"init_info": info})

        return self._executor.submit(run)

    def update_weights(
        self, version: Optional[int] = None, timeout: Optional[float] = None
    ) -> "Future[UpdateResult]":
        """Receive the trainer's next update, in the background, and switch to it atomically.

        Runs ``start_weight_update`` → ``update_weights`` (blocks while the trainer's
        ``WeightSender.send`` streams the buckets) → ``finish_weight_update(version)`` →
        ``reset_prefix_cache`` (cached KV was computed with the old weights), holding the
        generation lock throughout.

        Parameters
        ----------
        version : int, optional
            The version the trainer sends; another one is rejected before loading.
        timeout : float, optional
            Per-step timeout for this update (default: the one given to init).

        Returns
        -------
        concurrent.futures.Future[UpdateResult]
            Raises :class:`WeightSyncError` when the update was rejected or never came (the
            previous version is still served), or when it failed part-way (the engine then
            refuses to generate until a complete update; :attr:`failure` says why).
        """
        update_info: dict[str, Any] = {"expected_version": version, "timeout": timeout}
        return self._executor.submit(self._update, update_info)

    def _update(self, update_info: dict[str, Any]) -> UpdateResult:
        start = time.perf_counter()
        with self._lock:
            try:
                self.llm.start_weight_update()
            except Exception as exc:  # e.g. not connected; nothing was touched
                message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
                raise WeightSyncError(
                    f"weight update not started, still serving v{self._version}: {message}"
                ) from exc
            try:
                self.llm.update_weights({"update_info": update_info})
            except Exception as exc:
                statuses = self._statuses_quietly()
                broken = [s.get("failure") for s in statuses if s.get("failure")]
                message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
                if broken or not statuses:
                    self._failure = broken[0] if broken else f"weight update failed: {message}"
                    raise WeightSyncError(self._failure) from exc
                raise WeightSyncError(
                    f"weight update not applied, still serving v{self._version}: "
                    f"{statuses[0].get('last', {}).get('message') or message}"
                ) from exc
            statuses = self._statuses_quietly()
            versions = {s.get("weight_version") for s in statuses}
            if len(versions) != 1 or None in versions:
                self._failure = (
                    f"workers disagree on the installed version: {sorted(map(str, versions))}"
                )
                raise WeightSyncError(self._failure)
            new_version = int(versions.pop())
            self.llm.finish_weight_update(weight_version=str(new_version))
            self.llm.collective_rpc("areal_fast_after_update")
            if self.llm.reset_prefix_cache() is False:  # cached KV of the old weights remains
                self._failure = (
                    f"v{new_version} installed, but vLLM could not reset its prefix cache"
                )
                raise WeightSyncError(self._failure)
            self._version, self._failure = new_version, None
        lasts = [s.get("last", {}) for s in statuses]
        return UpdateResult(
            new_version,
            time.perf_counter() - start,
            [float(x.get("seconds", 0.0)) for x in lasts],
            int(lasts[0].get("num_tensors", 0)) if lasts else 0,
        )

    def _statuses_quietly(self) -> list[dict[str, Any]]:
        try:
            return list(self.llm.collective_rpc("areal_fast_sync_status"))
        except Exception as exc:
            logger.warning("areal_fast weight sync: status query failed: %s", exc)
            return []

    # -- teardown -----------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Release the sync group and shut vLLM's engine processes down.

        Parameters
        ----------
        timeout : float
            Seconds to wait for an update or generation in flight before shutting down
            without releasing the sync group politely.
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._lock.acquire(timeout=timeout):
            try:
                self.llm.shutdown_weight_transfer_engine()
            except Exception:  # not connected, or the engine is already gone
                pass
            finally:
                self._lock.release()
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown: Optional[Callable[[], None]] = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def __enter__(self) -> "OfflineVLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
