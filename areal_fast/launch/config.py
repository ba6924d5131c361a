"""Experiment configuration: one small dataclass per component, filled from YAML + key=value.

``load_config(yaml_path, overrides)`` merges the dataclass defaults, a YAML file and dotted
command-line overrides (``actor.optim.lr=2e-5``; ``data.task_kwargs={}`` empties a mapping)
with OmegaConf, which rejects unknown keys (the error names the closest known ones) and values
of the wrong type; the dataclasses' ``__post_init__`` then checks ranges. Errors about a value
from the YAML file give its ``file:line:column``; a conflict between a value of the file and a
``key=value`` item names the item. ``experiment_name`` defaults to the YAML file's name. Every key's meaning is the comment beside its
field: :mod:`areal_fast.launch.config_reference` turns them into ``docs/config.md``.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import List, Optional

from areal_fast._checks import at_least, positive_finite
from areal_fast.agent.runner import AgentConfig
from areal_fast.agent.store import TrajectoryConfig
from areal_fast.controller.config import CheckpointConfig, RecoveryConfig, Timeouts
from areal_fast.data.config import DataConfig
from areal_fast.data.user_reward import RewardConfig
from areal_fast.launch.allocator import trainer_environment
from areal_fast.launch.slurm.config import SlurmConfig
from areal_fast.models.config import ModelConfig
from areal_fast.rl.config import LossConfig
from areal_fast.rollout.config import RolloutConfig
from areal_fast.sync.config import SyncConfig
from areal_fast.train.config import ActorConfig, OptimizerConfig

# the component configs are defined beside their components and gathered here
__all__ = [
    "ActorConfig",
    "AgentConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ExperimentConfig",
    "LauncherConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RecoveryConfig",
    "RewardConfig",
    "RolloutConfig",
    "SchedulerConfig",
    "SlurmConfig",
    "Timeouts",
    "TrajectoryConfig",
    "WandbConfig",
    "load_config",
    "to_yaml",
]


@dataclass
class LauncherConfig:
    """Local launcher: processes, their CPU threads, and how long to wait for them."""

    # torch threads of each trainer rank; None: all cores when
    # rollout.max_head_offpolicyness = 0 (trainer and engines take turns), else half of them
    # (the trainer and the rollout workers run at the same time)
    trainer_threads: Optional[int] = None
    # torch threads of each rollout worker; None: the cores (η = 0), else the half the
    # trainer leaves, divided by rollout.num_workers
    rollout_threads: Optional[int] = None
    # let the trainer ranks and rollout workers take the cores the others leave idle: a
    # process uses every core while the others have no work, and its threads as derived
    # above while they do (checked at each decoder layer's forward and backward and each
    # decode step); only with the local launcher, rollout.engine = hf, model.device = cpu,
    # neither launcher.*_threads key set and rollout.reproducible off (its thread counts
    # are part of what it reproduces)
    share_cores: bool = True
    startup_timeout: float = 600.0  # seconds for every worker to load its model
    timeouts: Timeouts = field(default_factory=Timeouts)
    # malloc of the local launcher's trainer processes: "auto" (mimalloc where the
    # cmeel-mimalloc package is installed, on Linux; glibc's heap otherwise keeps freed
    # activation blocks it cannot reuse, docs/lora.md), "mimalloc" (an error without it),
    # "system" (the C library's)
    allocator: str = "auto"

    def __post_init__(self):
        for name in ("trainer_threads", "rollout_threads"):
            if getattr(self, name) is not None:
                at_least(name, getattr(self, name), 1)
        positive_finite("startup_timeout", self.startup_timeout)
        trainer_environment(self.allocator)  # an unknown name, or mimalloc not installed


@dataclass
class SchedulerConfig:
    """Where the workers run: ``local`` processes or ``ray`` actors; the same config for both.

    Resources apply to the Ray launcher's placement group (one bundle per worker); the local
    launcher uses ``train_world_size``, ``bind_host`` and ``dist_timeout`` only.
    """

    type: str = "local"  # "local" processes, or "ray" actors (python -m areal_fast.launch.ray)
    train_world_size: int = 1  # trainer ranks (FSDP2 data parallel: gloo on CPU, NCCL on GPU)
    # IPv4 address the job's servers bind (the controller's channels, the shard servers);
    # None: 127.0.0.1 for local processes, each node's own IP on Ray; 0.0.0.0: every
    # interface, peers are told 127.0.0.1 locally, the node's IP on Ray (torch's TCP stores
    # of the trainer group and of weight links listen on every interface regardless)
    bind_host: Optional[str] = None
    ray_address: Optional[str] = None  # None: start a local Ray instance; "auto": join one
    ray_num_cpus: Optional[int] = None  # CPUs of a local Ray instance (None: all cores)
    cpus_per_rollout_worker: float = 1.0  # CPUs of each rollout worker's Ray bundle
    gpus_per_rollout_worker: float = 0.0  # GPUs of each rollout worker's Ray bundle
    cpus_per_trainer_rank: float = 1.0  # CPUs of each trainer rank's Ray bundle
    gpus_per_trainer_rank: float = 0.0  # GPUs of each trainer rank's Ray bundle
    placement_strategy: str = "PACK"  # Ray placement group strategy
    dist_timeout: float = 600.0  # seconds a trainer collective may wait before failing

    def __post_init__(self):
        if self.type not in ("local", "ray"):
            raise ValueError(f"type = {self.type!r} is not 'local' or 'ray'")
        if self.bind_host is not None:
            _check_ipv4("bind_host", self.bind_host)
        at_least("train_world_size", self.train_world_size, 1)
        for name in ("cpus_per_rollout_worker", "cpus_per_trainer_rank"):
            positive_finite(name, getattr(self, name))
        for name in ("gpus_per_rollout_worker", "gpus_per_trainer_rank"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} = {getattr(self, name)} must be a finite number >= 0")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"placement_strategy = {self.placement_strategy!r} is not one of "
                f"PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"
            )
        positive_finite("dist_timeout", self.dist_timeout)
        if self.ray_num_cpus is not None:
            at_least("ray_num_cpus", self.ray_num_cpus, 1)


def _check_ipv4(name: str, value: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an IPv4 address (the job's
    sockets are IPv4: ``multiprocessing.connection``, torch's TCP store)."""
    import ipaddress

    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        ipv6 = " (IPv6 is not supported: 0.0.0.0 binds every interface)" if ":" in value else ""
        raise ValueError(
            f"{name} = {value!r} is not an IPv4 address such as 10.0.0.5, or 0.0.0.0 for "
            f"every interface{ipv6}"
        ) from None


