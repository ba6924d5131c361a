"""Every component built for an experiment uses the values of its ``ExperimentConfig``.

:func:`~areal_fast.launch.worker_specs.cluster_spec` builds the worker specs, the engine and
trainer factories; the factories build the HF engine and the trainer on the tiny model. Each
value a component actually uses (the torch optimizer's learning rate, the engine's batch
size, the trainer's micro-batch budget, ...) is compared with the config's, for the default
config and for one in which every one of those values differs from its default, so a
component that keeps its own default for a setting, or a setting that is not handed on,
fails here. A last check keeps the component dataclasses from restating config fields.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_fast.launch.cluster import ClusterSpec
from areal_fast.launch.config import ConfigError, ExperimentConfig, load_config
from areal_fast.launch.factories import HFEngineFactory, TorchTrainerFactory
from areal_fast.launch.worker_specs import cluster_spec
from areal_fast.train.fsdp import FSDPTrainEngine
from areal_fast.train.torch_engine import TorchTrainEngine
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

# every value below differs from its default
CHANGED = [
    "actor.keep_groups=false",
    "actor.use_decoupled_loss=false",
    "actor.adv_mode=rloo",
    "actor.max_tokens_per_mb=2048",
    "actor.pack_method=ffd",
    "actor.prox_logp_method=loglinear",
    "actor.ppo_n_minibatches=2",
    "actor.loss.eps_clip=0.3",
    "actor.loss.behav_weight_cap=4.0",
    "actor.loss.aggregation=token_sum",
    "actor.optim.lr=3e-4",
    "actor.optim.beta1=0.8",
    "actor.optim.beta2=0.99",
    "actor.optim.eps=1e-6",
    "actor.optim.weight_decay=0.01",
    "actor.optim.grad_clip=0.5",
    "actor.optim.lr_schedule=linear",
    "actor.optim.warmup_steps=2",
    "rollout.temperature=0.9",
    "rollout.max_batch_size=8",
    "rollout.num_workers=2",
    "model.dtype=bfloat16",
    "scheduler.train_world_size=2",
    "scheduler.dist_timeout=30",
    "scheduler.bind_host=127.0.0.2",
    "launcher.startup_timeout=77",
    "total_steps=7",
    "seed=5",
]


@pytest.fixture(params=["default", "changed"])
def cfg(request, tiny_model_dir, tmp_path) -> ExperimentConfig:
    overrides = [f"model.path={tiny_model_dir}", f"fileroot={tmp_path}"]
    if request.param == "changed":
        overrides += CHANGED
    return load_config(None, overrides)


def test_changed_config_changes_every_value():
    """Each override of CHANGED sets a value other than the default (else the 'changed'
    case would not tell a component's own default from the config's)."""
    default = load_config(None, [])
    for override in CHANGED:
        key, _ = override.split("=", 1)
        node_default, node_changed = default, load_config(None, [override])
        for part in key.split("."):
            node_default, node_changed = getattr(node_default, part), getattr(node_changed, part)
        assert node_changed != node_default, override


def test_cluster_spec_carries_the_config(cfg):
    spec = cluster_spec(cfg)
    bind_host = cfg.scheduler.bind_host or "127.0.0.1"  # None: loopback for local processes
    assert spec.num_rollout_workers == cfg.rollout.num_workers
    assert spec.train_world_size == cfg.scheduler.train_world_size
    assert spec.bind_host == bind_host
    assert spec.startup_timeout == cfg.launcher.startup_timeout
    assert spec.rollout_spec().host == bind_host
    engine_factory = spec.rollout.engine_factory
    assert isinstance(engine_factory, HFEngineFactory)
    assert engine_factory.model == cfg.model and engine_factory.rollout == cfg.rollout
    trainer_factory = spec.trainer.trainer_factory
    assert isinstance(trainer_factory, TorchTrainerFactory)
    assert trainer_factory.model == cfg.model
    assert trainer_factory.actor == cfg.actor and spec.trainer.actor == cfg.actor
    assert trainer_factory.rollout.temperature == cfg.rollout.temperature
    assert trainer_factory.seed == cfg.seed
    assert trainer_factory.total_steps == cfg.total_steps
    ranks = spec.trainer_specs()
    assert len(ranks) == cfg.scheduler.train_world_size
    for rank, rank_spec in enumerate(ranks):
        assert rank_spec.rank == rank
        assert rank_spec.world_size == cfg.scheduler.train_world_size
        assert rank_spec.actor.adv_mode == cfg.actor.adv_mode
        if cfg.scheduler.train_world_size > 1:
            factory = rank_spec.trainer_factory
            assert (factory.rank, factory.world_size) == (rank, cfg.scheduler.train_world_size)
            assert factory.dist_timeout == cfg.scheduler.dist_timeout
            assert factory.dist_init_method.startswith(f"tcp://{bind_host}:")


def test_hf_engine_uses_the_config(cfg):
    engine, decode = cluster_spec(cfg).rollout.engine_factory()
    assert engine.max_batch_size == cfg.rollout.max_batch_size
    param = next(engine.model.parameters())
    assert param.dtype == getattr(torch, cfg.model.dtype)
    assert param.device == torch.device(cfg.model.device)
    assert decode([]) == ""


def test_trainer_uses_the_config(cfg):
    """Rank 0's factory as the cluster spec holds it (a single process: the group is joined
    only by the per-rank copies)."""
    trainer = cluster_spec(cfg).trainer.trainer_factory()
    assert type(trainer) is TorchTrainEngine and not isinstance(trainer, FSDPTrainEngine)
    a = cfg.actor
    assert trainer.actor == a
    assert trainer.keep_groups == a.keep_groups
    assert trainer.use_decoupled_loss == a.use_decoupled_loss
    assert trainer.prox_logp_method == a.prox_logp_method
    assert trainer.ppo_n_minibatches == a.ppo_n_minibatches
    assert trainer.max_tokens_per_mb == a.max_tokens_per_mb
    assert trainer.pack_method == a.pack_method
    assert trainer.loss_config == a.loss
    assert trainer.loss_config.eps_clip == a.loss.eps_clip
    assert trainer.loss_config.behav_weight_cap == a.loss.behav_weight_cap
    assert trainer.temperature == cfg.rollout.temperature
    assert trainer.total_steps == cfg.total_steps
    assert trainer.ref_model is None  # loss.kl_coef = 0
    group = trainer.optimizer.param_groups[0]
    o = a.optim
    assert group["initial_lr"] == o.lr
    assert group["betas"] == (o.beta1, o.beta2)
    assert group["eps"] == o.eps and group["weight_decay"] == o.weight_decay
    assert trainer.optim.grad_clip == o.grad_clip
    expected_factor = 1 / (o.warmup_steps + 1) if o.warmup_steps else 1.0
    assert group["lr"] == pytest.approx(o.lr * expected_factor, rel=1e-12)
    assert next(trainer.model.parameters()).dtype == getattr(torch, cfg.model.dtype)


# Fields a component may hold although a config section has a field of that name: filled
# per rank / per worker from the config by ClusterSpec (its trainer_specs / rollout_spec), or
# derived from several keys (threads: worker_threads(cfg) from threads and launcher.*).
ALLOWED = {
    (TorchTrainerFactory, "dist_timeout"),
    (RolloutWorkerSpec, "host"),
    (TrainerWorkerSpec, "host"),
    (RolloutWorkerSpec, "threads"),
    (TrainerWorkerSpec, "threads"),
    # the trainer's distributed rank, not actor.lora.rank
    (TorchTrainerFactory, "rank"),
    (TrainerWorkerSpec, "rank"),
}


def _config_field_names() -> set[str]:
    """Every field name of the config sections, at every depth (``model.*``, ...)."""
    names, todo = set(), [ExperimentConfig]
    while todo:
        for f in dataclasses.fields(todo.pop()):
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            if dataclasses.is_dataclass(default):
                todo.append(type(default))
            else:
                names.add(f.name)
    return names - {"seed", "total_steps"}  # run-level values the trainer takes as such


@pytest.mark.parametrize(
    "component",
    [HFEngineFactory, TorchTrainerFactory, TrainerWorkerSpec, RolloutWorkerSpec, ClusterSpec],
)
def test_components_restate_no_config_field(component):
    restated = {f.name for f in dataclasses.fields(component)} & _config_field_names()
    restated -= {name for cls, name in ALLOWED if cls is component}
    assert not restated, (
        f"{component.__name__} restates config fields {sorted(restated)}: "
        f"carry the config dataclass instead"
    )


def test_behav_weight_cap_has_one_key():
    """The cap lives in ``actor.loss``; ``actor.behav_weight_cap`` is not a key."""
    assert load_config(None, ["actor.loss.behav_weight_cap=5"]).actor.loss.behav_weight_cap == 5
    with pytest.raises(ConfigError, match="behav_weight_cap"):
        load_config(None, ["actor.behav_weight_cap=5"])
