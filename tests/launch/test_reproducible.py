"""``rollout.reproducible`` end to end on the tiny model: two runs of the same config and seed
are identical by ``areal-fast compare`` (metrics, evaluations, final weights), at η = 0, 1, 2,
with 2 rollout workers and with 2 trainer ranks; a run killed at a step drawn per run (the
seed is printed) and resumed ends identical to the uninterrupted one; every refused
combination is one line and exit 2, with nothing written.

The entropy bonus makes every step change the weights and the samples (the tiny model's
rewards are all 0), so identical final weights mean every step was the same.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from linked_job import JOB_CWD, REPRODUCIBLE_JOB, tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main
from areal_fast.launch.compare import compare_runs

STEPS = 5


def _args(model_dir, root, trial, *extra):
    return tiny_job_args(
        model_dir,
        root,
        trial,
        STEPS,
        *REPRODUCIBLE_JOB,
        "launcher.timeouts.train_step=120",
        *extra,
    )


def _differences(a: Path, b: Path) -> list[str]:
    return [f.line for f in compare_runs(a, b) if f.difference is not None]


def _staleness(run_dir: Path) -> list[list[int]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["staleness_hist"] for line in lines]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """An uninterrupted reproducible run at η = 2 (2 rollout workers, checkpoints at 2, 4, 5)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(_args(tiny_model_dir, root, "ref")) == 0
    return root / "grpo-arith" / "ref"


# η = 2: engine batches of 2 sequences, so a worker is still generating batches 1 and 2 when
# version 1 is published (its update must wait for them)
TWO_RANKS = (
    "scheduler.train_world_size=2",
    "rollout.max_batch_size=2",
    "rollout.max_new_tokens=48",
)


@pytest.mark.parametrize("eta,extra", [(0, ()), (1, ()), (2, TWO_RANKS)])
def test_two_runs_are_identical(tiny_model_dir, tmp_path, eta, extra):
    runs = []
    for trial in ("a", "b"):
        args = _args(tiny_model_dir, tmp_path, trial, f"rollout.max_head_offpolicyness={eta}")
        assert main([*args, "total_steps=4", "checkpoint.every_steps=0", *extra]) == 0
        runs.append(tmp_path / "grpo-arith" / trial)
    assert _differences(*runs) == []
    # batch k trained at staleness min(k, η): never a sample across a weight update
    assert [len(h) - 1 for h in _staleness(runs[0])] == [min(k, eta) for k in range(4)]


def _start(args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "areal_fast.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=JOB_CWD,
        start_new_session=True,
    )


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while _steps_done(run_dir) < step or not (run_dir / "workers.json").is_file():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the job")
        time.sleep(0.02)


def _kill_worker(run_dir: Path, worker: str) -> None:
    os.kill(json.loads((run_dir / "workers.json").read_text())[worker], signal.SIGKILL)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    return out


@pytest.mark.parametrize("fault", ["trainer", "rollout-1", "launcher", "sigint"])
def test_killed_and_resumed_run_equals_uninterrupted(tiny_model_dir, tmp_path, reference, fault):
    # FAULT_SEED=<printed seed> replays a failure
    seed = int(os.environ.get("FAULT_SEED") or int.from_bytes(os.urandom(2), "little"))
    step = random.Random(seed).randint(1, STEPS - 2)
    print(f"fault {fault} after step {step} (seed {seed})")
    args = _args(tiny_model_dir, tmp_path, "ref")
    run_dir = tmp_path / "grpo-arith" / "ref"
    proc = _start(args)
    _wait_for_step(proc, run_dir, step)
    if fault == "trainer":  # the launcher restarts the job from the last checkpoint
        _kill_worker(run_dir, "trainer")
    elif fault == "rollout-1":  # replaced; its whole chunk generated again
        _kill_worker(run_dir, "rollout-1")
    elif fault == "launcher":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGINT)
    out = _finish(proc)
    if fault in ("launcher", "sigint"):
        # a checkpoint in progress at the signal is finished (its rollouts keep coming)
        assert "was discarded" not in out, out[-3000:]
        # (a signal that came after the run finished leaves nothing to resume)
        if not (run_dir / "summary.json").is_file():
            assert main([*args, "resume=true"]) == 0, out[-3000:]
    else:
        assert proc.returncode == 0, out[-4000:]
    assert _differences(reference, run_dir) == [], f"seed {seed}, step {step}"


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.engine=vllm", "engine = 'hf'"),
        ("rollout.dynamic_filter=true", "dynamic_filter"),
        ("rollout.max_concurrent_rollouts=8", "max_concurrent_rollouts"),
        ("max_seconds=60", "max_seconds"),
        ("recovery.spool_shards=false", "recovery.spool_shards"),
        ("scheduler.type=ray", "scheduler.type"),
        ("sync.transport=disk", "sync.transport"),
        ("agent.path=agent.py:run", "agent.path"),
    ],
)
def test_refused_combinations_are_one_line(tiny_model_dir, tmp_path, capsys, override, key):
    assert main(_args(tiny_model_dir, tmp_path, "bad", override)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "reproducible" in err, err
    assert not (tmp_path / "grpo-arith").exists()