@dataclass
class EvalConfig:
    """Greedy evaluation on the held-out set, before, during and after training."""

    max_new_tokens: int = 32  # tokens each greedy held-out answer may have at most
    before: bool = True  # evaluate the starting model before the first step (eval_before.jsonl)
    after: bool = True  # evaluate the trained model after the last step (eval_after.jsonl)
    # also evaluate the weights of every k-th step on the rollout workers while training goes
    # on (eval_step_<k>.jsonl, eval_accuracy in metrics.jsonl; docs/async.md); 0: off
    every_steps: int = 0

    def __post_init__(self):
        at_least("max_new_tokens", self.max_new_tokens, 1)
        at_least("every_steps", self.every_steps, 0)


WANDB_MODES = ("online", "offline", "disabled")
DEFAULT_EXPERIMENT = "default"  # experiment_name of a config built without a YAML file


def name_run_folders(cfg) -> None:
    """Fill ``cfg.experiment_name`` (None: :data:`DEFAULT_EXPERIMENT`) and check that it and
    ``cfg.trial_name`` are plain folder names (the run directory is
    ``fileroot/experiment_name/trial_name``); shared by ``train`` and ``sft`` configs.

    Raises
    ------
    ValueError
        Either name empty, holding "/", or starting with ".".
    """
    if cfg.experiment_name is None:
        cfg.experiment_name = DEFAULT_EXPERIMENT
    for key in ("experiment_name", "trial_name"):
        value = getattr(cfg, key)
        if not value or "/" in value or value.startswith("."):
            raise ValueError(f"{key} = {value!r} must be a plain, non-empty folder name")


