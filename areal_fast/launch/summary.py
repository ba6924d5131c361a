"""The end of a training run: ``summary.json`` (written last: a run directory without it did
not finish) and the closing lines on the console."""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import dataclass

import torch

from areal_fast.controller.async_loop import AsyncController
from areal_fast.controller.run_counts import RunCounts
from areal_fast.launch import console
from areal_fast.launch.checkpoints import ResumePoint
from areal_fast.launch.cluster import Cluster
from areal_fast.launch.held_out import HeldOutEvals
from areal_fast.launch.inputs import RunInputs
from areal_fast.launch.reporter import Reporter
from areal_fast.launch.worker_specs import worker_threads

LAST_RECORD_KEYS = ("trainable_parameters", "weight_update_bytes", "trainer_peak_rss_mb")


@dataclass
class Trained:
    """What one attempt's training left, for the summary.

    Attributes
    ----------
    controller : AsyncController
        Its ``version`` (steps trained) and weight-sync summary.
    counts : RunCounts
        The rollout accounting ``controller.run()`` returned.
    cluster : Cluster
        Its weight transports and worker nodes.
    reporter : Reporter
        The steps' metrics and when the workers were ready.
    """

    controller: AsyncController
    counts: RunCounts
    cluster: Cluster
    reporter: Reporter


def summarise(inputs: RunInputs, start: ResumePoint, evals: HeldOutEvals, trained: Trained) -> dict:
    """Write ``summary.json`` and print the closing lines; returns the summary.

    Parameters
    ----------
    inputs : RunInputs
        The problem counts.
    start : ResumePoint
        Where the attempt started (restarts, the resumed version).
    evals : HeldOutEvals
        The held-out accuracies.
    trained : Trained
        The training's results.
    """
    run = trained.reporter.run
    cfg, run_dir = run.cfg, run.run_dir
    shutil.rmtree(run_dir / "shards", ignore_errors=True)
    summary = {
        "train_problems": len(inputs.train_set),
        "eval_problems": len(inputs.eval_set),
        "train_removed_overlap": inputs.removed,
        "seed": cfg.seed,
        "scheduler": cfg.scheduler.type,
        "train_world_size": cfg.scheduler.train_world_size,
        "trainer_restarts": start.attempt.restarts,
    }
    if start.attempt.resume:
        summary.update(
            resumed_from_version=start.version, skipped_checkpoints=start.checkpoints.skipped
        )
    summary.update(evals.summary())
    summary.update(_training(trained))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    total = time.perf_counter() - run.started
    for line in console.end_summary(summary, run_dir, cfg.checkpoint.final_model, total):
        console.say(line)
    return summary


def _training(trained: Trained) -> dict:
    """The summary's keys about training, the weights and the machine."""
    cfg, controller, cluster = trained.reporter.run.cfg, trained.controller, trained.cluster
    out = dict(
        steps=controller.version,
        wall_seconds=time.perf_counter() - trained.reporter.started,
        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
        **trained.counts.as_dict(),
        **controller.weights.summary(),
        weight_transports=dict(cluster.transports),
        worker_nodes=dict(cluster.nodes),
        torch=torch.__version__,
        trainer_threads=worker_threads(cfg)[0],
        rollout_threads=worker_threads(cfg)[1],
        machine=platform.machine(),
    )
    records = trained.reporter.metrics.records
    if records:
        out["trained_tokens_per_s_cumulative"] = records[-1]["trained_tokens_per_s_cumulative"]
        out.update({k: records[-1][k] for k in LAST_RECORD_KEYS if k in records[-1]})
    return out
