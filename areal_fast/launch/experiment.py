"""Run one experiment: check the inputs, start the workers (local processes or Ray actors),
run the controller; resume from checkpoints and restart after a trainer fault."""

from __future__ import annotations

import json
import logging
import platform
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from areal_fast.controller.async_loop import AsyncController, RunPlan
from areal_fast.controller.checkpoint_manager import Checkpoint, CheckpointManager
from areal_fast.controller.metrics import MetricsLog, plot_progress
from areal_fast.controller.requests import ChatPrompts, MathRequests, ProblemStream, eval_requests
from areal_fast.controller.step_evals import StepEvals
from areal_fast.launch import console
from areal_fast.launch.cluster import Cluster
from areal_fast.launch.config import ExperimentConfig
from areal_fast.launch.inputs import check_batch_size, check_lengths, load_datasets
from areal_fast.launch.interrupt import (
    CHECKPOINT_WAIT_SECONDS,
    RunInterrupted,
    describe_stop,
    finish_checkpoints,
    signal_of,
    signals_deferred,
    write_interrupted,
)
from areal_fast.launch.log_sinks import LogSinks
from areal_fast.launch.packages import check_packages
from areal_fast.launch.run_dir import (
    check_run_dir,
    check_trajectory_dir,
    mark_failed,
    prepare_run_dir,
    write_eval_records,
)
from areal_fast.launch.worker_specs import (
    check_resources,
    check_reward,
    check_sync,
    cluster_spec,
    make_cluster,
    worker_threads,
)
from areal_fast.models.loading import load_model_config, load_tokenizer
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire.handles import WorkerError, wait_messages
from areal_fast.wire.messages import SaveCheckpoint, Saved

log = logging.getLogger("areal_fast.launch")


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_plan(cfg: ExperimentConfig) -> RunPlan:
    """How long the controller trains (its other settings are ``cfg.rollout``,
    ``cfg.recovery`` and ``cfg.launcher.timeouts``, passed as they are)."""
    return RunPlan(cfg.total_steps, cfg.batch_size, max_seconds=cfg.max_seconds)


@dataclass
class _Progress:
    """Where a run is, for the line an interrupted run prints."""

    phase: str = "loading the data and the tokenizer"
    version: int = 0  # steps trained
    run_dir: Optional[Path] = None  # set once the run directory is prepared
    started: float = field(default_factory=time.perf_counter)  # at the launch


def run_experiment(cfg: ExperimentConfig, show_progress: bool = True) -> dict:
    """Run one GRPO experiment end to end (asynchronous controller); returns the summary.

    Everything that can fail on bad input (data files, task names, model path) is loaded
    before the run directory is created and before any worker starts. The run directory gets
    ``config.yaml``, ``metrics.jsonl`` (one line per step), ``eval_before.jsonl`` /
    ``eval_after.jsonl`` (and ``eval_step_<k>.jsonl`` with ``eval.every_steps``),
    ``progress.png``, ``checkpoint/`` (the trained model, unless
    ``checkpoint.final_model`` is false) and, last of all, ``summary.json``: a run directory
    without ``summary.json`` did not finish (a failed run also gets ``FAILED`` with the
    error, an interrupted one ``INTERRUPTED``). With ``checkpoint.every_steps``, recoverable
    checkpoints go to ``checkpoints/step-<version>``; ``resume=true`` continues from the last
    complete one. A dead or failed trainer rank restarts the job from there (at most
    ``recovery.max_trainer_restarts`` times); a dead rollout worker is replaced
    (``recovery.max_rollout_restarts``). ``workers.json`` maps worker names to process ids.
    ``logging.tensorboard`` / ``logging.wandb`` add ``tensorboard/`` / ``wandb/``
    (:mod:`areal_fast.launch.log_sinks`; closed at the end of each attempt, also a failed one).
    The console shows each held-out evaluation, a progress bar and a closing summary.

    Raises
    ------
    RunInterrupted
        Ctrl-C or SIGTERM (see :mod:`areal_fast.launch.interrupt`): the run stopped cleanly;
        the exception's text says where and what ``resume=true`` will do.
    """
    progress = _Progress()
    try:
        return _run_experiment(cfg, show_progress, progress)
    except RunInterrupted:
        raise
    except KeyboardInterrupt as exc:  # before the workers started, or while stopping them
        raise _stopped(cfg, progress, signal_of(exc)) from None