@dataclass
class WandbConfig:
    """A Weights & Biases run fed each step's record, the held-out accuracies and the config;
    needs the wandb package unless ``mode`` is ``disabled``.

    The API key is wandb's own (``wandb login`` or ``WANDB_API_KEY``), never a config key.
    """

    # "online" (needs a wandb login), "offline" (writes <run dir>/wandb/offline-run-*, no
    # network; upload later with `wandb sync`), or "disabled": no wandb run
    mode: str = "disabled"
    project: Optional[str] = None  # wandb project; None: experiment_name
    name: Optional[str] = None  # the run's display name; None: trial_name
    entity: Optional[str] = None  # wandb team or user; None: the login's default entity
    group: Optional[str] = None  # wandb run group (e.g. one per sweep); None: no group

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"mode = {self.mode!r} is not one of {', '.join(WANDB_MODES)}")
        for name in ("project", "name", "entity", "group"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"{name} = {getattr(self, name)!r} is empty (null: the default)")


@dataclass
class LoggingConfig:
    """Dashboards besides metrics.jsonl and progress.png: TensorBoard event files and a Weights
    & Biases run (docs/logging.md).

    Written by :mod:`areal_fast.launch.log_sinks`.
    """

    # TensorBoard event files in <run dir>/tensorboard/: each step's numeric keys as
    # scalars, the staleness histogram, the held-out accuracies (needs the tensorboard package)
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)  # needs wandb unless disabled


