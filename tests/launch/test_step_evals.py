"""Held-out evaluation during training (``eval.every_steps``): the worker-side weight pin,
the controller's bookkeeping, and the job end to end on the tiny model (in-process CLI)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from linked_job import JOB_CWD, tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.metrics import plot_progress
from areal_fast.controller.step_evals import StepEvals
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError
from areal_fast.workers.rollout_weights import WorkerWeights

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


# ---- the worker's weights: an evaluation pins its version --------------------------------
class _Engine:
    """Records installs; ``update_weights_from_buffer`` maps nothing."""

    def __init__(self):
        self.installed: list[int] = []

    def pause(self, timeout, keep=True):
        pass

    def resume(self):
        pass

    def update_weights_from_buffer(self, spec, version):
        self.installed.append(version)


class _Conn:
    def __init__(self):
        self.sent: list = []

    def send(self, message):
        self.sent.append(message)


class _Spec:
    path = "slot"


def _update(version: int) -> msg.UpdateWeights:
    return msg.UpdateWeights(version, _Spec())


def test_an_evaluation_runs_on_its_version_and_holds_newer_ones_back(monkeypatch):
    import areal_fast.workers.rollout_weights as rw

    monkeypatch.setattr(rw, "cuda_slots_usable", lambda *a: False)
    monkeypatch.setattr(rw, "slot_gpu", lambda spec: "")
    engine, conn = _Engine(), _Conn()
    weights = WorkerWeights(engine, conn, lambda item: None, "127.0.0.1")
    started: list[tuple[int, int]] = []  # (evaluation's version, version served at its start)
    trained: list[int] = []  # version served when a training submission started

    weights.on_update(_update(1))
    weights.evaluate_at(1, lambda: started.append((1, weights.served)))
    weights.when_current(lambda: trained.append(weights.served))  # not held: v1 is current
    weights.on_update(_update(2))  # held back by the evaluation of 1
    weights.evaluate_at(2, lambda: started.append((2, weights.served)))  # waits for v2
    weights.when_current(lambda: trained.append(weights.served))  # waits for v2
    weights.on_update(_update(3))
    assert engine.installed == [1] and started == [(1, 1)] and trained == [1]
    assert weights.announced == 3 and weights.served == 1

    weights.evaluated(1)  # v2 goes in, its evaluation starts and holds v3
    assert engine.installed == [1, 2] and started == [(1, 1), (2, 2)] and trained == [1]
    weights.evaluated(2)
    assert engine.installed == [1, 2, 3] and trained == [1, 3]
    assert [m.version for m in conn.sent] == [1, 2, 3]  # every install acknowledged, in order

    weights.evaluate_at(2, lambda: started.append((2, weights.served)))  # older than served
    assert started[-1] == (2, 3)  # at once, on what it serves
    weights.evaluate_at(3, lambda: started.append((3, weights.served)))  # one at a time
    assert started[-1] == (2, 3)
    weights.evaluated(2)
    assert started[-1] == (3, 3)
    weights.evaluated(3)
    weights.evaluate_at(None, lambda: started.append((None, weights.served)))
    assert started[-1] == (None, 3)
    weights.evaluated(None)
    # one that waits for a version this worker never gets (restarted; a link skipped it)
    # holds nothing back and runs on the next one
    weights.evaluate_at(5, lambda: started.append((5, weights.served)))
    weights.on_update(_update(7))
    assert engine.installed[-1] == 7 and started[-1] == (5, 7)
    weights.on_update(_update(8))  # held back until it is done
    assert engine.installed[-1] == 7
    weights.evaluated(5)
    assert engine.installed[-1] == 8


def _requests(n: int) -> list[msg.GroupRequest]:
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    return [msg.GroupRequest(-1 - i, [1, 2], params, 0, "1", f"u{i}") for i in range(n)]


class _Worker:
    def __init__(self, name):
        self.name, self.sent = name, []

    def send(self, message):
        self.sent.append(message)


def test_step_evals_schedule_records_and_deadline(caplog):
    finished: list = []
    evals = StepEvals(2, _requests(5), lambda v, r, s: finished.append((v, r)), timeout=10.0)
    fleet = RolloutFleet([_Worker("a"), _Worker("b")])
    assert [v for v in range(0, 7) if evals.due(v)] == [2, 4, 6]
    assert evals.after_step(1, {"step": 1}, fleet) == {"step": 1}
    assert all(w.sent == [] for w in fleet.workers)  # step 1 is not due
    assert evals.after_step(2, {"step": 2}, fleet) == {"step": 2}
    sent = {w.name: w.sent[-1] for w in fleet.workers}
    assert all(m.version == 2 for m in sent.values())
    assert sorted(r.uid for m in sent.values() for r in m.groups) == [f"u{i}" for i in range(5)]
    assert evals.evaluating("a") and evals.excused("b", 0.0, 1.0)

    def answer(worker, ok, served=2):
        records = [{"uid": r.uid, "correct": ok, "reward": float(ok)} for r in sent[worker].groups]
        evals.on_eval_done(worker, msg.EvalDone(records, 2, served))

    answer("b", False)
    assert not finished and not evals.evaluating("b") and evals.evaluating("a")
    with caplog.at_level(logging.WARNING, "areal_fast.controller"):
        answer("a", True, served=3)  # e.g. a restarted worker
    assert "ran partly on weights version(s) [3]" in caplog.text
    ((version, records),) = finished
    assert version == 2 and [r["uid"] for r in records] == [f"u{i}" for i in range(5)]
    assert evals.accuracy == {2: 3 / 5} and not evals.running
    assert evals.after_step(3, {"step": 3}, fleet) == {
        "step": 3,
        "eval_accuracy": 0.6,
        "eval_step": 2,
    }
    assert evals.after_step(3, {"step": 3}, fleet) == {"step": 3}  # reported once
    with pytest.raises(WorkerError, match="not asked of it"):
        evals.on_eval_done("a", msg.EvalDone([], 8, 8))
    evals.start(4, fleet)
    evals.start(6, fleet)
    evals.on_eval_done("b", msg.EvalDone([], 4, 4))
    owed = evals.owed("a")  # a restarted "a": both shares again, oldest first
    assert [(m.version, [r.uid for r in m.groups]) for m in owed] == [
        (4, ["u0", "u2", "u4"]),
        (6, ["u0", "u2", "u4"]),
    ]
    assert [m.version for m in evals.owed("b")] == [6]  # answered 4 already
    assert evals.owed("c") == []
    with pytest.raises(WorkerError, match="'a' did not finish the evaluation of step 4 within"):
        evals.check_deadline(evals.running[0].sent + 11.0)


def test_plot_with_evaluations_during_training(tmp_path):
    records = [
        {"step": k, "reward_mean": 0.1 * k, "accuracy": 0.1 * k, "solve_rate": 0.2 * k}
        for k in range(1, 5)
    ]
    path = tmp_path / "p.png"
    fig = plot_progress(
        records, {"before": (0, 0.1), "after": (4, 0.4)}, path, eval_steps={2: 0.2, 4: 0.4}
    )
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "held-out greedy accuracy (during training)" in labels
    line = next(x for x in fig.axes[0].lines if x.get_label().endswith("(during training)"))
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.2, 0.4]
    assert path.stat().st_size > 1000


# ---- the job end to end ------------------------------------------------------------------
def _args(model_dir, root, trial, *extra):
    return tiny_job_args(
        model_dir,
        root,
        trial,
        STEPS,
        "batch_size=3",
        "data.eval_size=8",
        "data.train_size=50",
        "checkpoint.final_model=false",
        *extra,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("every,eta", [(1, 0), (2, 1)])
def test_every_steps_writes_eval_files_and_metrics(tiny_model_dir, tmp_path, every, eta, caplog):
    extra = (f"eval.every_steps={every}", f"rollout.max_head_offpolicyness={eta}")
    with caplog.at_level(logging.WARNING, "areal_fast.controller"):
        assert main(_args(tiny_model_dir, tmp_path, "t", *extra)) == 0
    assert "ran partly on weights" not in caplog.text  # each on the weights of its step
    run = tmp_path / "grpo-arith" / "t"
    due = [k for k in range(1, STEPS + 1) if k % every == 0]
    assert sorted(p.name for p in run.glob("eval_step_*.jsonl")) == sorted(
        f"eval_step_{k}.jsonl" for k in due
    )
    before = _lines(run / "eval_before.jsonl")
    for k in due:  # the same problems, in the same order, as before and after training
        records = _lines(run / f"eval_step_{k}.jsonl")
        assert [r["uid"] for r in records] == [r["uid"] for r in before]
        assert set(records[0]) == {"uid", "answer", "completion", "correct", "reward"}
    summary = json.loads((run / "summary.json").read_text())
    by_step = summary["eval_accuracy_by_step"]
    assert list(by_step) == [str(k) for k in due]
    # the last step's evaluation is the 'after' one: not run twice
    assert (run / "eval_after.jsonl").read_text() == (run / f"eval_step_{STEPS}.jsonl").read_text()
    assert summary["eval_after"] == by_step[str(STEPS)]
    metrics = _lines(run / "metrics.jsonl")
    reported = [
        (r["step"], r["eval_step"], r["eval_accuracy"]) for r in metrics if "eval_step" in r
    ]
    assert reported, "no step record carries an evaluation"
    for step, k, acc in reported:
        assert k < step and k in due and acc == by_step[str(k)]
    assert [k for _, k, _ in reported] == sorted({k for _, k, _ in reported})
    if eta == 0:  # step k + 2 needs v(k + 1) on the workers, installed after eval k finished
        for record in metrics[2:]:
            seen = [k for step, k, _ in reported if step <= record["step"]]
            assert seen and max(seen) >= record["step"] - 2
    assert (run / "progress.png").stat().st_size > 1000


def test_resume_continues_the_schedule(tiny_model_dir, tmp_path, capsys):
    extra = ("eval.every_steps=2", "checkpoint.every_steps=2", "rollout.max_head_offpolicyness=0")
    assert main(_args(tiny_model_dir, tmp_path, "r", *extra)) == 0
    run = tmp_path / "grpo-arith" / "r"
    first = json.loads((run / "summary.json").read_text())["eval_accuracy_by_step"]
    # as if the job had died at step 3 before the evaluation of step 2 was written
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "eval_step_2.jsonl").unlink()
    (run / "eval_step_4.jsonl").write_text("stale\n")  # trained again: replaced
    (run / "summary.json").unlink()
    capsys.readouterr()
    assert main(_args(tiny_model_dir, tmp_path, "r", "resume=true", *extra)) == 0
    err = capsys.readouterr().err
    assert "held-out accuracy at step 2:" in err and "held-out accuracy at step 4:" in err
    assert "eval_step_<k>.jsonl (during training)" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_version"] == 2
    assert summary["eval_accuracy_by_step"] == first  # the tiny model's answers repeat
    assert len(_lines(run / "eval_step_2.jsonl")) == len(_lines(run / "eval_step_4.jsonl")) == 8
    metrics = _lines(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert {r["eval_step"] for r in metrics[2:] if "eval_step" in r} <= {2}

    # kept files are not evaluated again: resuming from step 2 with eval_step_2.jsonl there
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "summary.json").unlink()
    capsys.readouterr()
    assert main(_args(tiny_model_dir, tmp_path, "r", "resume=true", *extra)) == 0
    err = capsys.readouterr().err
    assert "held-out accuracy at step 2:" not in err and "held-out accuracy at step 4:" in err
    assert json.loads((run / "summary.json").read_text())["eval_accuracy_by_step"] == first


def test_bad_every_steps_is_one_line(tiny_model_dir, tmp_path, capsys):
    assert main(_args(tiny_model_dir, tmp_path, "bad", "eval.every_steps=-1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fast: error:") and "eval.every_steps = -1" in err
    assert "\n" not in err and not (tmp_path / "grpo-arith").exists()


def test_resumed_files_kept_deleted_or_torn(tmp_path):
    from areal_fast.launch.config import ExperimentConfig
    from areal_fast.launch.held_out import step_evals

    cfg = ExperimentConfig()
    cfg.eval.every_steps = 2
    line = json.dumps({"uid": "u0", "answer": "1", "completion": "1", "correct": True})
    for step, text in [(2, line + "\n"), (4, '{"uid": "u0", "corr'), (6, line + "\n")]:
        (tmp_path / f"eval_step_{step}.jsonl").write_text(text)
    (tmp_path / "eval_step_x.jsonl").write_text("not mine\n")
    evals = step_evals(cfg, tmp_path, _requests(1), 4, 1)
    assert evals.accuracy == {2: 1.0}  # 4 was torn by a crash, 6 is trained again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_step_2.jsonl", "eval_step_x.jsonl"]
    assert evals.due(4) and 4 not in evals.accuracy  # the resumed run evaluates it first


def test_rollout_worker_killed_during_evaluations(tiny_model_dir, tmp_path):
    """A rollout worker killed while the evaluations of every step run: its replacement
    gets its share of each unanswered one, and every step's file is written."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = _args(
        tiny_model_dir,
        tmp_path,
        "kill",
        "eval.every_steps=1",
        "rollout.num_workers=2",
        "rollout.max_head_offpolicyness=1",
        "data.eval_size=24",
        "launcher.startup_timeout=120",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_fast.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=JOB_CWD,
    )
    run = tmp_path / "grpo-arith" / "kill"
    deadline = time.monotonic() + 240
    while not ((run / "eval_step_1.jsonl").is_file() and (run / "workers.json").is_file()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    os.kill(json.loads((run / "workers.json").read_text())["rollout-1"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting it" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollout_worker_restarts"] == 1
    assert list(summary["eval_accuracy_by_step"]) == [str(k) for k in range(1, STEPS + 1)]
    for k in range(1, STEPS + 1):
        assert len(_lines(run / f"eval_step_{k}.jsonl")) == 24
