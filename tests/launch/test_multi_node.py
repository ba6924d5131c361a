# ruff: noqa: F811 - the two_node_ray fixture is imported, then requested by name
"""The main job on a Ray cluster of two separate nodes (:mod:`two_node_ray`: the second node
at 127.0.0.2 with a private ``/dev/shm``, so its processes cannot map the head node's shared
memory): 2 FSDP2 gloo trainer ranks and 2 rollout workers, one of each per node
(``placement_strategy=SPREAD``). The rollout worker on trainer rank 0's node maps its slots;
the other one gets every version over its gloo link.

Real ``python -m areal_fast.launch.ray train`` processes on the tiny model; workers are
killed with SIGKILL by the process ids of ``workers.json`` (both nodes share this machine's
process table); a process on the second node is one in another mount namespace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from linked_job import JOB_CWD, STEPS, job_args  # noqa: E402 - beside this file
from two_node_ray import two_node_ray  # noqa: F401, F811 - the fixture

from areal_fast.cli import main

WORKERS = ("trainer", "trainer-1", "rollout-0", "rollout-1")


def _args(model_dir, root, trial, *extra):
    return job_args(
        model_dir,
        root,
        trial,
        "launcher.startup_timeout=180",
        "launcher.timeouts.train_step=180",
        *extra,
    )


def _ray_args(cluster, *extra):
    # one CPU a worker: a node (CPUS_PER_NODE = 2) holds two of the four bundles, so Ray's
    # best-effort SPREAD puts trainer ranks 0 and 1 (bundles 0, 1) on different nodes and the
    # two rollout workers in the CPU each node has left; with half a CPU a worker it may
    # place three bundles on one node
    return [
        f"scheduler.ray_address={cluster.address}",
        "scheduler.train_world_size=2",
        "scheduler.placement_strategy=SPREAD",
        "scheduler.cpus_per_rollout_worker=1",
        "scheduler.cpus_per_trainer_rank=1",
        *extra,
    ]


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "areal_fast.launch.ray", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=JOB_CWD,
        env=env,
    )


def _finish(proc: subprocess.Popen, timeout: float = 420.0) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-5000:]
    return out


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def _wait(predicate, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.05)


def _on_node2(pid: int) -> bool:
    """Whether process ``pid`` runs on the second node (its own mount namespace)."""
    return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]


def _check_layout(summary: dict, cluster) -> tuple[str, str]:
    """One trainer rank and one rollout worker per node; returns (local, remote) rollout
    worker names (remote: not on trainer rank 0's node)."""
    nodes = summary["worker_nodes"]
    assert set(nodes) == set(WORKERS) and set(nodes.values()) == set(cluster.node_ids), nodes
    assert nodes["trainer"] != nodes["trainer-1"] and nodes["rollout-0"] != nodes["rollout-1"]
    local = next(w for w in ("rollout-0", "rollout-1") if nodes[w] == nodes["trainer"])
    remote = "rollout-1" if local == "rollout-0" else "rollout-0"
    assert summary["weight_transports"] == {local: "shm", remote: "broadcast"}
    return local, remote


def _check_weights(summary: dict, first: int = 1) -> None:
    """Every worker's installed weights equal the trainer's, bit for bit, every version."""
    for version in range(first, STEPS + 1):
        crcs = summary["weight_checksums"][str(version)]
        assert "trainer" in crcs and len(crcs) >= 2 and len(set(crcs.values())) == 1, crcs


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """η = 0 on one node: the local launcher, one trainer process, 2 rollout workers."""
    root = tmp_path_factory.mktemp("local")
    extra = ["rollout.max_head_offpolicyness=0", "checkpoint.every_steps=2"]
    assert main(_args(tiny_model_dir, root, "ref", *extra)) == 0
    return _losses(root / "grpo-arith" / "ref")


def test_two_nodes_eta1_remote_worker_served_over_the_network(
    two_node_ray,
    tiny_model_dir,
    tmp_path,
):
    args = _args(tiny_model_dir, tmp_path, "eta1", "rollout.max_head_offpolicyness=1")
    _finish(_start([*args, *_ray_args(two_node_ray)], two_node_ray.env))
    summary = _summary(tmp_path / "grpo-arith" / "eta1")
    _, remote = _check_layout(summary, two_node_ray)
    # every accepted group trained once; the others dropped for a counted reason (too stale
    # at η = 1, or not needed at the end), none lost
    dropped = summary["rollouts_dropped"]
    assert summary["rollouts_trained"] == STEPS * 4
    assert set(dropped) <= {"stale", "unused_at_end", "in_flight_at_end"}, dropped
    assert summary["rollouts_submitted"] == STEPS * 4 + sum(dropped.values())
    # the remote worker serves every new version, in order, each bit-exact with the trainer's
    assert summary["weight_versions"][remote] == list(range(1, STEPS + 1))
    _check_weights(summary)
    assert len(summary["weight_update_latency_seconds"]) == STEPS


def test_two_nodes_remote_trainer_rank_dies_job_resumes(
    two_node_ray,
    tiny_model_dir,
    tmp_path,
    reference,
):
    """η = 0: the losses of the two-node job equal the one-node run's, also after the trainer
    rank on the second node is killed and the job resumes from its checkpoint."""
    run_dir = tmp_path / "grpo-arith" / "trainer"
    extra = ["rollout.max_head_offpolicyness=0", "checkpoint.every_steps=2"]
    args = [*_args(tiny_model_dir, tmp_path, "trainer", *extra), *_ray_args(two_node_ray)]
    proc = _start(args, two_node_ray.env)
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    _wait(lambda: _steps_done(run_dir) >= 3 and checkpoint.is_dir(), proc)
    pids = json.loads((run_dir / "workers.json").read_text())
    victim = next(name for name in ("trainer", "trainer-1") if _on_node2(pids[name]))
    os.kill(pids[victim], signal.SIGKILL)
    _finish(proc)
    summary = _summary(run_dir)
    assert summary["trainer_restarts"] == 1
    _check_layout(summary, two_node_ray)
    losses = _losses(run_dir)
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
    _check_weights(summary, first=3)  # the resumed attempt's versions


def test_two_nodes_remote_rollout_worker_dies_restarted_with_current_weights(
    two_node_ray,
    tiny_model_dir,
    tmp_path,
):
    run_dir = tmp_path / "grpo-arith" / "rollout"
    extra = ["rollout.max_head_offpolicyness=1", "rollout.drop_stale=false"]
    proc = _start(
        [*_args(tiny_model_dir, tmp_path, "rollout", *extra), *_ray_args(two_node_ray)],
        two_node_ray.env,
    )
    _wait(lambda: _steps_done(run_dir) >= 2 and (run_dir / "workers.json").is_file(), proc)
    pids = json.loads((run_dir / "workers.json").read_text())
    on_node2 = _on_node2(pids["trainer"])
    remote = next(w for w in ("rollout-0", "rollout-1") if _on_node2(pids[w]) != on_node2)
    os.kill(pids[remote], signal.SIGKILL)
    _finish(proc)
    summary = _summary(run_dir)
    assert summary["rollout_worker_restarts"] == 1
    assert summary["weight_transports"][remote] == "broadcast"
    assert summary["rollouts_trained"] == STEPS * 4
    assert set(summary["rollouts_dropped"]) <= {"unused_at_end", "in_flight_at_end"}
    served = summary["weight_versions"][remote]  # the old worker's, then the new one's
    assert served == sorted(served) and served[-1] == STEPS, served
    assert 0 < summary["rollout_recovery_seconds"][0] < 120
    _check_weights(summary)