@dataclass
class ExperimentConfig:
    """Everything one ``areal-fast train`` run needs."""

    # first folder of the run directory, under fileroot; null: the config file's name without
    # its extension (my_task.yaml -> my_task), "default" without a file
    experiment_name: Optional[str] = None
    trial_name: str = "trial0"  # second folder of the run directory: one per run
    fileroot: str = "runs"  # run directory = fileroot/experiment_name/trial_name
    overwrite: bool = False  # replace an existing run directory
    # continue the run in the existing run directory from its last complete checkpoint
    resume: bool = False
    # seeds Python, numpy and torch, the order training problems are drawn in, each
    # group's sampling seeds and the trainer process's torch RNG
    seed: int = 1
    # training steps, >= 1: each trains one batch and makes one policy version (to only
    # evaluate a model: `areal-fast eval`)
    total_steps: int = 20
    # training-time budget in seconds: no batch is sent after it (None: run total_steps)
    max_seconds: Optional[float] = None
    batch_size: int = 16  # prompts per step (each sampled group_size times)
    # torch CPU threads of this (controller) process and the cores that launcher.*_threads
    # divide; None: torch's default here, all cores for the workers
    threads: Optional[int] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # the completions' reward
    actor: ActorConfig = field(default_factory=ActorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # rollout by a user agent
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)  # session store
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # TensorBoard, W&B sinks
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # `areal-fast submit`'s batch job
    tags: List[str] = field(default_factory=list)  # free labels, kept in the run's config.yaml

    def __post_init__(self):
        at_least(
            "total_steps",
            self.total_steps,
            1,
            "(to evaluate a model without training: areal-fast eval --config FILE model.path=...)",
        )
        if self.max_seconds is not None:
            positive_finite("max_seconds", self.max_seconds)
        at_least("batch_size", self.batch_size, 1)
        units = self.batch_size * (1 if self.actor.keep_groups else self.rollout.group_size)
        if self.actor.ppo_n_minibatches > units:
            what = "prompt groups" if self.actor.keep_groups else "sequences"
            raise ValueError(
                f"actor.ppo_n_minibatches = {self.actor.ppo_n_minibatches} is more "
                f"than the {units} {what} of a batch"
            )
        if self.threads is not None:
            at_least("threads", self.threads, 1)
        ranks = self.scheduler.train_world_size
        if self.actor.ppo_n_minibatches > 1 and ranks * self.actor.ppo_n_minibatches > units:
            what = "prompt groups" if self.actor.keep_groups else "sequences"
            raise ValueError(
                f"actor.ppo_n_minibatches = {self.actor.ppo_n_minibatches} with "
                f"scheduler.train_world_size = {ranks}: each rank splits its part "
                f"of the batch ({units} {what} in all) into that many "
                f"minibatches, so it needs more"
            )
        if self.scheduler.train_world_size > self.batch_size:
            raise ValueError(
                f"scheduler.train_world_size = {self.scheduler.train_world_size} "
                f"is more than batch_size = {self.batch_size}: every trainer rank "
                f"needs at least one prompt group per step"
            )
        if self.actor.lora.enabled:
            self._check_lora_engine()
        if self.rollout.dynamic_filter and not self.actor.distill.task_reward:
            raise ValueError(
                "rollout.dynamic_filter = true with actor.distill.task_reward = false: groups "
                "would be dropped for equal rewards, which distillation alone does not train on"
            )
        if self.resume and self.overwrite:
            raise ValueError("resume=true and overwrite=true contradict each other")
        if self.rollout.reproducible:  # before the checks of what it refuses
            self._check_reproducible()
        if self.agent.path:
            self._check_agent_lengths()
        name_run_folders(self)

    def _check_lora_engine(self) -> None:
        engine = self.rollout.engine
        if engine not in ("hf", "vllm"):
            raise ValueError(
                f"actor.lora with rollout.engine = {engine!r} is not supported: adapter-only "
                f"weight updates reach the hf and vllm engines (use one of them)"
            )
        if engine == "vllm":
            from areal_fast.rollout.vllm_lora import vllm_lora_rank

            vllm_lora_rank(self.actor.lora.rank)  # a rank vLLM cannot serve: one line here
        if engine == "vllm" and self.rollout.pause_mode == "keep":
            raise ValueError(
                "actor.lora with rollout.engine = 'vllm' needs rollout.pause_mode = 'abort': "
                "vLLM binds a request to the adapter it was admitted with, so a kept request "
                "would go on sampling with the old adapter under the new version's label"
            )

    def _check_reproducible(self) -> None:
        """Refuse, naming the key, the settings a reproducible run cannot reproduce."""
        refused = {
            "agent.path": (
                bool(self.agent.path),
                "an agent's calls and tools run on their own clock",
            ),
            "max_seconds": (
                self.max_seconds is not None,
                "where the run stops would depend on its speed",
            ),
            "recovery.spool_shards": (
                not self.recovery.spool_shards,
                "= false: a finished group must outlive its rollout worker",
            ),
            "scheduler.type": (
                self.scheduler.type != "local",
                f"= {self.scheduler.type!r}: weight links deliver versions on their own "
                "clock; use the local launcher",
            ),
            "sync.transport": (
                self.sync.transport in ("broadcast", "disk"),
                f"= {self.sync.transport!r}: a weight link delivers versions on its own clock",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:  # "why" may start with the key's value ("= 'ray': ...")
                sep = " " if why.startswith("=") else ": "
                raise ValueError(f"rollout.reproducible = true with {key}{sep}{why}")

    def _check_agent_lengths(self) -> None:
        """An agent's sequences must fit a micro-batch: a concat sequence is at most one
        call's prompt (agent.max_prompt_tokens) plus its output (the effective
        agent.max_tokens_cap), and with actor.keep_groups a whole group goes in one."""
        a, r, mb = self.agent, self.rollout, self.actor.max_tokens_per_mb
        cap = a.tokens_cap(r.max_new_tokens)
        if r.max_new_tokens > cap:
            raise ValueError(
                f"rollout.max_new_tokens = {r.max_new_tokens} is above "
                f"agent.max_tokens_cap = {cap}: every model call without "
                f"max_tokens would be refused"
            )
        if a.export == "per_turn" and self.actor.keep_groups:
            raise ValueError(
                "agent.export = 'per_turn' with actor.keep_groups = true: a group "
                "has one sequence per model call, however many, so it may not "
                "fit one micro-batch; use agent.export=concat or "
                "actor.keep_groups=false"
            )
        sequences = r.group_size if self.actor.keep_groups else 1
        need = sequences * (a.max_prompt_tokens + cap)
        if need > mb:
            what = (
                f"a group of rollout.group_size = {r.group_size} sessions (actor.keep_groups)"
                if self.actor.keep_groups
                else "a session's sequence"
            )
            raise ValueError(
                f"agent.max_prompt_tokens = {a.max_prompt_tokens}: with "
                f"max_tokens up to {cap} (agent.max_tokens_cap, default "
                f"rollout.max_new_tokens) {what} can reach {need} tokens, more "
                f"than actor.max_tokens_per_mb = {mb}"
            )

    @property
    def run_dir(self) -> Path:
        """Folder that receives metrics, plot, checkpoint and the resolved config."""
        return Path(self.fileroot) / self.experiment_name / self.trial_name


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key or file."""


def load_config(
    yaml_path: str | None = None, overrides: list[str] | None = None, root: type | None = None
):
    """Build an :class:`ExperimentConfig` (or ``root``) from defaults, a YAML file and
    ``key=value`` items.

    Parameters
    ----------
    yaml_path : str, optional
        YAML file whose keys mirror the dataclass fields (nested mappings).
    overrides : list of str
        Dotted overrides applied in order, e.g. ``["actor.optim.lr=2e-5", "total_steps=5"]``.
        A mapping value is merged into the mapping already there, except ``{}``, which
        empties a mapping key (``data.task_kwargs={}``). ``experiment_name``, when neither
        sets it, is the YAML file's name without its extension.
    root : dataclass type, optional
        The config to build (default :class:`ExperimentConfig`; ``areal-fast sft`` passes
        :class:`~areal_fast.launch.sft_config.SftConfig`); it needs an ``experiment_name``
        field.

    Raises
    ------
    ConfigError
        Missing or unparsable YAML file, unknown key (with the closest known keys), wrong
        value type, a value out of range; the one-line message names the full key, and
        ``file:line:column`` when the value comes from the YAML file.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    root = root or ExperimentConfig
    merged = OmegaConf.structured(root)
    where: dict[str, tuple[int, int]] = {}
    if yaml_path is not None:
        loaded, where = _load_yaml(Path(yaml_path))
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as exc:
            raise ConfigError(
                _located(
                    _omegaconf_message(exc, root), getattr(exc, "full_key", None), yaml_path, where
                )
            ) from exc
        if merged.experiment_name is None:  # each config file gets a folder of its own
            merged.experiment_name = Path(yaml_path).stem.lstrip(".") or DEFAULT_EXPERIMENT
    for item in overrides or []:
        key, _, value = item.partition("=")
        key = key.strip()
        if "=" not in item or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            if value.strip() == "{}" and key in _mapping_keys(root):
                OmegaConf.update(merged, key, {}, merge=False)
            else:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{_omegaconf_message(exc, root)} (in {item!r})") from exc
        except yaml.YAMLError as exc:  # the value is parsed as YAML
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: its value is not valid YAML ({problem})"
            ) from exc
    try:
        return OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as exc:  # ValueError: a __post_init__ check
        prefix = _failing_section(merged, root)
        message = (
            _omegaconf_message(exc, root)
            if isinstance(exc, OmegaConfBaseException)
            else str(exc).splitlines()[0]
        )
        message = _full_keyed(prefix, message)
        blamed = _blamed(message, prefix, overrides or [], yaml_path, (where, root))
        raise ConfigError(blamed) from exc


def _full_keyed(prefix: str, message: str) -> str:
    """``message`` of a check in section ``prefix`` (``"actor.lora."``) led by the full key.

    A section's check names its key relative to itself (``rank = -1``), to a section above
    (``lora.rank = -1``), or in full (``agent.*``, ``trajectory.*`` checks); the part of
    ``prefix`` the message does not already name is put in front.
    """
    parts = prefix.rstrip(".").split(".") if prefix else []
    for i in range(len(parts)):
        if message.startswith(".".join(parts[i:]) + "."):
            return ".".join(parts[:i]) + ("." if i else "") + message
    return prefix + message


def _blamed(message: str, prefix: str, overrides: list[str], yaml_path, located) -> str:
    """``message`` with where its value came from: the command-line item that set the key it
    starts with, else the YAML file's ``file:line:column`` of that key; when the key is the
    file's but another key the message names was set on the command line (a conflict
    between the two), that command-line item is blamed instead of the file's line.
    ``located``: ``(where, root)``, the file's key positions and the config type."""
    where, root = located
    items = {item.partition("=")[0].strip(): item for item in overrides}
    key = re.match(r"[\w.]*", message).group(0)
    if key in items or key not in where:  # the value is not the file's
        return message
    known = set(_known_keys(root))
    for word in re.findall(r"[A-Za-z_]\w*(?:\.\w+)*", message):
        for name in (word, prefix + word):
            if name != key and name in known and name in items:
                return f"command line {items[name]!r}: {message}"
    return _located(message, key, yaml_path, where)


@functools.lru_cache(maxsize=4)
def _mapping_keys(root: type = ExperimentConfig) -> frozenset[str]:
    """Dotted keys whose value is a free-form mapping (``data.task_kwargs``, ...)."""
    from areal_fast.launch.config_keys import config_keys

    return frozenset(k.key for k in config_keys(root, strict=False) if k.type == "dict")


@functools.lru_cache(maxsize=4)
def _known_keys(root: type = ExperimentConfig) -> tuple[str, ...]:
    """Every dotted key and section name of :class:`ExperimentConfig` (or ``root``)."""
    from areal_fast.launch.config_keys import TOP_LEVEL, sections

    found = []
    for section in sections(root, strict=False):
        if section.name != TOP_LEVEL:
            found.append(section.name)
        found += [k.key for k in section.keys]
    return tuple(found)


def did_you_mean(key: str, root: type = ExperimentConfig) -> str:
    """``"; did you mean 'a.b'?"`` for an unknown dotted ``key`` ("" when nothing is close).

    The known keys most like the whole key (difflib ratio >= 0.6 and within 0.1 of the
    best, at most 3), else those whose last part is most like its last part
    (``behav_weight_mode`` -> ``actor.loss.behav_weight_mode``).
    """
    parts = key.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
    known = [k for k in _known_keys(root) if k not in ancestors]
    close = _closest(key, known, 0.6)
    if not close:
        leaves = _closest(parts[-1], sorted({k.rsplit(".", 1)[-1] for k in known}), 0.75)
        close = [k for k in known if k.rsplit(".", 1)[-1] in leaves][:3]
    return f"; did you mean {', '.join(repr(k) for k in close)}?" if close else ""


def _closest(word: str, candidates: list[str], cutoff: float) -> list[str]:
    """Candidates most like ``word``: ratio >= ``cutoff`` and within 0.1 of the best."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates),
        key=lambda x: -x[0],
    )
    best = scored[0][0] if scored else 0.0
    return [c for score, c in scored if score >= cutoff and score >= best - 0.1][:3]


def _load_yaml(path: Path):
    """Parse one YAML config file: its OmegaConf mapping and ``{dotted key: (line, col)}``
    (1-based) of every key in it."""
    import yaml
    from omegaconf import DictConfig, OmegaConf

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
        loaded = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
        where = _key_positions(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        raise ConfigError(f"config file {at}: cannot parse YAML ({what})") from exc
    except Exception as exc:
        raise ConfigError(
            f"config file {path}: cannot parse YAML ({str(exc).splitlines()[0]})"
        ) from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys at the top level")
    return loaded, where


def _key_positions(node, prefix: str = "") -> dict[str, tuple[int, int]]:
    """``{dotted key: (line, column)}`` (1-based) of every mapping key under a YAML node."""
    import yaml

    out: dict[str, tuple[int, int]] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            out[dotted] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            out.update(_key_positions(value_node, f"{dotted}."))
    return out


def _located(message: str, key: str | None, yaml_path, where: dict) -> str:
    """``message`` prefixed with ``file:line:column`` of ``key`` (or its deepest parent)
    in the YAML file, when it is there."""
    while key and key not in where:
        key = key.rpartition(".")[0]
    if not key:
        return message
    line, column = where[key]
    return f"config file {yaml_path}:{line}:{column}: {message}"


def _failing_section(node, cls, prefix: str = "") -> str:
    """Dotted path (with a trailing dot) of the deepest section whose dataclass fails to build.

    Dataclass checks raise without knowing where they sit in the experiment config; this
    rebuilds each nested section on its own to find the one that raised.
    """
    from omegaconf import OmegaConf

    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        sub_cls = hints[f.name]
        if not is_dataclass(sub_cls):
            continue
        try:
            OmegaConf.to_object(node[f.name])
        except Exception:
            return _failing_section(node[f.name], sub_cls, f"{prefix}{f.name}.")
    return prefix


def _omegaconf_message(exc, root: type = ExperimentConfig) -> str:
    """One line from an OmegaConf error: what went wrong and the full key (the
    closest keys of ``root`` for an unknown one)."""
    key = getattr(exc, "full_key", None)
    head = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "Key" in type(exc).__name__ and key:
        return f"unknown config key {key!r}{did_you_mean(key, root)}"
    return f"config key {key!r}: {head}" if key else head


def to_yaml(config) -> str:
    """The resolved config (an :class:`ExperimentConfig` or another config dataclass) as
    YAML (written into the run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))
