"""The main job with vLLM rollouts (``rollout.engine=vllm`` / ``vllm_server``), end to end.

Runs in CI's vLLM lane (``.ci/vllm_lane``): real ``areal-fast train`` processes on the demo
model, one rollout worker, η = 1, three jobs that between them cover both pause modes, both
weight paths (the trainer's shared-memory slot, a gloo link into the worker's own buffer),
LoRA adapters, vLLM's engine core killed mid-run, the `vllm serve` engine and an agent.

Data: the offline arithmetic task of ``examples/arith.yaml`` (generated, nothing outside the
repository), with an instruction that asks for the working: completions then run long
(measured: a mean of 42-64 of the 64 allowed tokens), and one sequence at a time in the engine
(``rollout.max_batch_size=1``) makes generating the next batch outlast a train step (1.6-2.3x
measured), so weight updates land mid-generation.
The jobs run with a temporary working directory: the checkout's ``areal_fast`` (no compiled
extension) must not shadow the installed one.
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

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BATCH, GROUP, EVAL = 2, 2, 2
WORKING = "Work it out step by step, then give the final answer as a number."


def _args(root: Path, trial: str, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"fileroot={root}",
        f"trial_name={trial}",
        f"total_steps={steps}",
        "data.train_size=64",
        f"data.eval_size={EVAL}",
        f"data.instruction={WORKING}",
        f"batch_size={BATCH}",
        f"rollout.group_size={GROUP}",
        "rollout.max_new_tokens=64",
        "eval.max_new_tokens=8",
        "rollout.max_head_offpolicyness=1",
        # one sequence at a time in the engine: generating a batch outlasts a train step
        "rollout.max_batch_size=1",
        "rollout.vllm.dtype=float32",
        "rollout.vllm.max_model_len=512",
        "model.dtype=float32",
        "launcher.startup_timeout=300",
        "checkpoint.final_model=false",  # not a vLLM path; saves writing 540 MB
        *extra,
    ]


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "areal_fast.cli", *args]


def _run(args: list[str], cwd: Path, timeout: float = 600.0) -> str:
    proc = subprocess.run(_command(args), capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_job(run_dir: Path, steps: int) -> dict:
    """What every vLLM job must satisfy; returns summary.json."""
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    # step 1 trains version-0 samples with version-0 weights: the trainer's recomputed
    # log-probs are the engine's behaviour log-probs (fp32, at the sampling temperature)
    assert metrics[0]["staleness_max"] == 0
    assert metrics[0]["behav_logprob_abs_diff"] < 1e-4, metrics[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    # accounting: every submitted rollout was trained once or dropped with a counted reason
    dropped = sum(summary["rollouts_dropped"].values())  # by reason, "cancelled" included
    assert summary["rollouts_submitted"] == summary["rollouts_trained"] + dropped, summary
    assert summary["rollouts_trained"] == steps * BATCH
    # evaluation ran on the vLLM workers, before and after training
    for name in ("eval_before.jsonl", "eval_after.jsonl"):
        records = [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
        assert len(records) == EVAL and all(r["completion"] for r in records), name
    return summary


def _check_checksums(summary: dict) -> None:
    """``sync.checksum=true``: every version a worker loaded has the trainer's CRC."""
    versions = summary["weight_versions"]["rollout-0"]
    assert versions == sorted(versions) and versions[-1] == summary["steps"], summary
    for version in map(str, set(versions)):
        crcs = summary["weight_checksums"][version]
        assert set(crcs) == {"trainer", "rollout-0"} and len(set(crcs.values())) == 1, crcs


def test_abort_pause_shared_memory_and_lora(tmp_path):
    """2 steps in abort mode through the trainer's shared-memory slot, with LoRA rank 8:
    each version reaches vLLM as an adapter (the trainer's adapter bytes only) that the
    engine loads through vLLM's LoRA API; step 1's behaviour log-probs are the base model's,
    which a fresh adapter (B = 0) leaves unchanged. An update meets running samples, which
    come back partial and are resumed as prompt + partial. Versions never decrease within a
    sample: the rollout worker fails on one that does (the job would fail)."""
    extra = ["rollout.engine=vllm", "rollout.pause_mode=abort", "sync.transport=auto"]
    extra += ["actor.lora.rank=8", "actor.optim.lr=1e-4", "sync.checksum=true"]
    _run(_args(tmp_path, "abort", 2, *extra), tmp_path)
    summary = _check_job(tmp_path / "grpo-arith" / "abort", 2)
    assert summary["rollout_worker_restarts"] == 0
    assert summary["weight_transports"] == {"rollout-0": "shm"}
    assert summary["weight_versions"]["rollout-0"] == [1, 2]
    _check_checksums(summary)
    assert summary["sample_interruptions"] > 0, summary
    # SmolLM2-135M: 30 layers, 7 adapted linears each of (in + out) · r elements, float32
    dims = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
            "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}  # fmt: skip
    params = 30 * 8 * sum(i + o for i, o in dims.values())
    assert summary["trainable_parameters"] == params
    assert summary["weight_update_bytes"] == 4 * params


