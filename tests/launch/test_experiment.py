"""Checkpoints, resume and recovery end to end, on the tiny model: the job is a real
``areal-fast train`` (or ``python -m areal_fast.launch.ray train``) process, and workers are
killed with SIGKILL by their process ids from ``workers.json``.

Rewards of the tiny random model are all 0, so an entropy bonus (``entropy_coef``) makes the
losses and updates non-trivial: every step then changes the weights and the samples, and
equal losses after a resume mean equal weights, optimizer state, data position and seeds.
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
from linked_job import JOB_CWD, tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _args(model_dir, root, trial, *extra):
    return tiny_job_args(
        model_dir,
        root,
        trial,
        STEPS,
        "batch_size=4",
        "data.eval_size=4",
        "data.train_size=60",
        "rollout.max_head_offpolicyness=0",
        "actor.loss.entropy_coef=0.5",
        "actor.optim.lr=1e-2",
        "checkpoint.every_steps=2",
        "launcher.startup_timeout=120",
        "launcher.timeouts.train_step=120",
        *extra,
    )


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"])
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


def _start(args, module: str = "areal_fast.cli") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=JOB_CWD,
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the job")
        time.sleep(0.05)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    # only whole lines: the run may be writing the next one right now
    return path.read_text().count("\n") if path.is_file() else 0


def _kill(run_dir: Path, worker: str) -> int:
    pid = json.loads((run_dir / "workers.json").read_text())[worker]
    os.kill(pid, signal.SIGKILL)
    return pid


def _finish(proc: subprocess.Popen, timeout: float = 300.0) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _run_with_kill(
    args,
    run_dir: Path,
    worker: str,
    after_steps: int,
    module: str = "areal_fast.cli",
    need_checkpoint: bool = False,
) -> str:
    proc = _start(args, module)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    _wait_for(
        lambda: (
            _steps_done(run_dir) >= after_steps
            and (run_dir / "workers.json").is_file()
            and (ckpt.is_dir() or not need_checkpoint)
        ),
        proc,
    )
    _kill(run_dir, worker)
    return _finish(proc)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run (local launcher, one trainer rank)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(_args(tiny_model_dir, root, "ref")) == 0
    run_dir = root / "grpo-arith" / "ref"
    return run_dir, _losses(run_dir)


@pytest.mark.slow
def test_trainer_killed_resumes_with_equal_losses(tiny_model_dir, tmp_path, reference):
    run_dir = tmp_path / "grpo-arith" / "kill"
    out = _run_with_kill(
        _args(tiny_model_dir, tmp_path, "kill"),
        run_dir,
        "trainer",
        after_steps=3,
        need_checkpoint=True,
    )
    assert "restarting the job from its last checkpoint" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_restarts"] == 1 and summary["resumed_from_version"] in (2, 4)
    assert summary["rollouts_trained"] == STEPS * 4
    got, want = _losses(run_dir), reference[1]
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    for (step, loss), (_, ref) in zip(got, want):
        assert loss == pytest.approx(ref, rel=1e-6, abs=1e-7), step


@pytest.mark.slow
def test_rollout_worker_killed_loses_nothing(tiny_model_dir, tmp_path, reference):
    """Synchronous mode: the running groups start again on the new worker with the same
    seeds and the current weights, so even the losses equal the uninterrupted run's."""
    run_dir = tmp_path / "grpo-arith" / "kill"
    out = _run_with_kill(
        _args(tiny_model_dir, tmp_path, "kill"), run_dir, "rollout-0", after_steps=2
    )
    assert "restarting it (2 restarts left after this one)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout_worker_restarts"] == 1
    assert summary["rollouts_trained"] == STEPS * 4
    assert summary["rollouts_submitted"] == STEPS * 4  # resubmitted, not redrawn
    assert set(summary["rollouts_dropped"]) <= {"unused_at_end", "in_flight_at_end"}
    assert sum(summary["rollouts_dropped"].values()) == 0
    assert 0 < summary["rollout_recovery_seconds"][0] < 30
    got = _losses(run_dir)
    for (step, loss), (_, ref) in zip(got, reference[1]):
        assert loss == pytest.approx(ref, rel=1e-6, abs=1e-7), step


