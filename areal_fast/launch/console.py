"""What a run prints on the console (stderr): a line when each held-out evaluation starts and
ends, the training bar, and a short summary at the end.

The bar's remaining time is computed here rather than by tqdm: tqdm measures from the bar's
creation and weighs the first steps heavily, and the first step of an attempt carries the
warm-up (the engines' first generation, allocator and thread pools), so its estimate was
several times too long. :class:`StepBar` leaves the first step out: from the second step on
the estimate is the mean time of the steps since the first times the steps left, plus the
measured length of the evaluation still to come.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def say(line: str) -> None:
    """Print one console line (to stderr, above a running progress bar)."""
    tqdm.write(line, file=sys.stderr)


def format_seconds(seconds: float) -> str:
    """``44 s``, ``9 min 58 s``, ``2 h 05 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def eval_started(when: str, problems: int, workers: int, max_new_tokens: int) -> str:
    """Line printed as a held-out evaluation starts; ``when``: "before training", ..."""
    return (
        f"held-out evaluation {when}: {problems} problems on {workers} rollout worker"
        f"{'s' if workers != 1 else ''} (greedy, up to {max_new_tokens} new tokens) ..."
    )


def eval_finished(when: str, correct: int, total: int, seconds: float | None) -> str:
    """``held-out accuracy before training: 20.5% (41/200), 44 s``; ``seconds`` None: the
    value was measured by an earlier attempt of the run."""
    took = format_seconds(seconds) if seconds is not None else "measured before the resume"
    return f"held-out accuracy {when}: {correct / max(total, 1):.1%} ({correct}/{total}), {took}"


class StepBar:
    """The training progress bar: steps, reward, loss and the remaining time (see the module
    docstring).

    Parameters
    ----------
    total : int
        ``total_steps``.
    initial : int
        Steps already trained (a resumed run).
    extra_seconds : float
        Seconds still to come after the last step (the held-out evaluation after training).
    max_seconds : float or None
        ``max_seconds`` of the run: training stops after that many seconds.
    elapsed_before : float
        Training seconds before a resume (count towards ``max_seconds``).
    enabled : bool
        False: draw nothing.
    """

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(
        self,
        total: int,
        initial: int,
        extra_seconds: float = 0.0,
        max_seconds: float | None = None,
        elapsed_before: float = 0.0,
        enabled: bool = True,
    ):
        self.total, self.done = total, initial
        self.extra, self.max_seconds, self.elapsed_before = (
            extra_seconds,
            max_seconds,
            elapsed_before,
        )
        self.start = time.monotonic()
        self.first_done: float | None = None  # when this attempt's first step ended
        self.steps_since_first = 0
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            bar_format=self.FORMAT,
            disable=not enabled,
            file=sys.stderr,
        )

    def remaining(self, now: float) -> float | None:
        """Seconds left (None until two steps of this attempt are done)."""
        if self.first_done is None or self.steps_since_first == 0:
            return None
        per_step = (now - self.first_done) / self.steps_since_first
        left = (self.total - self.done) * per_step
        if self.max_seconds is not None:
            left = min(left, max(0.0, self.max_seconds - self.elapsed_before - (now - self.start)))
        return left + self.extra

    def update(self, record: dict) -> None:
        """One step done; ``record`` has ``loss`` and, for RL steps, ``reward_mean``."""
        now = time.monotonic()
        self.done += 1
        if self.first_done is None:
            self.first_done = now
        else:
            self.steps_since_first += 1
        left = self.remaining(now)
        eta = "…" if left is None else tqdm.format_interval(left)
        reward = f"reward={record['reward_mean']:.3f}, " if "reward_mean" in record else ""
        self.bar.set_postfix_str(f"{reward}loss={record['loss']:.4f}, eta={eta}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def end_summary(
    summary: dict, run_dir, final_model: bool, total_seconds: float | None = None
) -> list[str]:
    """The lines printed when a run ends: steps and wall time, held-out accuracy before →
    after, and where its files are.

    Parameters
    ----------
    summary : dict
        ``summary.json``'s content (``steps``, ``wall_seconds``: from the workers' start;
        ``eval_before`` / ``eval_after`` / ``eval_problems`` / ``eval_accuracy_by_step``
        when evaluated).
    run_dir : str or Path
    final_model : bool
        ``checkpoint.final_model``.
    total_seconds : float, optional
        Seconds since the launch (data, tokenizer and workers included).
    """
    steps = summary["steps"]
    took = format_seconds(summary["wall_seconds"])
    if total_seconds is not None:
        took = f"{format_seconds(total_seconds)} ({took} after the workers started)"
    lines = [f"finished {steps} step{'s' if steps != 1 else ''} in {took}"]
    before, after = summary.get("eval_before"), summary.get("eval_after")
    n = summary.get("eval_problems", 0)
    if before is not None and after is not None:
        lines.append(
            f"held-out accuracy: {before:.1%} → {after:.1%} "
            f"({100 * (after - before):+.1f} points on {n} problems)"
        )
    elif before is not None or after is not None:
        which, value = ("before", before) if before is not None else ("after", after)
        lines.append(f"held-out accuracy {which} training: {value:.1%} ({n} problems)")
    lines.append(f"run directory: {run_dir}")
    files = "metrics.jsonl (per step), progress.png (plot), summary.json"
    if before is not None or after is not None:
        files += ", eval_before.jsonl / eval_after.jsonl (per problem)"
    if summary.get("eval_accuracy_by_step"):
        files += ", eval_step_<k>.jsonl (during training)"
    lines.append(f"  {files}")
    lines.append(
        "  checkpoint/ (the trained model, HF format)"
        if final_model
        else "  no final model saved (checkpoint.final_model = false)"
    )
    return lines
