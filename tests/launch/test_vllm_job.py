"""The main job with vLLM rollouts (``rollout.engine=vllm`` / ``vllm_server``), end to end.

Runs in the vLLM venv of .ci/run (``pytest -m vllm``): real ``areal-fast train`` processes on
the demo model, GSM8K prompts (long completions, so that generation outlasts a train step and
weight updates land mid-generation), one rollout worker, η = 1.
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
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


def _args(root: Path, trial: str, steps: int, *extra: str) -> list[str]:
    if not GSM8K.is_dir():
        pytest.skip(f"GSM8K data not found at {GSM8K}")
    return [
        "train",
        "--config",
        str(REPO / "examples" / "gsm8k.yaml"),
        "--no-progress",
        f"fileroot={root}",
        f"trial_name={trial}",
        f"total_steps={steps}",
        f"data.path={GSM8K}",
        "data.train_size=64",
        "data.eval_size=4",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=64",
        "eval.max_new_tokens=32",
        "rollout.max_head_offpolicyness=1",
        # one sequence at a time in the engine: generating a batch outlasts a train step
        "rollout.max_batch_size=1",
        "rollout.engine=vllm",
        "rollout.vllm.dtype=float32",
        "rollout.vllm.max_model_len=1024",
        "model.dtype=float32",
        "actor.max_tokens_per_mb=4096",
        "launcher.startup_timeout=300",
        *extra,
    ]


def _run(args: list[str], timeout: float = 900.0) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
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
    assert summary["rollouts_trained"] == steps * 4
    # evaluation ran on the vLLM workers, before and after training
    for name in ("eval_before.jsonl", "eval_after.jsonl"):
        records = [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
        assert len(records) == 4 and all(r["completion"] for r in records), name
    return summary


@pytest.mark.parametrize("pause_mode, transport", [("abort", "auto"), ("keep", "broadcast")])
def test_main_job_on_vllm(tmp_path, pause_mode, transport):
    """3 steps in each pause mode, with weight updates landing mid-generation. Versions never
    decrease within a sample: the rollout worker fails on one that does (the job would fail).
    With ``sync.transport=broadcast`` the worker gets each version over its gloo link into a
    buffer of its own, which vLLM's workers map (as on a node without the trainer's slots)."""
    extra = [f"rollout.pause_mode={pause_mode}", f"sync.transport={transport}"]
    _run(_args(tmp_path, pause_mode, 3, *extra, "sync.checksum=true"))
    run_dir = tmp_path / "grpo-gsm8k" / pause_mode
    summary = _check_job(run_dir, 3)
    assert summary["rollout_worker_restarts"] == 0
    path = "shm" if transport == "auto" else transport
    assert summary["weight_transports"] == {"rollout-0": path}
    assert summary["weight_versions"]["rollout-0"] == [1, 2, 3]
    for version in ("1", "2", "3"):
        crcs = summary["weight_checksums"][version]
        assert set(crcs) == {"trainer", "rollout-0"} and len(set(crcs.values())) == 1, crcs
    # an update met running samples: aborted and resumed as prompt + partial (abort), or a
    # version seam inside a sample (keep)
    assert summary["sample_interruptions"] > 0, summary


def test_main_job_on_vllm_server(tmp_path):
    """2 steps against a `vllm serve` the rollout worker starts itself."""
    _run(_args(tmp_path, "server", 2, "rollout.engine=vllm_server"))
    summary = _check_job(tmp_path / "grpo-gsm8k" / "server", 2)
    assert summary["rollout_worker_restarts"] == 0


def test_main_job_on_vllm_with_lora(tmp_path):
    """2 steps with LoRA rank 8: each version reaches vLLM as an adapter (the trainer's
    adapter bytes only) that the engine loads through vLLM's LoRA API; step 1's behaviour
    log-probs are the base model's, which a fresh adapter (B = 0) leaves unchanged."""
    extra = ["actor.lora.rank=8", "actor.optim.lr=1e-4", "sync.checksum=true"]
    _run(_args(tmp_path, "lora", 2, *extra))
    run_dir = tmp_path / "grpo-gsm8k" / "lora"
    summary = _check_job(run_dir, 2)
    assert summary["weight_versions"]["rollout-0"] == [1, 2]
    # SmolLM2-135M: 30 layers, 7 adapted linears each of (in + out) · r elements, float32
    dims = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
            "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}  # fmt: skip
    params = 30 * 8 * sum(i + o for i, o in dims.values())
    assert summary["trainable_parameters"] == params
    assert summary["weight_update_bytes"] == 4 * params
    for version in ("1", "2"):
        crcs = summary["weight_checksums"][version]
        assert set(crcs) == {"trainer", "rollout-0"} and len(set(crcs.values())) == 1, crcs


def test_engine_core_death_restarts_the_worker(tmp_path):
    """Kill vLLM's engine-core process mid-run: the rollout worker fails naming the engine,
    recovery restarts it with the current weights, the job finishes and nothing accepted is
    lost (every step trains a whole batch)."""
    args = _args(tmp_path, "death", 4)
    run_dir = tmp_path / "grpo-gsm8k" / "death"
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_fast.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no step within 600 s"
        time.sleep(0.2)
    worker = json.loads((run_dir / "workers.json").read_text())["rollout-0"]
    cores = _engine_cores(worker)
    assert cores, f"no vLLM engine-core process under the rollout worker {worker}"
    os.kill(cores[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    summary = _check_job(run_dir, 4)
    assert summary["rollout_worker_restarts"] >= 1
    assert "vLLM engine" in out, out[-3000:]


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


def test_agent_run_on_vllm(tmp_path):
    """The multi-turn agent example for 2 steps on vLLM: sessions' model calls share the
    engine (continuous batching), and every step trains a whole batch."""
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "agent_multiturn.yaml"),
        "--no-progress",
        f"fileroot={tmp_path}",
        "trial_name=agent",
        "total_steps=2",
        "batch_size=4",
        "rollout.group_size=2",
        "data.eval_size=4",
        "rollout.engine=vllm",
        "rollout.max_head_offpolicyness=1",
        "rollout.vllm.max_model_len=1024",
        "launcher.startup_timeout=300",
    ]
    _run(args)
    run_dir = tmp_path / "agent-multiturn" / "agent"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollouts_trained"] == 8 and summary["rollout_worker_restarts"] == 0
    assert summary["weight_update_seconds"], summary
