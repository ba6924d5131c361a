"""Per-step metrics: appended to JSONL, plotted to PNG."""

from __future__ import annotations

import json
from pathlib import Path



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


def plot_progress(records: list[dict], eval_points: dict[str, tuple[int, float]],
                  path: Path) -> None:
    """PNG of training reward, sample accuracy and solve rate per step, with held-out accuracy.

    Parameters
    ----------
    records : list of dict
        Per-step metrics with ``step``, ``reward_mean`` and ``accuracy``.
    eval_points : dict
        Label -> (step, held-out accuracy), e.g. {"before": (0, 0.19), "after": (20, 0.3)}.
    path : Path
        Output PNG file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["reward_mean"] for r in records], marker=".", label="train reward mean")
    ax.plot(steps, [r["accuracy"] for r in records], marker=".", linestyle="--",
            label="train sample accuracy")
    ax.plot(steps, [r["solve_rate"] for r in records], marker=".", linestyle=":",
            label="train solve rate (≥1 correct per group)")
    for label, (step, acc) in eval_points.items():
        ax.scatter([step], [acc], s=60, zorder=3, label=f"held-out greedy accuracy ({label})")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
