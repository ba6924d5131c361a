"""Compare held-out accuracy before/after training across runs, with noise estimates.

For each run directory (written by ``areal-fast train``) it reads ``eval_before.jsonl`` and
``eval_after.jsonl`` (one record per held-out problem, same order) and prints:

- before / after greedy accuracy and the paired difference with a 95% bootstrap interval
  over problems (resampling the same problems for both, 10,000 resamples);
- the binomial standard error of one accuracy estimate, sqrt(p(1 − p) / n);
- across runs (different seeds): mean and sample std of the after-accuracy and of the gain.

Usage::

    python benches/compare_runs.py runs/grpo-arith/seed1 runs/grpo-arith/seed2 ...
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path


def _correct(path: Path) -> list[int]:
    return [int(json.loads(line)["correct"]) for line in path.read_text().splitlines()]


def paired_bootstrap(
    before: list[int], after: list[int], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of mean(after − before) over problems resampled in pairs."""
    rng = random.Random(seed)
    n = len(before)
    diffs = [a - b for a, b in zip(after, before)]
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main(run_dirs: list[str]) -> None:
    rows, gains, afters = [], [], []
    for run in map(Path, run_dirs):
        before, after = _correct(run / "eval_before.jsonl"), _correct(run / "eval_after.jsonl")
        if len(before) != len(after):
            raise ValueError(f"{run}: eval_before and eval_after hold different problem counts")
        n = len(before)
        p0, p1 = sum(before) / n, sum(after) / n
        lo, hi = paired_bootstrap(before, after)
        se = (p1 * (1 - p1) / n) ** 0.5
        summary = json.loads((run / "summary.json").read_text())
        rows.append(
            f"| {run.name} | {summary.get('seed')} | {n} | {p0:.1%} | {p1:.1%} | "
            f"{p1 - p0:+.1%} | [{lo:+.1%}, {hi:+.1%}] | {se:.1%} | "
            f"{summary.get('wall_seconds', float('nan')) / 60:.1f} |"
        )
        gains.append(p1 - p0)
        afters.append(p1)
    print(
        "| run | seed | n | before | after | gain | gain 95% CI (paired bootstrap) "
        "| binomial SE | wall min |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if len(runs := afters) > 1:
        print(
            f"\nacross {len(runs)} runs: after {statistics.fmean(afters):.1%} "
            f"± {statistics.stdev(afters):.1%} (sample std), gain "
            f"{statistics.fmean(gains):+.1%} ± {statistics.stdev(gains):.1%}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