def test_keep_pause_broadcast_and_engine_core_death(tmp_path):
    """4 steps in keep mode, each version sent over the worker's gloo link into a buffer of
    its own that vLLM's workers map (as on a node without the trainer's slots). The samples
    of step 2 or 3 meet an update mid-generation: a version seam inside a sample. η = 2 here,
    so the rollout worker idles at an update only if it generated two batches within one
    train step; alone, one batch takes 1.6-2.3x a step, and a loaded machine that slows the
    trainer more than vLLM does not bring that under 0.5x. After step 3 vLLM's
    engine-core process is killed: the rollout worker fails naming the engine, recovery
    starts a new one, links it and loads the current weights, the job finishes and nothing
    accepted is lost (every step trains a whole batch)."""
    extra = ["rollout.engine=vllm", "rollout.pause_mode=keep", "sync.transport=broadcast"]
    extra += ["rollout.max_head_offpolicyness=2", "sync.checksum=true"]
    args = _args(tmp_path, "keep", 4, *extra)
    run_dir = tmp_path / "grpo-arith" / "keep"
    log = tmp_path / "job.log"  # a file, not a pipe: nobody reads while the job runs
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(args), stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        _wait_for_steps(proc, run_dir, 3, log, timeout=300)
        worker = json.loads((run_dir / "workers.json").read_text())["rollout-0"]
        cores = _engine_cores(worker)
        assert cores, f"no vLLM engine-core process under the rollout worker {worker}"
        os.kill(cores[0], signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    assert "vLLM engine" in out, out[-3000:]
    summary = _check_job(run_dir, 4)
    assert summary["rollout_worker_restarts"] >= 1
    assert summary["weight_transports"] == {"rollout-0": "broadcast"}
    _check_checksums(summary)
    # a seam in a batch trained before the engine core died
    seams = [m["sample_interruptions"] for m in _metrics(run_dir)]
    assert sum(seams[:3]) > 0, seams


def _wait_for_steps(
    proc: subprocess.Popen, run_dir: Path, steps: int, log: Path, timeout: float
) -> None:
    """Wait until the job has written the metrics of ``steps`` steps."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {steps} steps within {timeout:g} s"
        time.sleep(0.2)


def _engine_cores(worker: int) -> list[int]:
    """The vLLM engine-core processes of a rollout worker: its children started by
    multiprocessing's spawn (its resource tracker is not one)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == worker and ("spawn_main" in cmdline or "EngineCore" in cmdline):
            found.append(int(proc.name))
    return found


def test_agent_run_on_vllm_server(tmp_path):
    """The multi-turn agent example for 2 steps against a `vllm serve` the rollout worker
    starts itself: sessions' model calls share the server (continuous batching), every step
    trains a whole batch, and step 1's behaviour log-probs (the server's, token-exactly
    recorded per call) are the trainer's."""
    agent = REPO / "examples" / "agents" / "multiturn_math.py"
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "agent_multiturn.yaml"),
        "--no-progress",
        f"fileroot={tmp_path}",
        "trial_name=agent",
        "total_steps=2",
        f"batch_size={BATCH}",
        f"rollout.group_size={GROUP}",
        "rollout.max_new_tokens=16",
        "eval.max_new_tokens=8",
        "data.train_size=64",
        f"data.eval_size={EVAL}",
        f"agent.path={agent}:MultiTurnMathAgent",
        "rollout.engine=vllm_server",
        "rollout.max_head_offpolicyness=1",
        "rollout.vllm.dtype=float32",
        "rollout.vllm.max_model_len=1024",
        "model.dtype=float32",
        "launcher.startup_timeout=300",
        "checkpoint.final_model=false",
    ]
    _run(args, tmp_path)
    summary = _check_job(tmp_path / "agent-multiturn" / "agent", 2)
    assert summary["rollout_worker_restarts"] == 0
    assert summary["weight_versions"]["rollout-0"] == [1, 2]
    assert summary["weight_update_seconds"], summary
