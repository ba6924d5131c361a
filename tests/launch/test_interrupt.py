"""Ctrl-C and SIGTERM stop a run cleanly: one line, no tracebacks (workers included), the
checkpoint in progress finished, ``INTERRUPTED`` saying what ``resume=true`` does; and the
console lines, progress ETA and end summary of a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from linked_job import JOB_CWD  # noqa: E402 - beside this file

from areal_fast.controller.checkpoint_manager import CheckpointManager
from areal_fast.launch import console
from areal_fast.launch.interrupt import describe_stop

REPO = Path(__file__).resolve().parents[2]


def _args(model_dir, root, *extra):
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        "trial_name=stop",
        "total_steps=200",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=4",
        "data.train_size=60",
        "rollout.max_head_offpolicyness=0",
        "threads=1",
        "checkpoint.every_steps=2",
        # step-4 stays until the end: the test's wait for it cannot miss it on a busy machine
        "checkpoint.keep=100",
        "launcher.startup_timeout=120",
        *extra,
    ]


def _start(args) -> subprocess.Popen:
    # a session of its own: the signal goes to every process of the job, as Ctrl-C does
    return subprocess.Popen(
        [sys.executable, "-m", "areal_fast.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=JOB_CWD,
        start_new_session=True,
    )


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    # only whole lines: the run may be writing the next one right now
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line)["step"] for line in complete if line]


def _saving(run_dir: Path, step: int) -> bool:
    """The checkpoint of ``step`` is begun (a temporary folder) or complete."""
    root = run_dir / "checkpoints"
    return any(root.glob(f".tmp-step-{step:08d}-*")) or (root / f"step-{step:08d}").is_dir()


def _wait_steps(
    proc: subprocess.Popen, run_dir: Path, steps: int, timeout=240.0, until=lambda: True
) -> None:
    deadline = time.monotonic() + timeout
    while len(_steps(run_dir)) < steps or not until():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the job")
        time.sleep(0.02)


def test_ctrl_c_stops_cleanly_and_resume_continues(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "grpo-arith" / "stop"
    proc = _start(_args(tiny_model_dir, tmp_path))
    # right after step 4 the checkpoint of step 4 is usually still a .tmp-step-* folder
    _wait_steps(proc, run_dir, 4, until=lambda: _saving(run_dir, 4))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "Loading weights" not in err, "--no-progress: the workers drew progress bars"
    stopped = [line for line in err.splitlines() if line.startswith("areal-fast: interrupted")]
    assert len(stopped) == 1, err[-3000:]
    status = (run_dir / "INTERRUPTED").read_text().splitlines()
    assert status[1] == "signal: SIGINT" and not (run_dir / "FAILED").exists()
    assert stopped[0] == f"areal-fast: {status[0]}"
    complete = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [n for n in complete if n.startswith(".tmp")]  # finished or discarded
    latest = int(complete[-1].removeprefix("step-"))
    trained = len(_steps(run_dir))
    assert latest >= 4  # the checkpoint in progress at the signal was finished
    assert status[0].startswith(f"interrupted at step {trained + 1} ({trained} of 200 trained)")
    assert status[0].endswith(
        f"checkpoint step-{latest} is complete; resume=true continues from step {latest}"
    )
    assert not (run_dir / "summary.json").exists() and not (run_dir / "shards").exists()

    from areal_fast.cli import main

    assert main(_args(tiny_model_dir, tmp_path)) == 2  # neither resume nor overwrite
    assert "was interrupted; pass resume=true to continue it" in capsys.readouterr().err
    total = latest + 2
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_fast.cli",
            *_args(tiny_model_dir, tmp_path, "resume=true", f"total_steps={total}"),
        ],
        capture_output=True,
        text=True,
        cwd=JOB_CWD,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] == latest and summary["steps"] == total
    assert _steps(run_dir) == list(range(1, total + 1))
    assert not (run_dir / "INTERRUPTED").exists()
    assert "held-out accuracy before training:" in done.stderr
    assert f"finished {total} steps in" in done.stderr


def test_sigterm_stops_like_ctrl_c(tiny_model_dir, tmp_path):
    """SIGTERM to the launcher alone (as a scheduler or `timeout` sends it)."""
    run_dir = tmp_path / "grpo-arith" / "stop"
    proc = _start(
        _args(tiny_model_dir, tmp_path, "checkpoint.every_steps=0", "checkpoint.final_model=false")
    )
    _wait_steps(proc, run_dir, 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    status = (run_dir / "INTERRUPTED").read_text().splitlines()
    assert status[1] == "signal: SIGTERM"
    assert status[0].endswith(
        "checkpoints are off (checkpoint.every_steps = 0): resume=true starts at step 0"
    )


def test_sigterm_to_the_process_group_leaks_nothing(tiny_model_dir, tmp_path):
    """SIGTERM to every process of the job (`timeout`, a batch scheduler): the run stops as
    for the launcher alone, and no worker leaves a semaphore behind (the resource tracker's
    "leaked semaphore" warning), progress bars included."""
    run_dir = tmp_path / "grpo-arith" / "stop"
    args = _args(tiny_model_dir, tmp_path, "checkpoint.every_steps=0")
    proc = _start([a for a in args if a != "--no-progress"])
    _wait_steps(proc, run_dir, 1)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err[-3000:]
    assert "leaked semaphore" not in err and "Traceback" not in err, err[-3000:]
    assert (run_dir / "INTERRUPTED").read_text().splitlines()[1] == "signal: SIGTERM"


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_local_worker_ends_through_python_on_sigterm(tmp_path, wrapped):
    """A worker started as LocalCluster starts it (``worker_main``) outlives a SIGTERM (its
    launcher, which a job-wide SIGTERM reaches too, stops it) until its grace runs out
    (AREAL_FAST_WORKER_TERM_GRACE, 3 s here), then runs multiprocessing's finalizers, so a
    lock it made is removed; killed by the signal's default action (the control case), the
    same worker leaves it to the resource tracker, which reports it when the launching
    process exits."""
    ready = tmp_path / "ready"
    script = f"""
