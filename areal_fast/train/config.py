"""The trained policy's settings: optimizer, loss, packing (``actor.*`` keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from areal_fast._checks import at_least
from areal_fast.rl.advantages import ADVANTAGE_MODES
from areal_fast.rl.config import LossConfig
from areal_fast.train.lora import LoraConfig

PROX_LOGP_METHODS = ("recompute", "loglinear")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig:
    """AdamW, gradient-clipping and learning-rate schedule settings (Loshchilov & Hutter 2019).

    ``lr_schedule`` and ``warmup_steps`` shape the learning rate per optimizer update, see
    :func:`lr_factor`; the decay horizon is the engine's ``total_steps``.
    """

    lr: float = 1e-5  # AdamW learning rate (the peak, after warmup)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW decay rate of the gradient's running mean
    beta2: float = 0.999  # AdamW decay rate of the squared gradient's running mean
    eps: float = 1e-8  # AdamW term added to the denominator
    grad_clip: float = 1.0  # the global gradient norm is clipped to this before each update
    lr_schedule: str = "constant"  # "constant" | "linear" | "cosine" decay after warmup
    warmup_steps: int = 0  # optimizer updates of linear warmup

    def __post_init__(self):
        for name in ("lr", "eps", "grad_clip"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} = {value} must be a finite number > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay = {self.weight_decay} must be a finite number >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule = {self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(f"warmup_steps = {self.warmup_steps!r} must be an int >= 0")


@dataclass
class DistillConfig:
    """On-policy distillation from a frozen teacher (``actor.distill.*``): the student samples,
    the teacher scores the student's tokens, and coef · (log π_teacher − log π_student) per
    token is added to the advantages (docs/distillation.md).

    Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), ICLR 2024; Lu & Thinking Machines Lab 2025, "On-Policy
    Distillation".
    """

    # the teacher: a Hugging Face id or local model folder like model.path, with the
    # student's tokenizer; always the full model, frozen (never LoRA); null: no distillation
    teacher_path: Optional[str] = None
    coef: float = 1.0  # weight of the per-token reverse-KL signal, > 0
    # keep the task reward: true adds the signal to the task advantages, false trains on
    # the signal alone (distillation only)
    task_reward: bool = True

    def __post_init__(self):
        if self.teacher_path is not None and (
            not isinstance(self.teacher_path, str) or not self.teacher_path.strip()
        ):
            raise ValueError(
                f"distill.teacher_path = {self.teacher_path!r} must be a model id or folder"
            )
        if isinstance(self.coef, bool) or not (
            isinstance(self.coef, (int, float)) and self.coef > 0 and math.isfinite(self.coef)
        ):
            raise ValueError(f"distill.coef = {self.coef!r} must be a finite number > 0")
        if not isinstance(self.task_reward, bool):
            raise ValueError(f"distill.task_reward = {self.task_reward!r} must be true or false")
        if not self.task_reward and self.teacher_path is None:
            raise ValueError(
                "distill.task_reward = false needs actor.distill.teacher_path: without a teacher "
                "nothing would be trained"
            )

    @property
    def enabled(self) -> bool:
        """Whether distillation is on (``teacher_path`` set)."""
        return self.teacher_path is not None


@dataclass
class ActorConfig:
    """The trained policy: loss, optimizer, packing, LoRA, distillation."""

    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    adv_mode: str = "grpo"  # "grpo" | "dr_grpo" | "rloo" | "batch"
    max_tokens_per_mb: int = 4096  # token budget of one micro-batch
    pack_method: str = "kk"  # "kk" (Karmarkar–Karp) | "ffd" (first-fit decreasing)
    keep_groups: bool = True  # keep each GRPO group in one micro-batch
    # decoupled PPO (AReaL, Fu et al. 2025, Eq. 5): ratio against the proximal policy (the
    # trainer's weights at the start of the step), weighted by exp(prox − behav)
    use_decoupled_loss: bool = True
    prox_logp_method: str = "recompute"  # "recompute" | "loglinear" (version interpolation)
    ppo_n_minibatches: int = 1  # optimizer steps per batch (one policy version per batch)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (docs/lora.md)
    # on-policy distillation from a teacher (docs/distillation.md)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # keep only each decoder layer's input for the backward pass and run the layer's forward
    # again there: a micro-batch's activations shrink to one [T, H] tensor per layer, for
    # about one more forward pass of the decoder (docs/sft.md, "Memory")
    gradient_checkpointing: bool = False

    def __post_init__(self):
        if self.adv_mode not in ADVANTAGE_MODES:
            raise ValueError(f"adv_mode = {self.adv_mode!r} is not one of {ADVANTAGE_MODES}")
        if self.pack_method not in ("kk", "ffd"):
            raise ValueError(f"pack_method = {self.pack_method!r} is not 'kk' or 'ffd'")
        at_least("max_tokens_per_mb", self.max_tokens_per_mb, 1)
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(
                f"prox_logp_method = {self.prox_logp_method!r} is not 'recompute' or 'loglinear'"
            )
        at_least("ppo_n_minibatches", self.ppo_n_minibatches, 1)
        if self.loss.corrects_sampler and not self.use_decoupled_loss:
            option = "icepop" if self.loss.icepop else "seq_rejection"
            raise ValueError(
                f"loss.{option} needs use_decoupled_loss = true: the trainer's "
                f"sampler→trainer ratio is exp(prox − behav)"
            )
        if self.lora is None:  # programmatic None: full fine-tuning
            self.lora = LoraConfig()
        if self.distill is None:  # programmatic None: no distillation
            self.distill = DistillConfig()
