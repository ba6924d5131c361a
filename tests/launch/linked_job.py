"""The tiny model's jobs of the launch tests (imported as ``from linked_job import ...``):
:func:`tiny_job_args`, what every such job sets, and :func:`job_args`, the job of the
weight-link and multi-node tests (2 rollout workers, 4 steps of 4 prompts × 2 samples,
checksums on)."""

from __future__ import annotations

import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
# The working directory of job subprocesses (``python -m areal_fast...``): never the checkout,
# whose areal_fast/ (no compiled extension) would shadow the installed package under test.
JOB_CWD = tempfile.gettempdir()


# the reproducible tiny job of tests/launch/test_reproducible.py and the Slurm tests: 2 rollout
# workers, η = 2, an entropy bonus so that every step changes the weights, a checkpoint every 2
REPRODUCIBLE_JOB = (
    "batch_size=4",
    "data.eval_size=4",
    "data.train_size=60",
    "rollout.num_workers=2",
    "rollout.reproducible=true",
    "rollout.max_head_offpolicyness=2",
    "actor.loss.entropy_coef=0.5",
    "actor.optim.lr=1e-2",
    "checkpoint.every_steps=2",
    "checkpoint.keep=5",
    "launcher.startup_timeout=120",
)


def tiny_job_args(model_dir, root, trial, steps: int, *extra) -> list[str]:
    """``areal-fast train`` arguments every tiny-model job shares (examples/arith.yaml, groups
    of 2 samples of at most 6 tokens, one thread); ``extra`` comes last (it wins)."""
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        f"trial_name={trial}",
        f"total_steps={steps}",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "threads=1",
        *extra,
    ]


def job_args(model_dir, root, trial, *extra) -> list[str]:
    """``areal-fast train`` arguments of the job; ``extra`` overrides come last (they win)."""
    return tiny_job_args(
        model_dir,
        root,
        trial,
        STEPS,
        "batch_size=4",
        "data.eval_size=4",
        "data.train_size=60",
        "rollout.num_workers=2",
        "actor.loss.entropy_coef=0.5",
        "actor.optim.lr=1e-2",
        "sync.checksum=true",
        "checkpoint.final_model=false",
        *extra,
    )
