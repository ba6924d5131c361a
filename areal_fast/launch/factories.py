"""Picklable builders of the real engine and trainer, run inside the worker processes.

Each carries the config dataclasses it builds from (``model.*``, ``rollout.*``, ``actor.*``
sections of :class:`~areal_fast.launch.config.ExperimentConfig`), never copies of their
fields, so a setting has one home and one default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_fast.models.config import ModelConfig
from areal_fast.rollout.config import RolloutConfig
from areal_fast.train.config import ActorConfig


@dataclass
class HFEngineFactory:
    """Builds an :class:`~areal_fast.rollout.hf_engine.HFEngine` and its decode function.

    Attributes
    ----------
    model : ModelConfig
        Which model to load (``path``, ``dtype``, ``attn_implementation``, ``device``).
    rollout : RolloutConfig
        ``max_batch_size``: sequences the engine generates together; ``hf_batching``:
        continuous or static batches.
    """

    model: ModelConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __call__(self):
        from areal_fast.models.loading import load_causal_lm, load_tokenizer
        from areal_fast.rollout.hf_engine import HFEngine

        m = self.model
        tokenizer = load_tokenizer(m.path)
        model = load_causal_lm(m.path, m.dtype, m.attn_implementation, m.device)
        engine = HFEngine(model, tokenizer, self.rollout.max_batch_size, self.rollout.hf_batching)

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=True)

        return engine, decode


@dataclass
class ServingEngineFactory:
    """Builds the engine ``rollout.engine`` names other than hf: vLLM's ``AsyncLLM`` in the
    worker (``vllm``), a ``vllm serve`` it starts or joins (``vllm_server``), or an SGLang
    server (``sglang_server``); and the tokenizer's decode function.

    Attributes
    ----------
    model : ModelConfig
        ``path`` and ``dtype`` (``rollout.vllm.dtype = auto`` takes the model's).
    rollout : RolloutConfig
        ``engine``, ``pause_mode``, ``max_batch_size`` (requests inside the engine at most),
        ``server_url`` and the ``vllm.*`` settings.
    threads : int, optional
        CPU threads of a vLLM engine that this worker starts.
    worker_index : int
        Which ``rollout.server_url`` this worker uses (set per worker by
        :meth:`for_worker`).
    lora_rank : int
        ``actor.lora.rank``: the vLLM engine serves the trainer's adapters (0: no LoRA).
    """

    model: ModelConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    threads: Optional[int] = None
    worker_index: int = 0
    lora_rank: int = 0

    def for_worker(self, name: str) -> "ServingEngineFactory":
        """This factory for rollout worker ``name`` (``rollout-<index>``)."""
        from dataclasses import replace

        return replace(self, worker_index=int(name.rsplit("-", 1)[-1]))

    def __call__(self):
        from areal_fast.models.loading import load_tokenizer, resolve_model_path

        r, v = self.rollout, self.rollout.vllm
        tokenizer = load_tokenizer(self.model.path)
        url = r.server_url[self.worker_index] if r.server_url else None
        if r.engine == "sglang_server":
            from areal_fast.rollout.sglang_server import SGLangServerEngine

            engine = SGLangServerEngine(
                url, max_running=r.max_batch_size, pause_mode=r.pause_mode,
                call_timeout=v.call_timeout,
            )  # fmt: skip
        else:
            config = v.for_model(self.model.dtype)
            kwargs = dict(
                max_running=r.max_batch_size, pause_mode=r.pause_mode, threads=self.threads
            )
            path = resolve_model_path(self.model.path)
            if r.engine == "vllm":
                from areal_fast.rollout.vllm_async import AsyncVLLMEngine

                engine = AsyncVLLMEngine(path, config, lora_rank=self.lora_rank, **kwargs)
            else:
                from areal_fast.rollout.vllm_server import VLLMServerEngine

                engine = VLLMServerEngine(path, config, server_url=url, **kwargs)

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=True)

        return engine, decode


def engine_factory(
    model: ModelConfig,
    rollout: RolloutConfig,
    threads: Optional[int] = None,
    lora_rank: int = 0,
):
    """The factory of ``rollout.engine``: :class:`HFEngineFactory` or
    :class:`ServingEngineFactory` (``lora_rank``: ``actor.lora.rank``, for a vLLM engine)."""
    if rollout.engine == "hf":
        return HFEngineFactory(model, rollout)
    return ServingEngineFactory(model, rollout, threads, lora_rank=lora_rank)


@dataclass
class TorchTrainerFactory:
    """Builds a :class:`~areal_fast.train.torch_engine.TorchTrainEngine` (and its frozen
    reference model when ``actor.loss.kl_coef > 0``, its frozen teacher, loaded and placed as
    the reference is, when ``actor.distill.teacher_path`` is set); with ``world_size > 1`` it
    joins the trainer process group as rank ``rank`` and builds an
    :class:`~areal_fast.train.fsdp.FSDPTrainEngine` (called inside each rank's process; every
    rank then gets its own part of each batch).

    Attributes
    ----------
    model : ModelConfig
        Which model to load and how (``path``, ``dtype``, ``attn_implementation``,
        ``device``; a CUDA trainer group puts each rank on its own GPU). On a CUDA device with
        ``dtype`` bfloat16 or float16 the trainer trains in mixed precision: float32
        parameters, gradients and AdamW state, the decoder computing in ``dtype``
        (:func:`~areal_fast.train.precision.compute_in_dtype`); on the CPU the parameters are
        ``dtype``. Either way the weights are published in ``dtype`` (:attr:`weights_dtype`).
    actor : ActorConfig
        Loss, optimizer and packing settings, handed to the engine as they are.
    rollout : RolloutConfig
        ``temperature``: the sampling temperature the trainer recomputes log-probs at.
    seed : int, optional
        ``torch.manual_seed`` before the model is loaded.
    total_steps : int, optional
        Train steps the learning-rate schedule decays over (None: no decay).
    rank, world_size, dist_init_method, dist_timeout
        This trainer's data-parallel rank, the number of ranks (> 1: FSDP2), the trainer
        group's rendezvous (e.g. ``tcp://host:port``) and the seconds its rendezvous and
        collectives may take; :meth:`ClusterSpec.trainer_specs
        <areal_fast.launch.cluster.ClusterSpec.trainer_specs>` fills them per rank from
        ``scheduler.*``.
    """

    model: ModelConfig
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: Optional[int] = None
    total_steps: Optional[int] = None
    rank: int = 0
    world_size: int = 1
    dist_init_method: str = ""
    dist_timeout: float = 600.0

    def __call__(self):
        import torch

        from areal_fast.models.loading import load_causal_lm

        if self.seed is not None:
            torch.manual_seed(self.seed)
        mesh = self._join_group()
        m = self.model
        device = m.device
        if mesh is not None and mesh.device_type == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        mixed = self.mixed_precision
        dtype = "float32" if mixed else m.dtype  # master weights
        load = dict(dtype=dtype, attn_implementation=m.attn_implementation, device=device)
        policy = load_causal_lm(m.path, **load)
        ref = load_causal_lm(m.path, **load) if self.actor.loss.kl_coef > 0 else None
        teacher_path = self.actor.distill.teacher_path  # loaded as the reference is
        teacher = load_causal_lm(teacher_path, **load) if teacher_path else None
        if mixed:  # the reference computes as the policy does (KL 0 at the same weights)
            from areal_fast.train.precision import compute_in_dtype

            for model in (policy, ref, teacher):
                if model is not None:
                    compute_in_dtype(model, getattr(torch, m.dtype))
        kwargs = dict(
            temperature=self.rollout.temperature,
            ref_model=ref,
            teacher_model=teacher,
            total_steps=self.total_steps,
        )
        if mesh is None:
            from areal_fast.train.torch_engine import TorchTrainEngine

            return TorchTrainEngine(policy, self.actor, **kwargs)
        from areal_fast.train.fsdp import FSDPTrainEngine

        return FSDPTrainEngine(policy, self.actor, mesh=mesh, **kwargs)

    @property
    def mixed_precision(self) -> bool:
        """Whether the trainer keeps float32 master weights and computes in ``model.dtype``
        (a CUDA device and a half-precision ``model.dtype``)."""
        return self.model.device.startswith("cuda") and self.model.dtype != "float32"

    @property
    def weights_dtype(self) -> str:
        """The dtype the trainer publishes its weights in: ``model.dtype``, the engines'."""
        return self.model.dtype

    def _join_group(self):
        """The data-parallel mesh when ``world_size > 1`` (None for a single trainer)."""
        if self.world_size == 1:
            return None
        from areal_fast.train.fsdp import init_trainer_group

        backend = "nccl" if self.model.device.startswith("cuda") else "gloo"
        return init_trainer_group(
            self.rank, self.world_size, self.dist_init_method, backend, self.dist_timeout
        )
