"""Picklable builders of the real engine and trainer, run inside the worker processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_fast.rl.config import LossConfig
from areal_fast.train.torch_engine import OptimizerConfig


@dataclass
class HFEngineFactory:
    """Builds an :class:`~areal_fast.rollout.hf_engine.HFEngine` and its decode function."""

    model_path: str
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    max_batch_size: int = 64

    def __call__(self):
        from areal_fast.models.loading import load_causal_lm, load_tokenizer
        from areal_fast.rollout.hf_engine import HFEngine

        tokenizer = load_tokenizer(self.model_path)
        model = load_causal_lm(self.model_path, self.dtype, self.attn_implementation,
                               self.device)
        engine = HFEngine(model, tokenizer, self.max_batch_size)

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=True)
        return engine, decode


@dataclass
class TorchTrainerFactory:
    """Builds a :class:`~areal_fast.train.torch_engine.TorchTrainEngine` (and its frozen
    reference model when ``loss.kl_coef > 0``); with ``world_size > 1`` it joins the trainer
    process group as rank ``rank`` and builds an
    :class:`~areal_fast.train.fsdp.FSDPTrainEngine` (called inside each rank's process; every
    rank then gets its own part of each batch)."""

    model_path: str
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    temperature: float = 1.0
    max_tokens_per_mb: int = 4096
    pack_method: str = "kk"
    keep_groups: bool = False
    use_decoupled_loss: bool = False
    prox_logp_method: str = "recompute"
    ppo_n_minibatches: int = 1
    seed: Optional[int] = None
    total_steps: Optional[int] = None  # train steps the LR schedule decays over (None: none)
    rank: int = 0  # this trainer's data-parallel rank
    world_size: int = 1  # data-parallel trainer ranks (> 1: FSDP2)
    dist_init_method: str = ""  # rendezvous of the trainer group, e.g. tcp://host:port
    dist_timeout: float = 600.0  # seconds, rendezvous and collectives

    def __call__(self):
        import torch

        from areal_fast.models.loading import load_causal_lm

        if self.seed is not None:
            torch.manual_seed(self.seed)
        mesh = self._join_group()
        device = self.device
        if mesh is not None and mesh.device_type == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        load = dict(dtype=self.dtype, attn_implementation=self.attn_implementation,
                    device=device)
        policy = load_causal_lm(self.model_path, **load)
        ref = load_causal_lm(self.model_path, **load) if self.loss.kl_coef > 0 else None
        kwargs = dict(temperature=self.temperature, max_tokens_per_mb=self.max_tokens_per_mb,
                      pack_method=self.pack_method, keep_groups=self.keep_groups,
                      ref_model=ref, use_decoupled_loss=self.use_decoupled_loss,
                      prox_logp_method=self.prox_logp_method,
                      ppo_n_minibatches=self.ppo_n_minibatches, total_steps=self.total_steps)
        if mesh is None:
            from areal_fast.train.torch_engine import TorchTrainEngine

            return TorchTrainEngine(policy, self.loss, self.optim, **kwargs)
        from areal_fast.train.fsdp import FSDPTrainEngine

        return FSDPTrainEngine(policy, self.loss, self.optim, mesh=mesh, **kwargs)

    def _join_group(self):
        """The data-parallel mesh when ``world_size > 1`` (None for a single trainer)."""
        if self.world_size == 1:
            return None
        from areal_fast.train.fsdp import init_trainer_group

        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        return init_trainer_group(self.rank, self.world_size, self.dist_init_method, backend,
                                  self.dist_timeout)
