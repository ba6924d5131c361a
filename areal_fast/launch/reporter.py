"""Where a training run's news goes: the console (held-out evaluations, the progress bar),
``metrics.jsonl``, TensorBoard / W&B (:mod:`areal_fast.launch.log_sinks`), ``progress.png``,
and the run's progress that the line of an interrupted run names.

The controller knows none of this: it receives :meth:`Reporter.on_step` as its ``on_step``
callback."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

from areal_fast.controller.metrics import MetricsLog, plot_progress
from areal_fast.launch import console
from areal_fast.launch.log_sinks import LogSinks
from areal_fast.launch.run_context import RunContext


@dataclass
class Reporter:
    """The reports of one attempt of a run.

    Attributes
    ----------
    run : RunContext
        Its ``version`` follows the steps trained; its ``phase`` is set by :meth:`enter`.
    sinks : LogSinks
        TensorBoard / W&B (each optional).
    metrics : MetricsLog
        ``metrics.jsonl``, one record per step.
    bar : StepBar or None
        The progress bar while training (see :meth:`step_bar`).
    started : float
        ``time.perf_counter()`` when the attempt's workers were ready.
    """

    run: RunContext
    sinks: LogSinks
    metrics: MetricsLog
    bar: Optional[console.StepBar] = None
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def open(cls, run: RunContext, sinks: LogSinks, resume: bool) -> "Reporter":
        """A reporter writing ``<run_dir>/metrics.jsonl``: anew, or kept up to the step
        ``run.version`` when the attempt resumes."""
        path = run.run_dir / "metrics.jsonl"
        metrics = MetricsLog.resume(path, run.version) if resume else MetricsLog(path)
        return cls(run, sinks, metrics)

    def enter(self, phase: str) -> None:
        """The run now does ``phase`` ("training", "evaluating after training", ...)."""
        self.run.phase = phase

    @staticmethod
    def say(line: str) -> None:
        """Print one console line (above the progress bar)."""
        console.say(line)

    def on_step(self, record: dict) -> None:
        """The controller's ``on_step``: record one step's metrics everywhere."""
        self.metrics.append(record)
        self.sinks.log_step(record)
        self.run.version = record["step"]
        self.bar.update(record)

    def log_eval(self, key: str, step: int, accuracy: float) -> None:
        """Send a held-out accuracy (``eval_before`` / ``eval_after``) to the log sinks."""
        self.sinks.log_eval(key, step, accuracy)

    @contextlib.contextmanager
    def step_bar(self, extra_seconds: float, elapsed_before: float):
        """Draw the training bar in the block (from step ``run.version``).

        Parameters
        ----------
        extra_seconds : float
            Seconds still to come after the last step (the evaluation after training).
        elapsed_before : float
            Training seconds before a resume (they count towards ``max_seconds``).
        """
        cfg = self.run.cfg
        self.bar = console.StepBar(
            cfg.total_steps,
            self.run.version,
            extra_seconds=extra_seconds,
            max_seconds=cfg.max_seconds,
            elapsed_before=elapsed_before,
            enabled=self.run.show_progress,
        )
        try:
            yield self.bar
        finally:
            self.bar.close()

    def plot(self, eval_points: dict, eval_steps: dict) -> None:
        """Draw ``progress.png`` from the steps' metrics and the held-out accuracies (nothing
        when no step was trained)."""
        if not self.metrics.records:
            return
        cfg = self.run.cfg
        plot_progress(
            self.metrics.records,
            eval_points,
            self.run.run_dir / "progress.png",
            title=f"{cfg.experiment_name}/{cfg.trial_name} · {cfg.model.path}",
            eval_steps=eval_steps,
        )
