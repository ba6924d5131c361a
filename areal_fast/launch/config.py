"""Experiment configuration: one small dataclass per component, filled from YAML + key=value.

``load_config(yaml_path, overrides)`` merges the dataclass defaults, a YAML file and dotted
command-line overrides (``actor.optim.lr=2e-5``) with OmegaConf, which rejects unknown keys
and values of the wrong type; the dataclasses' ``__post_init__`` then checks ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from areal_fast.data.rewards import DEFAULT_INSTRUCTION
from areal_fast.models.loading import DEMO_MODEL
from areal_fast.rl.advantages import ADVANTAGE_MODES
from areal_fast.rl.config import LossConfig
from areal_fast.train.torch_engine import OptimizerConfig


@dataclass
class ModelConfig:
    """Which causal LM to train and how to hold it."""

    path: str = DEMO_MODEL  # HF id, local directory, or the offline demo model
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    attn_implementation: str = "sdpa"  # transformers attention backend
    device: str = "cpu"


@dataclass
class DataConfig:
    """Training and held-out problems."""

    task: str = "basic_arithmetic"  # "gsm8k" or a reasoning-gym dataset name
    path: Optional[str] = None  # GSM8K: jsonl file, folder with {split}.jsonl, or HF id
    # generator settings of a reasoning-gym task (examples/arith.yaml sets the demo's);
    # YAML/CLI layers merge into this mapping, they cannot empty it
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    train_size: Optional[int] = 2000  # None: the whole split (GSM8K)
    eval_size: int = 200
    train_seed: int = 0  # reasoning-gym generator seed of the training set
    eval_seed: int = 999  # ... and of the held-out set (different, overlap removed)
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self):
        if self.eval_size < 1:
            raise ValueError(f"data.eval_size = {self.eval_size} must be >= 1")


@dataclass
class RolloutConfig:
    """Sampling during training (the inference engine)."""

    group_size: int = 4  # samples per prompt (GRPO group)
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_batch_size: int = 64  # sequences generated together

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size = {self.group_size} must be >= 2 for GRPO")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature = {self.temperature} must be > 0")


@dataclass
class ActorConfig:
    """The trained policy: loss, optimizer, packing."""

    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    adv_mode: str = "grpo"  # "grpo" | "dr_grpo" | "rloo" | "batch"
    max_tokens_per_mb: int = 4096  # token budget of one micro-batch
    pack_method: str = "kk"  # "kk" (Karmarkar–Karp) | "ffd" (first-fit decreasing)
    keep_groups: bool = False  # keep each GRPO group in one micro-batch

    def __post_init__(self):
        if self.adv_mode not in ADVANTAGE_MODES:
            raise ValueError(f"actor.adv_mode = {self.adv_mode!r} is not one of "
                             f"{ADVANTAGE_MODES}")
        if self.pack_method not in ("kk", "ffd"):
            raise ValueError(f"actor.pack_method = {self.pack_method!r} is not 'kk' or 'ffd'")
        if self.max_tokens_per_mb < 1:
            raise ValueError(f"actor.max_tokens_per_mb = {self.max_tokens_per_mb} must be >= 1")


@dataclass
class EvalConfig:
    """Greedy evaluation on the held-out set, before and after training."""

    max_new_tokens: int = 32
    batch_size: int = 100
    before: bool = True
    after: bool = True


@dataclass
class ExperimentConfig:
    """Everything one ``areal-fast train`` run needs."""

    experiment_name: str = "grpo-arith"
    trial_name: str = "trial0"
    fileroot: str = "runs"  # run directory = fileroot/experiment_name/trial_name
    overwrite: bool = False  # replace an existing run directory
    seed: int = 1
    total_steps: int = 20
    batch_size: int = 16  # prompts per step (each sampled group_size times)
    threads: Optional[int] = None  # torch CPU threads; None keeps torch's default
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tags: List[str] = field(default_factory=list)

    def __post_init__(self):
        if self.total_steps < 0:
            raise ValueError(f"total_steps = {self.total_steps} must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size = {self.batch_size} must be >= 1")
        for key in ("experiment_name", "trial_name"):
            value = getattr(self, key)
            if not value or "/" in value or value.startswith("."):
                raise ValueError(f"{key} = {value!r} must be a plain, non-empty folder name")

    @property
    def run_dir(self) -> Path:
        """Folder that receives metrics, plot, checkpoint and the resolved config."""
        return Path(self.fileroot) / self.experiment_name / self.trial_name


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key or file."""


def load_config(yaml_path: str | None = None, overrides: list[str] | None = None
                ) -> ExperimentConfig:
    """Build an :class:`ExperimentConfig` from defaults, a YAML file and ``key=value`` items.

    Parameters
    ----------
    yaml_path : str, optional
        YAML file whose keys mirror the dataclass fields (nested mappings).
    overrides : list of str
        Dotted overrides, e.g. ``["actor.optim.lr=2e-5", "total_steps=5"]``.

    Raises
    ------
    ConfigError
        Missing or unparsable YAML file, unknown key, wrong value type, a value out of range;
        the one-line message names the file or the full key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(ExperimentConfig)
    layers = [schema]
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {yaml_path} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:
            raise ConfigError(f"config file {yaml_path}: cannot parse YAML "
                              f"({str(exc).splitlines()[0]})") from exc
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from exc
    except ValueError as exc:  # raised by a dataclass __post_init__
        raise ConfigError(str(exc).splitlines()[0]) from exc


def _omegaconf_message(exc) -> str:
    """One line from an OmegaConf error: what went wrong and the full key."""
    key = getattr(exc, "full_key", None)
    head = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "Key" in type(exc).__name__ and key:
        return f"unknown config key {key!r}"
    return f"config key {key!r}: {head}" if key else head


def to_yaml(config: ExperimentConfig) -> str:
    """The resolved config as YAML (written into the run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))