def _run_experiment(cfg: ExperimentConfig, show_progress: bool, progress: _Progress) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    check_packages(cfg)  # raises the one-line error before any slow work
    check_run_dir(cfg)
    check_sync(cfg)
    check_resources(cfg)
    check_reward(cfg)
    if cfg.agent.path:
        from areal_fast.agent.runner import load_agent

        # a bad agent.path fails here, at once; the agent is built in the rollout workers
        load_agent(cfg.agent.path, cfg.agent.kwargs, construct=False)
        check_trajectory_dir(cfg)
    train_set, eval_set, removed = load_datasets(cfg)
    check_batch_size(cfg, train_set, removed)
    tokenizer = load_tokenizer(cfg.model.path)  # also builds the demo model cache once
    prompts = ChatPrompts(tokenizer, cfg.data.instruction)
    model_config = load_model_config(cfg.model.path)
    if cfg.actor.lora.enabled:  # a target naming no module fails here, at once
        from areal_fast.train.lora import check_lora_targets

        check_lora_targets(model_config, cfg.actor.lora)
    check_lengths(
        cfg, prompts, train_set + eval_set, getattr(model_config, "max_position_embeddings", None)
    )
    run_dir = prepare_run_dir(cfg)
    progress.run_dir = run_dir
    data = (prompts, tokenizer, train_set, eval_set, removed)
    resume, restarts = cfg.resume, 0
    while True:
        try:
            return _attempt(cfg, run_dir, data, resume, restarts, show_progress, progress)
        except WorkerError as exc:
            if not _trainer_fault(exc):
                mark_failed(run_dir, exc)
                raise
            if restarts >= cfg.recovery.max_trainer_restarts:
                failure = WorkerError(
                    f"{str(exc).splitlines()[0]} (no trainer restart left: "
                    f"recovery.max_trainer_restarts = "
                    f"{cfg.recovery.max_trainer_restarts})",
                    exc.worker,
                    exc.died,
                )
                mark_failed(run_dir, failure)
                raise failure from exc
            restarts += 1
            log.warning(
                "%s; restarting the job from its last checkpoint, if any (trainer "
                "restart %d of at most %d, recovery.max_trainer_restarts)",
                exc,
                restarts,
                cfg.recovery.max_trainer_restarts,
            )
            resume = True
        except KeyboardInterrupt as exc:
            raise _stopped(cfg, progress, signal_of(exc)) from None
        except BaseException as exc:
            mark_failed(run_dir, exc)
            raise


def _stopped(cfg: ExperimentConfig, progress: _Progress, signum: int) -> RunInterrupted:
    """Clean up after Ctrl-C / SIGTERM (the workers are stopped already): delete
    uncommitted checkpoints and a partial final model, write ``INTERRUPTED``; returns the
    exception to raise."""
    with signals_deferred():
        run_dir = progress.run_dir
        if run_dir is None:
            return RunInterrupted(
                f"interrupted while {progress.phase}; nothing was written", signum
            )
        checkpoints = CheckpointManager(
            run_dir / "checkpoints",
            cfg.checkpoint.every_steps,
            cfg.checkpoint.keep,
            cfg.total_steps,
        )
        discarded = any(checkpoints.root.glob(".tmp-step-*"))
        checkpoints.remove_temporaries()
        shutil.rmtree(run_dir / "shards", ignore_errors=True)  # pending groups: not resumed
        if progress.phase == "saving the final model":
            shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
        line = describe_stop(
            progress.phase,
            progress.version,
            cfg.total_steps,
            checkpoints,
            cfg.checkpoint.every_steps,
            discarded,
        )
        write_interrupted(run_dir, line, signum)
        return RunInterrupted(line, signum)


def _trainer_fault(exc: WorkerError) -> bool:
    """Whether a trainer rank died or failed (a restart from a checkpoint may help)."""
    return bool(exc.worker) and exc.worker.startswith("trainer")