@pytest.mark.slow
def test_rollout_worker_killed_while_running_ahead(tiny_model_dir, tmp_path):
    """Asynchronous mode with two workers: finished groups of the dead worker are read from
    its spool files; every accepted group is trained, none is dropped as lost."""
    run_dir = tmp_path / "grpo-arith" / "async"
    args = _args(
        tiny_model_dir,
        tmp_path,
        "async",
        "rollout.max_head_offpolicyness=2",
        "rollout.num_workers=2",
        "rollout.drop_stale=false",
    )
    _run_with_kill(args, run_dir, "rollout-1", after_steps=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout_worker_restarts"] == 1 and summary["rollouts_trained"] == STEPS * 4
    dropped = summary["rollouts_dropped"]
    assert set(dropped) <= {"unused_at_end", "in_flight_at_end"}
    # every submitted group was trained, resubmitted-and-trained, or dropped at the end
    assert summary["rollouts_submitted"] == STEPS * 4 + sum(dropped.values())
    assert not (run_dir / "shards").exists()  # spool files are consumed or cleaned up


def test_damaged_checkpoint_is_skipped_with_a_message(tiny_model_dir, tmp_path, reference, caplog):
    import shutil

    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(reference[0], run_dir)
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step-00000004", "step-00000006"]
    model = ckpts[-1] / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])  # truncated by a crash or a full disk
    (ckpts[0] / "train_state.json").unlink()  # a partial write
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true")) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] == 0  # no complete checkpoint left
    assert any("step-00000006" in s and "truncated" in s for s in summary["skipped_checkpoints"])
    assert any(
        "step-00000004" in s and "train_state.json is missing" in s
        for s in summary["skipped_checkpoints"]
    )
    assert _losses(run_dir) == reference[1]


