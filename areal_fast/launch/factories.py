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
    reference model when ``loss.kl_coef > 0``)."""

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

    def __call__(self):
        import torch

        from areal_fast.models.loading import load_causal_lm
        from areal_fast.train.torch_engine import TorchTrainEngine

        if self.seed is not None:
            torch.manual_seed(self.seed)
        load = dict(dtype=self.dtype, attn_implementation=self.attn_implementation,
                    device=self.device)
        policy = load_causal_lm(self.model_path, **load)
        ref = load_causal_lm(self.model_path, **load) if self.loss.kl_coef > 0 else None
        return TorchTrainEngine(
            policy, self.loss, self.optim, temperature=self.temperature,
            max_tokens_per_mb=self.max_tokens_per_mb, pack_method=self.pack_method,
            keep_groups=self.keep_groups, ref_model=ref,
            use_decoupled_loss=self.use_decoupled_loss, prox_logp_method=self.prox_logp_method,
            ppo_n_minibatches=self.ppo_n_minibatches)
