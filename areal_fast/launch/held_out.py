"""A training run's held-out evaluations: before training (``eval.before``), every
``eval.every_steps`` steps during it, and after it (``eval.after``); each is greedy, on the
rollout workers, writes one JSON line per problem and prints its accuracy.

``areal-fast eval``, which evaluates a model without training, is
:mod:`areal_fast.launch.evaluation`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional

from areal_fast.controller.requests import eval_requests
from areal_fast.controller.step_evals import StepEvals
from areal_fast.launch import console
from areal_fast.launch.checkpoints import ResumePoint
from areal_fast.launch.config import ExperimentConfig
from areal_fast.launch.inputs import RunInputs
from areal_fast.launch.reporter import Reporter
from areal_fast.launch.run_dir import write_eval_records


def accuracy(records: list[dict]) -> float:
    """The fraction of ``records`` that are correct (0 for none)."""
    return sum(r["correct"] for r in records) / max(len(records), 1)


def correct(records: list[dict]) -> int:
    """How many of ``records`` are correct."""
    return int(round(sum(r["correct"] for r in records)))


def read_records(path: Path) -> list[dict]:
    """The records of an evaluation file (one JSON object per line)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_evals(
    cfg: ExperimentConfig, run_dir: Path, held_out: list, version: int, workers: int
) -> StepEvals:
    """The evaluations during training (``eval.every_steps``): each writes
    ``eval_step_<k>.jsonl`` and prints its accuracy. A run resumed at ``version`` keeps the
    files and accuracies of steps up to it and deletes later ones (trained again) and torn
    ones (a crash while writing: evaluated again if due).

    Parameters
    ----------
    cfg : ExperimentConfig
    run_dir : Path
    held_out : list of GroupRequest
        The held-out problems as greedy requests.
    version : int
        Steps trained before this attempt.
    workers : int
        Rollout workers (for the console line).
    """

    def done(step: int, records: list[dict], seconds: float) -> None:
        right = write_eval_records(run_dir / f"eval_step_{step}.jsonl", records)
        console.say(console.eval_finished(f"at step {step}", right, len(records), seconds))

    evals = StepEvals(cfg.eval.every_steps, held_out, done, cfg.launcher.timeouts.evaluate)
    for path in run_dir.glob("eval_step_*.jsonl"):
        suffix = path.stem.rsplit("_", 1)[1]
        if not suffix.isdigit():
            continue
        step = int(suffix)
        try:
            records = read_records(path)
        except ValueError:
            records = []
        if step > version or not records:
            path.unlink()
        else:
            evals.accuracy[step] = accuracy(records)
    if evals.due(cfg.eval.every_steps):
        console.say(
            f"held-out evaluation every {cfg.eval.every_steps} steps during training: "
            f"{len(held_out)} problems on {workers} rollout worker(s), greedy, on the "
            f"weights of that step"
        )
    return evals


def evaluate(controller, requests: list, path: Path, when: str, max_new_tokens: int) -> float:
    """Greedy held-out evaluation on the controller's rollout workers: one console line as it
    starts and one with the accuracy; writes one JSON line per problem to ``path``; returns
    the accuracy (a fraction)."""
    console.say(console.eval_started(when, len(requests), len(controller.workers), max_new_tokens))
    t0 = time.perf_counter()
    records = controller.evaluate(requests)
    right = write_eval_records(path, records)
    console.say(console.eval_finished(when, right, len(records), time.perf_counter() - t0))
    return accuracy(records)


class HeldOutEvals:
    """The held-out evaluations of one attempt of a training run, and their results.

    Parameters
    ----------
    cfg : ExperimentConfig
        ``eval.*``, ``launcher.timeouts.evaluate``.
    run_dir : Path
    inputs : RunInputs
        The held-out set and the prompt template.
    start : ResumePoint
        Where the attempt starts (a resumed run keeps what was measured before).
    workers : int
        Rollout workers (for the console line).

    Attributes
    ----------
    during : StepEvals
        The evaluations during training, for the controller.
    before, after : float or None
        The accuracies before and after training (None: not evaluated).
    points : dict
        ``{"before": (0, accuracy), "after": (step, accuracy)}`` for the plot.
    seconds_before : float
        How long the evaluation before training took (0 when it was not run now).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        inputs: RunInputs,
        start: ResumePoint,
        workers: int,
    ):
        self.cfg, self.run_dir, self.start = cfg, run_dir, start
        self.requests = eval_requests(inputs.eval_set, inputs.prompts, cfg.eval.max_new_tokens)
        self.during = step_evals(cfg, run_dir, self.requests, start.version, workers)
        self.before: Optional[float] = None
        self.after: Optional[float] = None
        self.points: dict[str, tuple[int, float]] = {}
        self.seconds_before = 0.0

    def evaluate_before(self, controller, reporter: Reporter) -> None:
        """Evaluate the starting weights (``eval.before``), or read the result that the first
        attempt of a resumed run measured."""
        before_file = self.run_dir / "eval_before.jsonl"
        if not self.cfg.eval.before:
            return
        if self.start.latest and before_file.is_file():
            records = read_records(before_file)
            self.before = accuracy(records)
            reporter.say(
                console.eval_finished("before training", correct(records), len(records), None)
            )
        else:
            reporter.enter("evaluating before training")
            t0 = time.perf_counter()
            when, tokens = "before training", self.cfg.eval.max_new_tokens
            self.before = evaluate(controller, self.requests, before_file, when, tokens)
            self.seconds_before = time.perf_counter() - t0
            reporter.log_eval("eval_before", 0, self.before)
        self.points["before"] = (0, self.before)

    def catch_up(self, controller) -> None:
        """Start the evaluation due at the resumed step, lost with the run that saved the
        checkpoint."""
        version = self.start.version
        if self.during.due(version) and version not in self.during.accuracy:
            self.during.start(version, controller.fleet)

    def evaluate_after(self, controller, reporter: Reporter) -> None:
        """Evaluate the trained weights (``eval.after``); an evaluation during training of
        the same weights is reused."""
        if not self.cfg.eval.after:
            return
        step = controller.version
        if step in self.during.accuracy:  # the same weights
            shutil.copyfile(
                self.run_dir / f"eval_step_{step}.jsonl", self.run_dir / "eval_after.jsonl"
            )
            self.after = self.during.accuracy[step]
            reporter.say(
                f"held-out accuracy after training (step {step}): {self.after:.1%}, the "
                f"evaluation at step {step}"
            )
        else:
            reporter.enter("evaluating after training")
            when, tokens = f"after training (step {step})", self.cfg.eval.max_new_tokens
            path = self.run_dir / "eval_after.jsonl"
            self.after = evaluate(controller, self.requests, path, when, tokens)
            reporter.log_eval("eval_after", step, self.after)
        self.points["after"] = (step, self.after)

    def summary(self) -> dict:
        """The summary's held-out keys: ``eval_before``, ``eval_accuracy_by_step``,
        ``eval_seconds_by_step``, ``eval_after`` (each when measured)."""
        out: dict = {}
        if self.before is not None:
            out["eval_before"] = self.before
        if self.during.accuracy:
            by_step = sorted(self.during.accuracy.items())
            out["eval_accuracy_by_step"] = {str(k): a for k, a in by_step}
            out["eval_seconds_by_step"] = {
                str(k): round(t, 3) for k, t in sorted(self.during.seconds.items())
            }
        if self.after is not None:
            out["eval_after"] = self.after
        return out
