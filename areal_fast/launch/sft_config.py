"""``areal-fast sft`` configuration: the supervised run's dataclasses, keyed like
``areal-fast train``'s (``model.*``, ``data.*``, ``actor.optim.*``, ``actor.lora.*``,
``actor.max_tokens_per_mb``, ``total_steps``, ``batch_size``, ``eval.*``, ``checkpoint.*``,
``logging.*``) and filled by the same loader (:func:`areal_fast.launch.config.load_config`:
YAML + ``key=value``, unknown keys refused with the closest known ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from areal_fast._checks import at_least, positive_finite
from areal_fast.controller.config import CheckpointConfig
from areal_fast.data.config import DataConfig
from areal_fast.data.sft_data import SftDataConfig
from areal_fast.launch.allocator import trainer_environment
from areal_fast.launch.config import (
    ExperimentConfig,
    LoggingConfig,
    load_config,
    name_run_folders,
)
from areal_fast.models.config import ModelConfig
from areal_fast.train.config import ActorConfig, OptimizerConfig
from areal_fast.train.lora import LoraConfig


@dataclass
class SftActorConfig:
    """The fine-tuned model: optimizer, LoRA and packing (as ``areal-fast train``'s
    ``actor.*``)."""

    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (docs/lora.md)
    max_tokens_per_mb: int = 4096  # token budget of one micro-batch; longer rows are refused
    pack_method: str = "kk"  # "kk" (Karmarkar–Karp) | "ffd" (first-fit decreasing)
    # keep only each decoder layer's input for the backward pass and run the layer's forward
    # again there: far less activation memory for about one more decoder forward (docs/sft.md)
    gradient_checkpointing: bool = False

    def __post_init__(self):
        at_least("max_tokens_per_mb", self.max_tokens_per_mb, 1)
        if self.pack_method not in ("kk", "ffd"):
            raise ValueError(f"pack_method = {self.pack_method!r} is not 'kk' or 'ffd'")
        if self.lora is None:
            self.lora = LoraConfig()

    def trainer_actor(self) -> ActorConfig:
        """The trainer engine's :class:`ActorConfig` of these settings (sequences packed
        one by one, no RL loss terms)."""
        return ActorConfig(
            optim=self.optim,
            lora=self.lora,
            max_tokens_per_mb=self.max_tokens_per_mb,
            pack_method=self.pack_method,
            keep_groups=False,
            use_decoupled_loss=False,
            gradient_checkpointing=self.gradient_checkpointing,
        )


@dataclass
class SftEvalConfig:
    """Greedy held-out evaluation, the one ``areal-fast train`` runs (rollout workers, the
    same problems, files and console lines), on the problems of ``eval.data``."""

    max_new_tokens: int = 32  # tokens each greedy held-out answer may have at most
    before: bool = False  # evaluate the starting model first (eval_before.jsonl)
    after: bool = False  # evaluate the fine-tuned model at the end (eval_after.jsonl)
    # also evaluate the weights of every k-th step (eval_step_<k>.jsonl, eval_accuracy in
    # metrics.jsonl); 0: off
    every_steps: int = 0
    # the held-out problems, as `areal-fast train`'s data.* (its held-out set: eval_split,
    # eval_size, eval_seed; the task's reward scores the answers)
    data: DataConfig = field(default_factory=DataConfig)
    rollout_workers: int = 1  # rollout worker processes that run each evaluation

    def __post_init__(self):
        at_least("max_new_tokens", self.max_new_tokens, 1)
        at_least("every_steps", self.every_steps, 0)
        at_least("rollout_workers", self.rollout_workers, 1)

    @property
    def enabled(self) -> bool:
        """Whether any evaluation runs."""
        return self.before or self.after or self.every_steps > 0


@dataclass
class SftSchedulerConfig:
    """The trainer ranks of a supervised run (as ``areal-fast train``'s ``scheduler.*``):
    this process and ``train_world_size`` − 1 spawned ones."""

    # trainer ranks (FSDP2 data parallel: gloo on CPU, NCCL on GPU), each taking every
    # train_world_size-th row of a step; <= batch_size
    train_world_size: int = 1
    dist_timeout: float = 600.0  # seconds a rank's collective may wait before failing

    def __post_init__(self):
        at_least("train_world_size", self.train_world_size, 1)
        positive_finite("dist_timeout", self.dist_timeout)


@dataclass
class SftLauncherConfig:
    """The process of an ``areal-fast sft`` run (its rank 0) and its spawned ranks."""

    # malloc of the run's processes: "auto" (mimalloc where the cmeel-mimalloc package is
    # installed, on Linux: the command starts itself again with it preloaded), "mimalloc" (an
    # error without it), "system" (the C library's); as train's launcher.allocator
    allocator: str = "auto"

    def __post_init__(self):
        trainer_environment(self.allocator)  # an unknown name, or mimalloc not installed


@dataclass
class SftConfig:
    """Everything one ``areal-fast sft`` run needs."""

    # first folder of the run directory, under fileroot; null: the config file's name without
    # its extension (my_sft.yaml -> my_sft), "default" without a file
    experiment_name: Optional[str] = None
    trial_name: str = "trial0"  # second folder of the run directory: one per run
    fileroot: str = "runs"  # run directory = fileroot/experiment_name/trial_name
    overwrite: bool = False  # replace an existing run directory
    # continue the run in the existing run directory from its last complete checkpoint
    resume: bool = False
    # seeds Python, numpy and torch and the order rows are drawn in (a fresh order per
    # pass over the rows, from seed + pass)
    seed: int = 1
    total_steps: int = 100  # optimizer updates, >= 1
    batch_size: int = 16  # rows per update
    # torch CPU threads of the run, divided among the trainer ranks (None: the cores)
    threads: Optional[int] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SftDataConfig = field(default_factory=SftDataConfig)
    actor: SftActorConfig = field(default_factory=SftActorConfig)
    eval: SftEvalConfig = field(default_factory=SftEvalConfig)
    scheduler: SftSchedulerConfig = field(default_factory=SftSchedulerConfig)
    launcher: SftLauncherConfig = field(default_factory=SftLauncherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # TensorBoard, W&B sinks
    tags: List[str] = field(default_factory=list)  # free labels, kept in the run's config.yaml

    def __post_init__(self):
        at_least("total_steps", self.total_steps, 1)
        at_least("batch_size", self.batch_size, 1)
        if self.threads is not None:
            at_least("threads", self.threads, 1)
        if self.scheduler.train_world_size > self.batch_size:
            raise ValueError(
                f"scheduler.train_world_size = {self.scheduler.train_world_size} is more than "
                f"batch_size = {self.batch_size}: every rank needs a row per step"
            )
        if not self.data.path:
            raise ValueError(
                "data.path is required: the rows to fine-tune on (a .jsonl file or folder "
                "with data.task=jsonl, a Hugging Face dataset with data.task=hf)"
            )
        if self.resume and self.overwrite:
            raise ValueError("resume=true and overwrite=true contradict each other")
        name_run_folders(self)

    @property
    def run_dir(self) -> Path:
        """Folder that receives metrics, checkpoints, the final model and the config."""
        return Path(self.fileroot) / self.experiment_name / self.trial_name

    def eval_experiment(self, model_path: str) -> ExperimentConfig:
        """The :class:`ExperimentConfig` of a held-out evaluation of ``model_path``: this
        run's ``eval.*``, ``model.*`` (but the path), seed and threads; defaults elsewhere."""
        from dataclasses import replace

        from areal_fast.launch.config import EvalConfig
        from areal_fast.rollout.config import RolloutConfig

        return ExperimentConfig(
            experiment_name=self.experiment_name,
            trial_name=self.trial_name,
            fileroot=self.fileroot,
            seed=self.seed,
            threads=self.threads,
            total_steps=1,
            batch_size=1,
            model=replace(self.model, path=model_path),
            data=self.eval.data,
            rollout=RolloutConfig(num_workers=self.eval.rollout_workers),
            eval=EvalConfig(max_new_tokens=self.eval.max_new_tokens),
        )


def load_sft_config(yaml_path: str | None = None, overrides: list[str] | None = None) -> SftConfig:
    """:func:`~areal_fast.launch.config.load_config` of an :class:`SftConfig`.

    Raises
    ------
    ConfigError
        As :func:`~areal_fast.launch.config.load_config`: one line naming the key or file.
    """
    return load_config(yaml_path, overrides, root=SftConfig)
