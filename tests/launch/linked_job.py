"""The small job of the weight-link and multi-node tests: the tiny model, 2 rollout workers,
4 steps of 4 prompts × 2 samples, checksums on (imported as ``from linked_job import ...``)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def job_args(model_dir, root, trial, *extra) -> list[str]:
    """``areal-fast train`` arguments of the job; ``extra`` overrides come last (they win)."""
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        f"trial_name={trial}",
        f"total_steps={STEPS}",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=4",
        "data.train_size=60",
        "rollout.num_workers=2",
        "threads=1",
        "actor.loss.entropy_coef=0.5",
        "actor.optim.lr=1e-2",
        "sync.checksum=true",
        "checkpoint.final_model=false",
        *extra,
    ]
