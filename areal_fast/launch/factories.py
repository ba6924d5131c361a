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
        ``max_batch_size``: sequences the engine generates together.
    """

    model: ModelConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __call__(self):
        from areal_fast.models.loading import load_causal_lm, load_tokenizer
        from areal_fast.rollout.hf_engine import HFEngine

        m = self.model
        tokenizer = load_tokenizer(m.path)
        model = load_causal_lm(m.path, m.dtype, m.attn_implementation, m.device)
        engine = HFEngine(model, tokenizer, self.rollout.max_batch_size)

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=True)

        return engine, decode


@dataclass
class TorchTrainerFactory:
    """Builds a :class:`~areal_fast.train.torch_engine.TorchTrainEngine` (and its frozen
    reference model when ``actor.loss.kl_coef > 0``); with ``world_size > 1`` it joins the
    trainer process group as rank ``rank`` and builds an
    :class:`~areal_fast.train.fsdp.FSDPTrainEngine` (called inside each rank's process; every
    rank then gets its own part of each batch).

    Attributes
    ----------
    model : ModelConfig
        Which model to load and how (``path``, ``dtype``, ``attn_implementation``,
        ``device``; a CUDA trainer group puts each rank on its own GPU).
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
        load = dict(dtype=m.dtype, attn_implementation=m.attn_implementation, device=device)
        policy = load_causal_lm(m.path, **load)
        ref = load_causal_lm(m.path, **load) if self.actor.loss.kl_coef > 0 else None
        kwargs = dict(
            temperature=self.rollout.temperature, ref_model=ref, total_steps=self.total_steps
        )
        if mesh is None:
            from areal_fast.train.torch_engine import TorchTrainEngine

            return TorchTrainEngine(policy, self.actor, **kwargs)
        from areal_fast.train.fsdp import FSDPTrainEngine

        return FSDPTrainEngine(policy, self.actor, mesh=mesh, **kwargs)

    def _join_group(self):
        """The data-parallel mesh when ``world_size > 1`` (None for a single trainer)."""
        if self.world_size == 1:
            return None
        from areal_fast.train.fsdp import init_trainer_group

        backend = "nccl" if self.model.device.startswith("cuda") else "gloo"
        return init_trainer_group(
            self.rank, self.world_size, self.dist_init_method, backend, self.dist_timeout
        )
