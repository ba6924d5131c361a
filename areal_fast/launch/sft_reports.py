"""Where an ``areal-fast sft`` run's news goes, on rank 0: ``metrics.jsonl``, TensorBoard /
W&B (:mod:`areal_fast.launch.log_sinks`), the progress bar, ``progress.png`` and the held-out
evaluations (:mod:`areal_fast.launch.sft_evals`). The other ranks get :class:`NoReports`,
which does nothing, so that the training loop reads the same on every rank.
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Optional

from areal_fast.controller.metrics import MetricsLog
from areal_fast.launch import console
from areal_fast.launch.log_sinks import LogSinks
from areal_fast.launch.sft_config import SftConfig
from areal_fast.launch.sft_evals import SftEvals
from areal_fast.launch.sft_ranks import Rank


class NoReports:
    """The reports of a rank other than 0: nothing is written."""

    records: list = []

    def before(self, resumed: bool) -> None:
        """Nothing (rank 0 evaluates)."""

    def during(self, snapshot, step: int) -> Optional[float]:
        """Nothing (rank 0 evaluates); None."""
        return None

    def step(self, record: dict) -> None:
        """Nothing (rank 0 records)."""

    def needs_after(self) -> bool:
        """Rank 0 decides; False here."""
        return False

    def after(self, path) -> None:
        """Nothing (rank 0 evaluates)."""

    def plot(self) -> None:
        """Nothing (rank 0 draws)."""


class SftReports(NoReports):
    """Rank 0's reports of one supervised run.

    Parameters
    ----------
    cfg : SftConfig
    evals : SftEvals
        The held-out set and the accuracies measured.
    metrics : MetricsLog
        ``metrics.jsonl``.
    sinks : LogSinks
        TensorBoard / W&B.
    bar : console.StepBar
    """

    def __init__(self, cfg: SftConfig, evals: SftEvals, metrics: MetricsLog, sinks, bar):
        self.cfg, self.evals, self.metrics, self.sinks, self.bar = cfg, evals, metrics, sinks, bar
        self.run_dir = cfg.run_dir

    @property
    def records(self) -> list:
        """Every step's record, a resumed run's earlier ones included."""
        return self.metrics.records

    def before(self, resumed: bool) -> None:
        """``eval.before`` on the starting model (a resumed run reads its earlier result)."""
        self.evals.evaluate_before(self.run_dir, resumed)
        if self.evals.before is not None:
            self.sinks.log_eval("eval_before", 0, self.evals.before)

    def during(self, snapshot, step: int) -> Optional[float]:
        """Evaluate the weights of ``step`` saved at ``snapshot`` (``eval_step_<step>.jsonl``);
        the accuracy."""
        path = self.run_dir / f"eval_step_{step}.jsonl"
        value = self.evals.run(str(snapshot), path, f"at step {step}")
        self.evals.accuracy[step] = value
        return value

    def step(self, record: dict) -> None:
        """Record one step: ``metrics.jsonl``, the sinks, the bar."""
        self.metrics.append(record)
        self.sinks.log_step(record)
        self.bar.update(record)

    def needs_after(self) -> bool:
        """Whether ``eval.after`` needs the final weights (no evaluation of the last step)."""
        return self.cfg.eval.after and self.cfg.total_steps not in self.evals.accuracy

    def after(self, path) -> None:
        """``eval.after`` on the weights saved at ``path`` (``eval_after.jsonl``), or the
        evaluation of the last step copied."""
        step = self.cfg.total_steps
        if not self.cfg.eval.after:
            return
        after = self.run_dir / "eval_after.jsonl"
        if step in self.evals.accuracy:
            shutil.copyfile(self.run_dir / f"eval_step_{step}.jsonl", after)
            self.evals.after = self.evals.accuracy[step]
        else:
            self.evals.after = self.evals.run(str(path), after, f"after training (step {step})")
        self.sinks.log_eval("eval_after", step, self.evals.after)

    def plot(self) -> None:
        """Draw ``progress.png`` (:func:`plot_loss`)."""
        title = f"{self.cfg.experiment_name}/{self.cfg.trial_name} · sft · {self.cfg.model.path}"
        plot_loss(self.records, self.evals, self.run_dir / "progress.png", title)


def plot_loss(records: list[dict], evals: SftEvals, path, title: str = "") -> None:
    """``progress.png`` of a supervised run: the training loss per step (nats per trained
    token) and, on a second axis, the held-out accuracies measured (before, during, after).

    Parameters
    ----------
    records : list of dict
        ``metrics.jsonl``'s records (``step``, ``loss``); nothing is drawn without any.
    evals : SftEvals
        Its ``before``, ``accuracy`` (step -> accuracy) and ``after``.
    path : str or Path
        The PNG file.
    title : str
        The figure's title.
    """
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / trained token)")
    points = dict(sorted(evals.accuracy.items()))
    if evals.before is not None:
        points = {0: evals.before, **points}
    if evals.after is not None:
        points[records[-1]["step"]] = evals.after
    if points:
        acc = ax.twinx()
        acc.plot(list(points), list(points.values()), "o--", color="tab:green")
        acc.set_ylabel("held-out greedy accuracy", color="tab:green")
        acc.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def open_reports(cfg: SftConfig, evals: SftEvals, start: int, rank: Rank, show_progress: bool):
    """Rank 0's :class:`SftReports` for the block (``metrics.jsonl`` anew, or kept up to
    step ``start`` with ``resume``; the sinks closed and the bar ended after it), or
    :class:`NoReports` on another rank."""
    if not rank.main:
        yield NoReports()
        return
    path = cfg.run_dir / "metrics.jsonl"
    metrics = MetricsLog.resume(path, start) if cfg.resume else MetricsLog(path)
    evals.keep_until(cfg.run_dir, start)
    with LogSinks(cfg, cfg.run_dir, start if cfg.resume else None) as sinks:
        bar = console.StepBar(cfg.total_steps, start, enabled=show_progress)
        try:
            yield SftReports(cfg, evals, metrics, sinks, bar)
        finally:
            bar.close()