def test_resume_from_middle_checkpoint_equals_uninterrupted(tiny_model_dir, tmp_path, reference):
    import shutil

    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(reference[0], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true")) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] == 4
    assert _losses(run_dir) == reference[1]  # bit-identical on CPU


def test_resume_refuses_a_finished_run_or_changed_inputs(
    tiny_model_dir, tmp_path, reference, capsys
):
    """A finished run has nothing to resume; a resume with other problems or another held-out
    set would compare before/after accuracies of different sets. Both fail at once (exit 2)
    and change nothing in the run directory."""
    import shutil

    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(reference[0], run_dir)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true")) == 2
    err = capsys.readouterr().err
    assert "finished and has trained 6 steps (step-00000006)" in err and "total_steps = 6" in err
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true", "data.eval_size=3")) == 2
    assert "resume=true: data.eval_size = 3 differs from the run's" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before


def test_resume_needs_a_run_dir(tiny_model_dir, tmp_path, capsys):
    """resume=true where no run exists says so and how to start it; a folder that is not a
    run directory is named as such; neither is written to."""
    assert main(_args(tiny_model_dir, tmp_path, "none", "resume=true")) == 2
    run_dir = tmp_path / "grpo-arith" / "none"
    assert capsys.readouterr().err == (
        f"areal-fast: error: resume=true: there is no run to resume at {run_dir} (fileroot/"
        f"experiment_name/trial_name); without resume=true the run starts there, or set "
        f"fileroot, experiment_name and trial_name to those of the run to continue\n"
    )
    assert not (tmp_path / "grpo-arith").exists()
    run_dir.mkdir(parents=True)
    assert main(_args(tiny_model_dir, tmp_path, "none", "resume=true")) == 2
    err = capsys.readouterr().err
    assert "resume=true" in err and "not an areal-fast run directory (no config.yaml)" in err
    assert list(run_dir.iterdir()) == []


@pytest.mark.slow
def test_ray_two_ranks_survive_a_trainer_rank_death(tiny_model_dir, tmp_path, reference):
    """The Ray launcher on a local Ray instance with 2 CPUs: 1 rollout worker and 2 FSDP2
    trainer ranks (gloo). A killed trainer rank restarts the job from its checkpoint, and
    every step's loss equals the 1-rank local run's to fp32 tolerance. (A rollout worker
    killed on Ray: tests/launch/test_multi_node.py.)"""
    ray_args = [
        "scheduler.train_world_size=2",
        "scheduler.cpus_per_rollout_worker=0.5",
        "scheduler.cpus_per_trainer_rank=0.5",
        "scheduler.ray_num_cpus=2",
    ]
    run_dir = tmp_path / "grpo-arith" / "trainer"
    _run_with_kill(
        ["train", *_args(tiny_model_dir, tmp_path, "trainer", *ray_args)[1:]],
        run_dir,
        "trainer-1",
        after_steps=3,
        module="areal_fast.launch.ray",
        need_checkpoint=True,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scheduler"] == "ray" and summary["trainer_restarts"] == 1
    assert summary["rollouts_trained"] == STEPS * 4
    got = _losses(run_dir)
    assert [s for s, _ in got] == [s for s, _ in reference[1]]
    for (step, loss), (_, ref) in zip(got, reference[1]):
        assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6), step


@pytest.mark.parametrize(
    "override, key",
    [
        ("scheduler.type=slurm", "scheduler.type"),
        ("scheduler.train_world_size=32", "scheduler.train_world_size = 32"),
        ("scheduler.cpus_per_trainer_rank=0", "scheduler.cpus_per_trainer_rank"),
        ("scheduler.placement_strategy=RANDOM", "scheduler.placement_strategy"),
        ("checkpoint.every_steps=-1", "checkpoint.every_steps"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("recovery.max_rollout_restarts=-1", "recovery.max_rollout_restarts"),
    ],
)
def test_scale_out_config_errors_name_the_key(override, key):
    from areal_fast.launch.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(str(REPO / "examples" / "arith.yaml"), [override])
    assert key in str(info.value) and "\n" not in str(info.value)


def test_ray_entry_must_be_known(capsys):
    from areal_fast.launch.ray import main as ray_main

    assert ray_main(["serve", "--config", "x.yaml"]) == 2
    assert "the entry must be one of ('train',), got 'serve'" in capsys.readouterr().err


def test_checkpoint_damaged_in_place_is_marked_and_skipped(tiny_model_dir, tmp_path, reference):
    """Same size, garbage content: the size check passes, the trainer fails to load it; the
    checkpoint is marked DAMAGED and the job restarts from the previous one."""
    import shutil

    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(reference[0], run_dir)
    (run_dir / "summary.json").unlink()  # it stopped after its last checkpoint
    newest = run_dir / "checkpoints" / "step-00000006"
    model = newest / "model.safetensors"
    model.write_bytes(b"\xff" * model.stat().st_size)
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true")) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] == 4 and summary["trainer_restarts"] == 1
    assert any(
        "step-00000006" in s and "could not load it" in s and "model.safetensors" in s
        for s in summary["skipped_checkpoints"]
    )
    assert not (newest / "DAMAGED").exists()  # replaced by the resumed run's own step 6
    assert _losses(run_dir) == reference[1]


def test_resume_refuses_another_model(tiny_model_dir, tiny_qwen_dir, tmp_path, reference, capsys):
    import shutil

    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(reference[0], run_dir)
    before = (run_dir / "config.yaml").read_text()
    args = _args(tiny_model_dir, tmp_path, "ref", "resume=true")
    args[args.index(f"model.path={tiny_model_dir}")] = f"model.path={tiny_qwen_dir}"
    assert main(args) == 2
    assert "resume=true: model.path" in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == before


def test_ray_resources_checked_before_placing():
    from areal_fast.launch.ray_cluster import _check_resources
    from areal_fast.wire.handles import WorkerError

    bundles = [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 0.5, "GPU": 1.0}]
    _check_resources(bundles, {"CPU": 2.5, "GPU": 1.0})
    with pytest.raises(WorkerError, match=r"need 2.5 CPUs .*has 2$"):
        _check_resources(bundles, {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(WorkerError, match=r"need 1 GPUs .*gpus_per_trainer_rank.*has 0"):
        _check_resources(bundles, {"CPU": 8.0})


def test_final_model_is_written_only_when_asked(tiny_model_dir, tmp_path, capsys):
    """``checkpoint.final_model=false``: a trial run writes no ``checkpoint/`` (the trained
    model); the metrics, plot and held-out results are all there, and the closing summary
    says that no model was saved."""
    args = [
        a
        for a in _args(tiny_model_dir, tmp_path, "no-model")
        if not a.startswith(("total_steps=", "checkpoint.every_steps="))
    ]
    assert main([*args, "total_steps=1", "checkpoint.final_model=false"]) == 0
    run_dir = tmp_path / "grpo-arith" / "no-model"
    assert not (run_dir / "checkpoint").exists() and not (run_dir / "checkpoints").exists()
    assert (run_dir / "progress.png").is_file() and (run_dir / "eval_after.jsonl").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    err = capsys.readouterr().err
    assert "finished 1 step in" in err and "no final model saved" in err
    assert f"run directory: {run_dir}" in err
    assert main([*args, "total_steps=1", "trial_name=model"]) == 0
    assert (tmp_path / "grpo-arith" / "model" / "checkpoint" / "model.safetensors").is_file()
    assert "checkpoint/ (the trained model, HF format)" in capsys.readouterr().err
