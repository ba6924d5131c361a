"""The main job's GPU path: which weight path the cluster gives each rollout worker from the GPUs
the workers report (CUDA IPC for an engine on the trainer's GPU, shared memory otherwise), what
the trainer is told about its host slots, the one-line errors of impossible settings, the
GPU example config; on a GPU, a 2-step job of the tiny model through CUDA IPC."""

from __future__ import annotations

import json

import pytest
import torch
from linked_job import REPO, job_args  # noqa: E402 - beside this file

from areal_fast.cli import main
from areal_fast.launch import cluster as cluster_module
from areal_fast.launch.cluster import Cluster, ClusterSpec
from areal_fast.sync.config import SyncConfig
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


class _Handle:
    """A worker handle that records what the cluster sends it."""

    pid = None

    def __init__(self, name: str):
        self.name, self.sent = name, []

    def send(self, message) -> None:
        self.sent.append(message)

    def stop(self, grace_seconds: float = 0.0) -> None:
        pass


class _Cluster(Cluster):
    def _start_worker(self, name, target, spec, env=None):
        return _Handle(name)


def _cluster(monkeypatch, gpus: dict, transport: str = "auto") -> Cluster:
    """A started cluster of stand-in workers that report ``gpus`` (worker name → UUID)."""

    def ready(handles, timeout, what):
        for handle in handles:
            yield handle, msg.WorkerReady(handle.name, gpu_uuid=gpus.get(handle.name, ""))

    monkeypatch.setattr(cluster_module, "wait_messages", ready)
    spec = ClusterSpec(
        rollout=RolloutWorkerSpec(engine_factory=None, reward_fn=None),
        trainer=TrainerWorkerSpec(trainer_factory=None),
        num_rollout_workers=2,
        sync=SyncConfig(transport=transport),
    )
    return _Cluster(spec).__enter__()


def test_engines_on_the_trainers_gpu_take_cuda_ipc_and_the_trainer_skips_host_slots(
    monkeypatch,
):
    cluster = _cluster(monkeypatch, {"trainer": GPU_A, "rollout-0": GPU_A, "rollout-1": GPU_A})
    assert cluster.transports == {"rollout-0": "cuda_ipc", "rollout-1": "cuda_ipc"}
    assert cluster.gpus == {"trainer": GPU_A, "rollout-0": GPU_A, "rollout-1": GPU_A}
    assert cluster.trainer.sent == [msg.SlotReaders(host=False)]
    assert all(w.sent == [] for w in cluster.rollout_workers)  # no link to connect
    # a replacement that lands on another GPU cannot read the slots the trainer writes
    with pytest.raises(WorkerError) as info:
        cluster.gpus["rollout-1"] = GPU_B
        cluster.link_weights(cluster.rollout_workers[1])
    text = str(info.value)
    assert "rollout worker 'rollout-1' needs the trainer's host slots (shm)" in text
    assert "\n" not in text


def test_an_engine_on_another_gpu_maps_host_slots_which_the_trainer_keeps_writing(monkeypatch):
    cluster = _cluster(monkeypatch, {"trainer": GPU_A, "rollout-0": GPU_A, "rollout-1": GPU_B})
    assert cluster.transports == {"rollout-0": "cuda_ipc", "rollout-1": "shm"}
    assert cluster.trainer.sent == [msg.SlotReaders(host=True)]


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_a_cpu_trainer_or_forced_shm_keeps_every_worker_on_host_slots(monkeypatch, transport):
    gpus = {"rollout-0": GPU_A} if transport == "auto" else {"trainer": GPU_A, "rollout-0": GPU_A}
    cluster = _cluster(monkeypatch, gpus, transport)
    assert cluster.transports == {"rollout-0": "shm", "rollout-1": "shm"}
    assert cluster.trainer.sent == ([] if transport == "auto" else [msg.SlotReaders(host=True)])


