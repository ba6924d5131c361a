"""Per-step metrics: appended to JSONL, plotted to PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class MetricsLog:
    """Appends one JSON object per line to ``path`` and keeps the records in memory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: list[dict] = []

    @classmethod
    def resume(cls, path: Path, up_to_step: int) -> "MetricsLog":
        """Continue ``path`` after a resume: keep its records of steps ``<= up_to_step``
        (later ones were trained after the checkpoint and are trained again), drop the rest
        and a torn last line."""
        log = cls(path)
        if log.path.is_file():
            for line in log.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("step", up_to_step + 1) <= up_to_step:
                    log.records.append(record)
        tmp = log.path.with_name(log.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in log.records))
        tmp.replace(log.path)
        return log

    def append(self, record: dict) -> None:
        """Write ``record`` as one JSON line (flushed at once, so a crash keeps earlier steps)."""
        self.records.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def plot_progress(
    records: list[dict],
    eval_points: dict[str, tuple[int, float]],
    path: Path,
    title: str = "",
    eval_steps: Optional[dict[int, float]] = None,
):
    """PNG of training reward, sample accuracy and solve rate per step, with held-out accuracy.

    For a 0/1 reward the mean reward is the sample accuracy: the two are then drawn as one
    line ("train reward mean = sample accuracy"); a reward that differs anywhere (e.g. a
    format bonus) gets its own line. Each held-out point is labelled with its value.

    Parameters
    ----------
    records : list of dict
        Per-step metrics with ``step``, ``reward_mean``, ``accuracy`` and ``solve_rate``
        (fractions in [0, 1]).
    eval_points : dict
        Label -> (step, held-out accuracy), e.g. {"before": (0, 0.19), "after": (20, 0.3)}.
    path : Path
        Output PNG file.
    title : str, optional
        Figure title (the launcher gives the experiment/trial name and the model).
    eval_steps : dict, optional
        Step -> held-out accuracy of the evaluations during training (``eval.every_steps``),
        drawn as one line of points.

    Returns
    -------
    matplotlib.figure.Figure
        The saved figure (already closed: inspect it, do not show it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    reward = [r["reward_mean"] for r in records]
    accuracy = [r["accuracy"] for r in records]
    if all(abs(a - b) <= 1e-9 for a, b in zip(reward, accuracy)):
        ax.plot(steps, accuracy, marker=".", label="train reward mean = sample accuracy")
    else:
        ax.plot(steps, reward, marker=".", label="train reward mean")
        ax.plot(steps, accuracy, marker=".", linestyle="--", label="train sample accuracy")
    ax.plot(
        steps,
        [r["solve_rate"] for r in records],
        marker=".",
        linestyle=":",
        label="train solve rate (≥1 correct per group)",
    )
    if eval_steps:
        ax.plot(
            sorted(eval_steps),
            [eval_steps[k] for k in sorted(eval_steps)],
            marker="o",
            linestyle="-.",
            label="held-out greedy accuracy (during training)",
        )
    for label, (step, acc) in eval_points.items():
        ax.scatter([step], [acc], s=60, zorder=3, label=f"held-out greedy accuracy ({label})")
        last = bool(steps) and step >= max(steps)  # at the right edge: text to the left
        ax.annotate(
            f"{label}: {acc:.1%}",
            (step, acc),
            textcoords="offset points",
            xytext=(-6, 6) if last else (6, 6),
            ha="right" if last else "left",
            fontsize=8,
        )
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
