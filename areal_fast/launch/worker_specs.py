"""What each worker process is told, built from the config: threads, the rollout and trainer
specs, Ray's resources (checked before anything is written), and the cluster that starts them."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Optional

import torch

from areal_fast.data.rewards import math_reward
from areal_fast.data.user_reward import load_reward, resolve_path
from areal_fast.launch.checkpoints import ResumePoint
from areal_fast.launch.cluster import Cluster, ClusterSpec, LocalCluster, warn_failed_exits
from areal_fast.launch.config import ConfigError, ExperimentConfig
from areal_fast.launch.factories import TorchTrainerFactory, engine_factory
from areal_fast.launch.interrupt import signals_deferred
from areal_fast.wire.handles import WorkerError
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec


def worker_threads(cfg: ExperimentConfig) -> tuple[int, int]:
    """(trainer, rollout-worker) torch threads: ``launcher.*_threads`` when set; otherwise all
    cores each when η = 0 (trainer and engines take turns), else the cores split between the
    trainer and the rollout workers, which then run at the same time. With
    :func:`shared_cores` these are the shares a process keeps while the others work."""
    cores = cfg.threads or os.cpu_count() or 1
    if cfg.rollout.max_head_offpolicyness == 0:
        trainer, rollout = cores, max(1, cores // cfg.rollout.num_workers)
    else:
        trainer = max(1, cores // 2)
        rollout = max(1, (cores - trainer) // cfg.rollout.num_workers)
    return (cfg.launcher.trainer_threads or trainer, cfg.launcher.rollout_threads or rollout)


def shared_cores(cfg: ExperimentConfig) -> Optional[int]:
    """Cores the workers share with ``launcher.share_cores`` (``threads``, else all cores),
    or None where the threads stay fixed: sharing is off, ``launcher.trainer_threads`` or
    ``launcher.rollout_threads`` is set, ``rollout.reproducible``, the Ray launcher (its actors may be on other nodes),
    an engine other than hf (its threads are not the worker's own), a model on a GPU, or
    every worker's share already all the cores."""
    launcher = cfg.launcher
    if not launcher.share_cores or launcher.trainer_threads or launcher.rollout_threads:
        return None
    if cfg.rollout.reproducible:  # thread counts are part of what a run reproduces
        return None
    on_cpu = torch.device(cfg.model.device).type == "cpu"
    if cfg.scheduler.type != "local" or cfg.rollout.engine != "hf" or not on_cpu:
        return None
    cores = cfg.threads or os.cpu_count() or 1
    return cores if min(worker_threads(cfg)) < cores else None


def agent_spec(cfg: ExperimentConfig):
    """The rollout workers' agent workload (None without ``agent.path``); the trajectory
    store goes to ``<run dir>/trajectories`` unless ``trajectory.directory`` is set."""
    from areal_fast.agent.workload import AgentWorkloadSpec

    if not cfg.agent.path:
        return None
    store = cfg.trajectory
    if store.enabled and not store.directory:
        store = replace(store, directory=str(cfg.run_dir / "trajectories"))
    return AgentWorkloadSpec(cfg.agent, cfg.model.path, store)


def cluster_spec(cfg: ExperimentConfig, resume_from: str = "") -> ClusterSpec:
    """Worker specs of one experiment: the engines of ``rollout.engine``, the torch trainer
    (its ranks), math rewards or ``reward.path`` (or the configured agent); ``resume_from`` is
    a checkpoint to load.

    The specs carry the config's own sections (``cfg.model``, ``cfg.rollout``, ``cfg.actor``,
    ``cfg.scheduler``, ``cfg.launcher``), so every worker uses the values set there.
    """
    trainer_threads, rollout_threads = worker_threads(cfg)
    engine = engine_factory(cfg.model, cfg.rollout, rollout_threads, cfg.actor.lora.rank)
    trainer = TorchTrainerFactory(
        cfg.model, cfg.actor, cfg.rollout, seed=cfg.seed, total_steps=cfg.total_steps
    )
    spool = str(cfg.run_dir / "shards") if cfg.recovery.spool_shards else None
    sync, reward = cfg.sync, cfg.reward
    if reward.path:  # the workers load it by path, wherever they run
        reward = replace(reward, path=resolve_path(reward.path))
    if sync.transport == "disk" and not sync.disk_dir:
        sync = replace(sync, disk_dir=str(cfg.run_dir / "weights"))
    return ClusterSpec(
        rollout=RolloutWorkerSpec(
            engine,
            math_reward,
            threads=rollout_threads,
            agent=agent_spec(cfg),
            spool_dir=spool,
            sync=sync,
            reward=reward,
        ),
        trainer=TrainerWorkerSpec(
            trainer,
            cfg.actor,
            threads=trainer_threads,
            resume_from=resume_from,
            sync=sync,
            slots=cfg.rollout.weight_slots,
        ),
        num_rollout_workers=cfg.rollout.num_workers,
        scheduler=cfg.scheduler,
        launcher=cfg.launcher,
        workers_file=str(cfg.run_dir / "workers.json"),
        shared_cores=shared_cores(cfg),
        sync=sync,
    )


def check_reward(cfg: ExperimentConfig) -> None:
    """Fail before any worker starts when ``reward.path`` cannot be loaded or called (its
    module is imported here, in the controller process, as in every rollout worker).

    Raises
    ------
    ConfigError
        One line naming ``reward.path``: see :func:`~areal_fast.data.user_reward.load_reward`;
        or ``reward.path`` set together with ``agent.path`` (an agent returns its reward).
    """
    if not cfg.reward.path:
        return
    if cfg.agent.path:
        raise ConfigError(
            f"reward.path = {cfg.reward.path!r} is set together with agent.path = "
            f"{cfg.agent.path!r}: an agent's run_agent_return_reward returns the reward; unset one"
        )
    try:
        load_reward(cfg.reward.path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_sync(cfg: ExperimentConfig) -> None:
    """Fail before any worker starts when ``sync.transport=disk`` cannot write the folder
    ``sync.disk_dir`` (a link would fail only in the workers, one restart after another), or
    ``sync.transport=cuda_ipc`` is set without a CUDA trainer and HF engine.

    Raises
    ------
    ConfigError
        Naming ``sync.disk_dir`` and the system's reason, or the keys that rule out CUDA IPC.
    """
    import tempfile
    from pathlib import Path

    cuda_ok = cfg.model.device.startswith("cuda") and cfg.rollout.engine == "hf"
    if cfg.sync.transport == "cuda_ipc" and not cuda_ok:
        raise ConfigError(
            "sync.transport = 'cuda_ipc' needs model.device = cuda and rollout.engine = hf (the "
            f"trainer and the engine on one GPU), not model.device = {cfg.model.device!r} and "
            f"rollout.engine = {cfg.rollout.engine!r}"
        )
    if cfg.sync.transport != "disk" or not cfg.sync.disk_dir:  # <run dir>/weights: the run's
        return
    folder = Path(cfg.sync.disk_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"sync.disk_dir = {str(folder)!r} is not a folder this job can write "
            f"({exc.strerror or exc})"
        ) from None


def check_resources(cfg: ExperimentConfig) -> None:
    """Fail before anything is written when a local Ray instance cannot hold the workers.

    With ``scheduler.type=ray`` and no ``scheduler.ray_address``, the Ray launcher starts a
    Ray instance of ``scheduler.ray_num_cpus`` CPUs (default: the cores Ray sees) and the
    GPUs torch sees; every trainer rank and rollout worker needs its bundle
    (``scheduler.cpus_per_*`` / ``gpus_per_*``). A cluster that is joined is checked when
    the launcher connects to it.

    Raises
    ------
    ConfigError
        The workers need more CPUs or GPUs than the local instance has; the message shows
        the sum and names the keys (a missing Ray is
        :func:`~areal_fast.launch.packages.check_packages`'s).
    """
    s = cfg.scheduler
    if s.type != "ray" or s.ray_address is not None:
        return
    ranks, workers = s.train_world_size, cfg.rollout.num_workers
    have = {"CPU": s.ray_num_cpus or _ray_cpus(), "GPU": torch.cuda.device_count()}
    for resource, kind in (("CPU", "cpus"), ("GPU", "gpus")):
        per_rank = getattr(s, f"{kind}_per_trainer_rank")
        per_worker = getattr(s, f"{kind}_per_rollout_worker")
        need = ranks * per_rank + workers * per_worker
        if need > have[resource]:
            where = (
                "scheduler.ray_num_cpus" if resource == "CPU" and s.ray_num_cpus else "this machine"
            )
            raise ConfigError(
                f"scheduler: the Ray workers need {need:g} {resource}s (scheduler."
                f"train_world_size {ranks} × scheduler.{kind}_per_trainer_rank {per_rank:g} + "
                f"rollout.num_workers {workers} × scheduler.{kind}_per_rollout_worker "
                f"{per_worker:g}), a local Ray instance has {have[resource]:g} ({where}); "
                f"lower scheduler.{kind}_per_* (fractions are allowed) or the worker counts"
            )


def _ray_cpus() -> float:
    """CPUs a local Ray instance gets by default (Ray's own count: cgroup quotas too)."""
    try:
        from ray._private.utils import get_num_cpus

        return float(get_num_cpus())
    except Exception:  # noqa: BLE001 - a Ray without that helper: count the cores
        return float(
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )


def make_cluster(cfg: ExperimentConfig, spec: ClusterSpec) -> Cluster:
    """The launcher ``scheduler.type`` names: local processes or Ray actors."""
    if cfg.scheduler.type == "ray":
        from areal_fast.launch.ray_cluster import RayCluster

        return RayCluster(spec, cfg.scheduler)
    return LocalCluster(spec)


@contextlib.contextmanager
def started_workers(cfg: ExperimentConfig, start: ResumePoint):
    """Start every worker (the trainer from ``start``'s checkpoint) and stop them all when
    the block ends; yields the started :class:`Cluster`.

    A Ctrl-C in the block stops the workers with further signals held back; after a block
    that succeeded, a worker that exited non-zero is logged.

    Raises
    ------
    WorkerError
        A worker failed to start (a trainer that fails on the checkpoint marks it damaged),
        or the trainer started at another version than the checkpoint's.
    """
    cluster = make_cluster(
        cfg, cluster_spec(cfg, resume_from=str(start.latest.path) if start.latest else "")
    )
    try:
        cluster.__enter__()
    except WorkerError as exc:
        start.mark_damaged_by(exc)
        raise
    try:
        if cluster.trainer_version != start.version:
            raise WorkerError(
                f"trainer {cluster.trainer.name!r} started at version "
                f"{cluster.trainer_version}, the checkpoint is of version {start.version}",
                cluster.trainer.name,
            )
        yield cluster
    except KeyboardInterrupt as exc:
        with signals_deferred():  # stopping the workers must not be cut short
            cluster.__exit__(type(exc), exc, exc.__traceback__)
        raise
    except BaseException as exc:
        cluster.__exit__(type(exc), exc, exc.__traceback__)
        raise
    cluster.__exit__(None, None, None)
    warn_failed_exits(cluster)