def test_forced_cuda_ipc_without_a_cuda_trainer_is_one_line_naming_the_worker(monkeypatch):
    with pytest.raises(WorkerError) as info:
        _cluster(monkeypatch, {"rollout-0": GPU_A, "rollout-1": GPU_A}, "cuda_ipc")
    text = str(info.value)
    assert text.startswith("rollout worker 'rollout-0': sync.transport = 'cuda_ipc' needs")
    assert "the trainer keeps no CUDA slots" in text and "\n" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_cuda_ipc_on_a_cpu_job_fails_before_anything_starts(tmp_path, capsys):
    args = job_args(tmp_path / "model", tmp_path, "ipc", "sync.transport=cuda_ipc")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "sync.transport = 'cuda_ipc' needs model.device = cuda and rollout.engine = hf" in err
    assert "model.device = 'cpu'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "grpo-arith").exists()


def test_the_gpu_example_is_the_cpu_recipe_on_cuda_in_bfloat16():
    from areal_fast.launch.config import load_config

    cuda = load_config(str(REPO / "examples" / "arith_cuda.yaml"), ["model.device=cpu"])
    cpu = load_config(str(REPO / "examples" / "arith.yaml"))
    assert (cuda.model.dtype, cuda.sync.transport) == ("bfloat16", "cuda_ipc")
    assert cuda.actor.max_tokens_per_mb == 32768 and cuda.rollout.max_batch_size == 192
    for section in ("data", "eval"):
        assert getattr(cuda, section) == getattr(cpu, section)
    assert cuda.actor.loss == cpu.actor.loss and cuda.actor.optim == cpu.actor.optim
    assert (cuda.total_steps, cuda.batch_size, cuda.seed) == (cpu.total_steps, 16, cpu.seed)
    # the longest sequence of the recipe fits a micro-batch many times over
    assert cuda.actor.max_tokens_per_mb >= 64 * (cuda.rollout.max_new_tokens + 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_the_gpu_example_names_the_device_on_a_machine_without_cuda():
    from areal_fast.launch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.device") as info:
        load_config(str(REPO / "examples" / "arith_cuda.yaml"))
    assert "\n" not in str(info.value)


def test_the_trainer_factory_keeps_float32_master_weights_on_cuda_only():
    from dataclasses import replace

    from areal_fast.launch.factories import TorchTrainerFactory
    from areal_fast.models.config import ModelConfig

    cpu = TorchTrainerFactory(ModelConfig(dtype="bfloat16"))
    assert not cpu.mixed_precision and cpu.weights_dtype == "bfloat16"
    assert not TorchTrainerFactory(ModelConfig()).mixed_precision
    if torch.cuda.is_available():
        gpu = replace(cpu, model=ModelConfig(dtype="bfloat16", device="cuda"))
        assert gpu.mixed_precision and gpu.weights_dtype == "bfloat16"


@pytest.mark.cuda
@CUDA
def test_a_two_step_job_on_cuda_sends_every_version_by_cuda_ipc(tiny_model_dir, tmp_path):
    args = job_args(
        tiny_model_dir,
        tmp_path,
        "cuda",
        "model.device=cuda",
        "model.dtype=bfloat16",
        "sync.transport=auto",
        "total_steps=2",
        "actor.max_tokens_per_mb=32768",
    )
    assert main(args) == 0
    run_dir = tmp_path / "grpo-arith" / "cuda"
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert summary["weight_transports"] == {"rollout-0": "cuda_ipc", "rollout-1": "cuda_ipc"}
    assert summary["steps"] == 2 and len(records) == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    for name in ("rollout-0", "rollout-1"):
        assert summary["weight_versions"][name] == [1, 2]
    for version in ("1", "2"):  # every worker installed exactly the trainer's bytes
        crcs = summary["weight_checksums"][version]
        assert set(crcs) == {"trainer", "rollout-0", "rollout-1"}
        assert len(set(crcs.values())) == 1, crcs
    latency = summary["weight_update_latency_seconds"]
    assert len(latency) == 2 and all(0 <= x < 60 for x in latency)