import functools, os, signal, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
os.environ["AREAL_FAST_WORKER_TERM_GRACE"] = "3"
from semaphore_worker import hold_a_lock
from areal_fast.wire.handles import spawn_worker
from areal_fast.launch.cluster import worker_main
target = functools.partial(worker_main, hold_a_lock) if {wrapped} else hold_a_lock
handle = spawn_worker("w", target, {str(ready)!r}, b"key")
deadline = time.monotonic() + 60
while not os.path.exists({str(ready)!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(handle.pid, signal.SIGTERM)
handle.process.join(1.0)
print(handle.process.exitcode)
os.kill(handle.pid, signal.SIGTERM)  # a second one changes nothing
handle.process.join(30)
print(handle.process.exitcode)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    if wrapped:
        assert proc.stdout.split() == ["None", "143"], proc
        assert "leaked semaphore" not in proc.stderr, proc
    else:
        assert proc.stdout.split()[0] == "-15" and "1 leaked semaphore" in proc.stderr, proc


def test_describe_stop_names_the_complete_checkpoint(tmp_path):
    from areal_fast.train.checkpoint import FORMAT, STATE_FILE

    manager = CheckpointManager(tmp_path / "checkpoints", every_steps=2)
    assert describe_stop("evaluating before training", 0, 20, manager, 2, False) == (
        "interrupted while evaluating before training (0 of 20 steps trained); no checkpoint "
        "is complete yet: resume=true starts at step 0"
    )
    tmp = manager.begin(6)
    (tmp / STATE_FILE).write_text(
        json.dumps({"format": FORMAT, "version": 6, "world_size": 1, "scheduler": {}, "files": {}})
    )
    manager.commit(tmp, 6, {"counts": {}})
    assert describe_stop("training", 7, 20, manager, 2, True) == (
        "interrupted at step 8 (7 of 20 trained); checkpoint step-6 is complete; resume=true "
        "continues from step 6 (the checkpoint in progress was discarded)"
    )


def test_eval_lines_and_end_summary():
    assert console.eval_started("before training", 200, 2, 32) == (
        "held-out evaluation before training: 200 problems on 2 rollout workers (greedy, up "
        "to 32 new tokens) ..."
    )
    assert console.eval_finished("before training", 41, 200, 44.2) == (
        "held-out accuracy before training: 20.5% (41/200), 44 s"
    )
    assert console.format_seconds(598) == "9 min 58 s"
    assert console.format_seconds(7500) == "2 h 05 min"
    lines = console.end_summary(
        {
            "steps": 20,
            "wall_seconds": 598.4,
            "eval_before": 0.205,
            "eval_after": 0.31,
            "eval_problems": 200,
        },
        "runs/x",
        False,
    )
    assert lines[:3] == [
        "finished 20 steps in 9 min 58 s",
        "held-out accuracy: 20.5% → 31.0% (+10.5 points on 200 problems)",
        "run directory: runs/x",
    ]
    assert "no final model saved (checkpoint.final_model = false)" in lines[-1]


def test_eta_leaves_out_the_first_steps_warm_up(monkeypatch):
    """Step 1 takes 100 s (warm-up), later steps 10 s: after step 2 the estimate is 8 steps
    of 10 s plus the 30 s evaluation still to come (tqdm's would start from 100 s/step)."""
    now = [1000.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    bar = console.StepBar(total=10, initial=0, extra_seconds=30.0, enabled=False)
    record = {"reward_mean": 0.5, "loss": 0.1}
    now[0] += 100.0
    bar.update(record)
    assert bar.remaining(now[0]) is None
    now[0] += 10.0
    bar.update(record)
    assert bar.remaining(now[0]) == pytest.approx(8 * 10.0 + 30.0)
    capped = console.StepBar(total=10, initial=0, max_seconds=150.0, enabled=False)
    now[0] += 100.0
    capped.update(record)
    now[0] += 10.0
    capped.update(record)
    assert capped.remaining(now[0]) == pytest.approx(150.0 - 110.0)
    bar.close()
    capped.close()


def test_finishing_a_checkpoint_records_a_step_trained_meanwhile(tmp_path, monkeypatch):
    """The trainer trains step 6 (sent ahead) before it answers the save asked at step 5:
    its files say version 6, so the StepDone of step 6 must be recorded before the save is
    committed (as the controller's loop does), and the checkpoint is step-6."""
    from areal_fast.controller.checkpoint_manager import PendingSaves
    from areal_fast.launch import interrupt
    from areal_fast.train.checkpoint import FORMAT, STATE_FILE
    from areal_fast.wire import messages as msg

    saves = PendingSaves(CheckpointManager(tmp_path / "checkpoints", every_steps=5))
    tmp5 = saves.after_step(5, {"version": 5, "counts": {}})
    assert tmp5 is not None

    class Controller:  # the two messages' handling, as AsyncController does it
        def __init__(self):
            self.saves, self.handled = saves, []

        def handle(self, messages):
            for _, message in messages:
                self.handled.append(type(message).__name__)
                if isinstance(message, msg.StepDone):
                    self.saves.after_step(message.version, {"version": message.version})
                else:
                    assert self.saves.commit(message.path, message.version) is not None

    state = {"format": FORMAT, "version": 6, "world_size": 1, "scheduler": {}, "files": {}}
    (Path(tmp5) / STATE_FILE).write_text(json.dumps(state))
    replies = [[("trainer", msg.StepDone(6, {}))], [("trainer", msg.StateSaved(tmp5, 6))]]
    monkeypatch.setattr(interrupt, "wait_messages", lambda *a: replies.pop(0) if replies else [])
    controller = Controller()
    assert interrupt.finish_checkpoints(controller, [], timeout=5.0, say=lambda line: None)
    # step 6 recorded first; the save is then committed from its complete files, and the
    # trainer's answer for it, arriving after, is dropped
    assert controller.handled == ["StepDone"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000006"]


@pytest.mark.parametrize("cut", ["before the rename", "after the rename"])
def test_a_commit_cut_short_by_ctrl_c_is_finished(tmp_path, monkeypatch, cut):
    """Ctrl-C while the controller commits a save the trainer answered (writing
    controller.json, renaming the folder): the save is not forgotten, finish_checkpoints
    completes it, and the checkpoint is there."""
    from areal_fast.controller.checkpoint_manager import PendingSaves
    from areal_fast.launch import interrupt
    from areal_fast.train.checkpoint import FORMAT, STATE_FILE

    manager = CheckpointManager(tmp_path / "checkpoints", every_steps=2)
    saves = PendingSaves(manager)
    tmp4 = saves.after_step(4, {"version": 4, "counts": {}})
    state = {"format": FORMAT, "version": 4, "world_size": 1, "scheduler": {}, "files": {}}
    (Path(tmp4) / STATE_FILE).write_text(json.dumps(state))
    commit = manager.commit

    def interrupted(tmp, version, controller_state):
        if cut == "after the rename":
            commit(tmp, version, controller_state)
        raise KeyboardInterrupt

    monkeypatch.setattr(manager, "commit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        saves.commit(tmp4, 4)
    assert tmp4 in saves.saving and saves.answered == {tmp4: 4}
    monkeypatch.setattr(manager, "commit", commit)
    monkeypatch.setattr(interrupt, "wait_messages", lambda *a: pytest.fail("nothing to wait"))

    class Controller:
        pass

    controller = Controller()
    controller.saves = saves
    assert interrupt.finish_checkpoints(controller, [], timeout=5.0, say=lambda line: None)
    assert not saves.saving and not saves.answered
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]
    assert (
        json.loads((tmp_path / "checkpoints" / "step-00000004" / "controller.json").read_text())[
            "version"
        ]
        == 4
    )


def test_a_save_whose_answer_was_lost_is_committed_from_its_files(tmp_path, monkeypatch):
    """Ctrl-C between receiving the trainer's StateSaved and handling it: the save's files
    are complete (train_state.json, written last, names the version), so finish_checkpoints
    commits it without waiting for an answer that will not come; a half-written state file
    is waited for."""
    from areal_fast.controller.checkpoint_manager import PendingSaves
    from areal_fast.launch import interrupt
    from areal_fast.train.checkpoint import FORMAT, STATE_FILE

    saves = PendingSaves(CheckpointManager(tmp_path / "checkpoints", every_steps=2))
    tmp4 = saves.after_step(4, {"version": 4, "counts": {}})
    state = {"format": FORMAT, "version": 4, "world_size": 1, "scheduler": {}, "files": {}}
    (Path(tmp4) / STATE_FILE).write_text(json.dumps(state)[:20])  # being written
    assert saves.commit_written() == [] and tmp4 in saves.saving
    waits = []

    def wait_messages(*args):
        waits.append(args)
        (Path(tmp4) / STATE_FILE).write_text(json.dumps(state))  # the trainer is done
        return []

    monkeypatch.setattr(interrupt, "wait_messages", wait_messages)

    class Controller:
        pass

    controller = Controller()
    controller.saves = saves
    assert interrupt.finish_checkpoints(controller, [], timeout=5.0, say=lambda line: None)
    assert len(waits) == 1 and not saves.saving
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000004"]