def _attempt(
    cfg: ExperimentConfig,
    run_dir: Path,
    data,
    resume: bool,
    restarts: int,
    show_progress: bool,
    progress: _Progress,
) -> dict:
    """Start the workers (from the last complete checkpoint when ``resume``) and run."""
    checkpoints = CheckpointManager(
        run_dir / "checkpoints", cfg.checkpoint.every_steps, cfg.checkpoint.keep, cfg.total_steps
    )
    latest = None
    if resume:
        latest = checkpoints.latest()
        checkpoints.remove_temporaries()
        if latest is None:
            log.warning(
                "no complete checkpoint in %s: the run starts again from step 0", checkpoints.root
            )
    progress.version = latest.version if latest else 0
    progress.phase = "starting the workers"
    shutil.rmtree(run_dir / "shards", ignore_errors=True)  # pending groups are not resumed
    if latest is not None and latest.version >= cfg.total_steps:
        log.warning(
            "the checkpoint is of version %d, total_steps = %d: nothing to train",
            latest.version,
            cfg.total_steps,
        )
    spec = cluster_spec(cfg, resume_from=str(latest.path) if latest else "")
    # opened before any worker starts: a wandb login problem fails at once
    with LogSinks(cfg, run_dir, progress.version if resume else None) as sinks:
        cluster = make_cluster(cfg, spec)
        try:
            cluster.__enter__()
        except WorkerError as exc:
            if latest is not None and _trainer_fault(exc):  # e.g. a file damaged in place
                checkpoints.mark_damaged(latest.path, str(exc).splitlines()[0])
            raise
        try:
            summary = _run(
                cfg,
                run_dir,
                cluster,
                *data,
                show_progress,
                checkpoints,
                latest,
                resume,
                restarts,
                progress,
                sinks,
            )
        except KeyboardInterrupt as exc:
            with signals_deferred():  # stopping the workers must not be cut short
                cluster.__exit__(type(exc), exc, exc.__traceback__)
            raise
        except BaseException as exc:
            cluster.__exit__(type(exc), exc, exc.__traceback__)
            raise
        cluster.__exit__(None, None, None)
        warn_failed_exits(cluster)
        return summary


def warn_failed_exits(cluster: Cluster) -> None:
    """Log each worker that exited non-zero after the run itself succeeded (an error while
    shutting down, e.g. closing its agent sessions; its traceback precedes on stderr)."""
    for handle in [*cluster.rollout_workers, *cluster.trainer_ranks]:
        code = getattr(getattr(handle, "process", None), "exitcode", None)
        if code:
            how = "was killed (it did not exit in time)" if code < 0 else f"exited with code {code}"
            log.warning("worker %r %s while shutting down after the run", handle.name, how)


def _run(
    cfg,
    run_dir,
    cluster,
    prompts,
    tokenizer,
    train_set,
    eval_set,
    removed,
    show_progress,
    checkpoints: CheckpointManager,
    latest: Checkpoint | None,
    resume: bool,
    restarts: int,
    progress: _Progress,
    sinks: LogSinks,
):
    start = time.perf_counter()
    summary: dict = {
        "train_problems": len(train_set),
        "eval_problems": len(eval_set),
        "train_removed_overlap": removed,
        "seed": cfg.seed,
        "scheduler": cfg.scheduler.type,
        "train_world_size": cfg.scheduler.train_world_size,
        "trainer_restarts": restarts,
    }
    if resume:
        summary.update(
            resumed_from_version=latest.version if latest else 0,
            skipped_checkpoints=checkpoints.skipped,
        )
    params = SamplingParams(
        n=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    version = latest.version if latest else 0
    if cluster.trainer_version != version:
        raise WorkerError(
            f"trainer {cluster.trainer.name!r} started at version "
            f"{cluster.trainer_version}, the checkpoint is of version {version}",
            cluster.trainer.name,
        )
    log = (
        MetricsLog.resume(run_dir / "metrics.jsonl", version)
        if resume
        else MetricsLog(run_dir / "metrics.jsonl")
    )
    bar: console.StepBar | None = None

    def on_step(record: dict) -> None:
        log.append(record)
        sinks.log_step(record)
        progress.version = record["step"]
        bar.update(record)

    held_out = eval_requests(eval_set, prompts, cfg.eval.max_new_tokens)
    step_evals = _step_evals(cfg, run_dir, held_out, version, len(cluster.rollout_workers))
    stream = ProblemStream(train_set, cfg.seed)
    if latest:  # the problems drawn before the checkpoint are not drawn again
        stream.next_batch(latest.controller["counts"]["rollouts_submitted"])
    controller = AsyncController(
        cluster.rollout_workers,
        cluster.trainer,
        cluster.weight_buffers,
        MathRequests(stream, prompts, params, cfg.seed),
        run_plan(cfg),
        cfg.rollout,
        on_step,
        timeouts=cfg.launcher.timeouts,
        recovery=cfg.recovery,
        trainer_ranks=cluster.trainer_ranks,
        restart_rollout=cluster.restart_rollout,
        checkpoints=checkpoints if cfg.checkpoint.every_steps else None,
        resume=latest.controller if latest else None,
        step_evals=step_evals,
    )
    eval_points = {}
    before_file = run_dir / "eval_before.jsonl"
    eval_seconds = 0.0
    try:
        if cfg.eval.before and latest and before_file.is_file():  # measured by the 1st attempt
            records = [json.loads(line) for line in before_file.read_text().splitlines()]
            summary["eval_before"] = _accuracy(records)
            console.say(
                console.eval_finished("before training", _correct(records), len(records), None)
            )
            eval_points["before"] = (0, summary["eval_before"])
        elif cfg.eval.before:
            progress.phase = "evaluating before training"
            t0 = time.perf_counter()
            summary["eval_before"] = _evaluate(
                controller, held_out, before_file, "before training", cfg.eval.max_new_tokens
            )
            eval_seconds = time.perf_counter() - t0
            eval_points["before"] = (0, summary["eval_before"])
            sinks.log_eval("eval_before", 0, summary["eval_before"])
        progress.phase = "training"
        elapsed_before = float(latest.controller.get("elapsed_seconds", 0.0)) if latest else 0.0
        bar = console.StepBar(
            cfg.total_steps,
            version,
            extra_seconds=eval_seconds if cfg.eval.after else 0.0,
            max_seconds=cfg.max_seconds,
            elapsed_before=elapsed_before,
            enabled=show_progress,
        )
        if step_evals.due(version) and version not in step_evals.accuracy:
            # lost with the run that saved the checkpoint
            step_evals.start(version, controller.fleet)
        try:
            counts = controller.run()
        finally:
            bar.close()
        if step_evals.accuracy:
            by_step = sorted(step_evals.accuracy.items())
            summary["eval_accuracy_by_step"] = {str(k): a for k, a in by_step}
            summary["eval_seconds_by_step"] = {
                str(k): round(t, 3) for k, t in sorted(step_evals.seconds.items())
            }
        if cfg.eval.after and controller.version in step_evals.accuracy:  # the same weights
            shutil.copyfile(
                run_dir / f"eval_step_{controller.version}.jsonl", run_dir / "eval_after.jsonl"
            )
            summary["eval_after"] = step_evals.accuracy[controller.version]
            console.say(
                f"held-out accuracy after training (step {controller.version}): "
                f"{summary['eval_after']:.1%}, the evaluation at step {controller.version}"
            )
            eval_points["after"] = (controller.version, summary["eval_after"])
        elif cfg.eval.after:
            progress.phase = "evaluating after training"
            summary["eval_after"] = _evaluate(
                controller,
                held_out,
                run_dir / "eval_after.jsonl",
                f"after training (step {controller.version})",
                cfg.eval.max_new_tokens,
            )
            eval_points["after"] = (controller.version, summary["eval_after"])
            sinks.log_eval("eval_after", controller.version, summary["eval_after"])
        if log.records:
            plot_progress(
                log.records,
                eval_points,
                run_dir / "progress.png",
                title=f"{cfg.experiment_name}/{cfg.trial_name} · {cfg.model.path}",
                eval_steps=step_evals.accuracy,
            )
        if cfg.checkpoint.final_model:
            progress.phase = "saving the final model"
            save_checkpoint(cluster, str(run_dir / "checkpoint"), cfg.launcher.timeouts.train_step)
            tokenizer.save_pretrained(str(run_dir / "checkpoint"))
        progress.phase = "writing the summary"
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        finish_checkpoints(
            controller,
            cluster.trainer_ranks,
            min(CHECKPOINT_WAIT_SECONDS, cfg.launcher.timeouts.train_step),
            console.say,
        )
        raise
    shutil.rmtree(run_dir / "shards", ignore_errors=True)
    summary.update(
        steps=controller.version,
        wall_seconds=time.perf_counter() - start,
        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
        **counts.as_dict(),
        **controller.weights.summary(),
        weight_transports=dict(cluster.transports),
        worker_nodes=dict(cluster.nodes),
        torch=torch.__version__,
        trainer_threads=worker_threads(cfg)[0],
        rollout_threads=worker_threads(cfg)[1],
        machine=platform.machine(),
    )
    if log.records:
        summary["trained_tokens_per_s_cumulative"] = log.records[-1][
            "trained_tokens_per_s_cumulative"
        ]
        for key in ("trainable_parameters", "weight_update_bytes", "trainer_peak_rss_mb"):
            if key in log.records[-1]:
                summary[key] = log.records[-1][key]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for line in console.end_summary(
        summary, run_dir, cfg.checkpoint.final_model, time.perf_counter() - progress.started
    ):
        console.say(line)
    return summary


def _step_evals(
    cfg: ExperimentConfig, run_dir: Path, held_out: list, version: int, workers: int
) -> StepEvals:
    """The evaluations during training (``eval.every_steps``): each writes
    ``eval_step_<k>.jsonl`` and prints its accuracy. A run resumed at ``version`` keeps the
    files and accuracies of steps up to it and deletes later ones (trained again) and torn
    ones (a crash while writing: evaluated again if due)."""

    def done(step: int, records: list[dict], seconds: float) -> None:
        correct = write_eval_records(run_dir / f"eval_step_{step}.jsonl", records)
        console.say(console.eval_finished(f"at step {step}", correct, len(records), seconds))

    evals = StepEvals(cfg.eval.every_steps, held_out, done, cfg.launcher.timeouts.evaluate)
    for path in run_dir.glob("eval_step_*.jsonl"):
        suffix = path.stem.rsplit("_", 1)[1]
        if not suffix.isdigit():
            continue
        step = int(suffix)
        try:
            records = [json.loads(line) for line in path.read_text().splitlines()]
        except ValueError:
            records = []
        if step > version or not records:
            path.unlink()
        else:
            evals.accuracy[step] = _accuracy(records)
    if evals.due(cfg.eval.every_steps):
        console.say(
            f"held-out evaluation every {cfg.eval.every_steps} steps during training: "
            f"{len(held_out)} problems on {workers} rollout worker(s), greedy, on the "
            f"weights of that step"
        )
    return evals


def save_checkpoint(cluster: Cluster, path: str, timeout: float) -> None:
    """Ask the trainer (every rank) to write a HF checkpoint directory at ``path`` and wait
    for rank 0's answer."""
    for rank in cluster.trainer_ranks:
        rank.send(SaveCheckpoint(path))
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerError(
                f"trainer {cluster.trainer.name!r} did not save {path} within "
                f"launcher.timeouts.train_step = {timeout:g} s"
            )
        for _rank, message in wait_messages(cluster.trainer_ranks, left, "while saving"):
            if isinstance(message, Saved):
                return


def _accuracy(records: list[dict]) -> float:
    return sum(r["correct"] for r in records) / max(len(records), 1)


def _correct(records: list[dict]) -> int:
    return int(round(sum(r["correct"] for r in records)))


def _evaluate(
    controller: AsyncController, requests, path: Path, when: str, max_new_tokens: int
) -> float:
    """Greedy held-out evaluation: one console line as it starts and one with the accuracy;
    writes one JSON line per problem to ``path``; returns the accuracy (a fraction)."""
    console.say(console.eval_started(when, len(requests), len(controller.workers), max_new_tokens))
    t0 = time.perf_counter()
    records = controller.evaluate(requests)
    correct = write_eval_records(path, records)
    console.say(console.eval_finished(when, correct, len(records), time.perf_counter() - t0))
    return _accuracy(records)
