"""Run one experiment: check the inputs, start the workers (local processes or Ray actors),
run the controller; resume from checkpoints and restart after a trainer fault."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from areal_fast.controller.async_loop import AsyncController, RunPlan
from areal_fast.controller.requests import MathRequests, ProblemStream
from areal_fast.controller.step_evals import StepEvals
from areal_fast.launch.checkpoints import ResumePoint, resume_point, save_final_model
from areal_fast.launch.checkpoints import save_checkpoint as save_checkpoint
from areal_fast.launch.cluster import Cluster
from areal_fast.launch.config import ExperimentConfig
from areal_fast.launch.held_out import HeldOutEvals
from areal_fast.launch.inputs import RunInputs, check_inputs
from areal_fast.launch.interrupt import checkpoints_finished_on_stop, stops_cleanly
from areal_fast.launch.log_sinks import LogSinks
from areal_fast.launch.reporter import Reporter
from areal_fast.launch.restarts import Attempt, with_trainer_restarts
from areal_fast.launch.run_context import RunContext
from areal_fast.launch.run_dir import prepare_run_dir, release_run_dir
from areal_fast.launch.summary import Trained, summarise
from areal_fast.launch.worker_specs import started_workers
from areal_fast.rollout.engine import SamplingParams


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_plan(cfg: ExperimentConfig) -> RunPlan:
    """How long the controller trains (its other settings are ``cfg.rollout``,
    ``cfg.recovery`` and ``cfg.launcher.timeouts``, passed as they are)."""
    return RunPlan(cfg.total_steps, cfg.batch_size, max_seconds=cfg.max_seconds)


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
    run = RunContext(cfg, show_progress=show_progress)
    with stops_cleanly(run):  # Ctrl-C / SIGTERM: INTERRUPTED, then RunInterrupted
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        inputs = check_inputs(cfg)  # nothing is written or started before this passes
        run.run_dir = prepare_run_dir(cfg)  # claimed by this process until the run ends
        try:
            # a trainer fault starts the job again from its last checkpoint
            return with_trainer_restarts(run, lambda attempt: run_attempt(run, inputs, attempt))
        finally:
            release_run_dir(run.run_dir)


def run_attempt(run: RunContext, inputs: RunInputs, attempt: Attempt) -> dict:
    """Run the job once: start the workers, evaluate before training, train, evaluate after,
    save the final model and write the summary; returns the summary.

    Parameters
    ----------
    run : RunContext
        The run (its directory prepared).
    inputs : RunInputs
        The checked data and tokenizer.
    attempt : Attempt
        Whether to resume from the last complete checkpoint.

    Raises
    ------
    WorkerError
        A worker died, failed or missed a deadline (the workers are stopped).
    """
    cfg = run.cfg
    start = resume_point(cfg, run.run_dir, attempt)
    run.version, run.phase = start.version, "starting the workers"
    # opened before any worker starts: a wandb login problem fails at once
    sink_step = start.version if attempt.resume else None
    with LogSinks(cfg, run.run_dir, sink_step) as sinks, started_workers(cfg, start) as cluster:
        reporter = Reporter.open(run, sinks, attempt.resume)
        evals = HeldOutEvals(cfg, run.run_dir, inputs, start, len(cluster.rollout_workers))
        controller = new_controller(cfg, inputs, cluster, start, reporter, evals.during)
        stop_wait = cfg.launcher.timeouts.train_step
        with checkpoints_finished_on_stop(controller, cluster.trainer_ranks, stop_wait):
            evals.evaluate_before(controller, reporter)
            reporter.enter("training")
            after_seconds = evals.seconds_before if cfg.eval.after else 0.0
            with reporter.step_bar(after_seconds, start.elapsed_seconds):
                evals.catch_up(controller)  # an evaluation lost with the last attempt
                counts = controller.run()
            evals.evaluate_after(controller, reporter)
            reporter.plot(evals.points, evals.during.accuracy)
            save_final_model(run, cluster, inputs.tokenizer)
        return summarise(inputs, start, evals, Trained(controller, counts, cluster, reporter))


def new_controller(
    cfg: ExperimentConfig,
    inputs: RunInputs,
    cluster: Cluster,
    start: ResumePoint,
    reporter: Reporter,
    step_evals: StepEvals,
) -> AsyncController:
    """The controller of one attempt, over the started ``cluster``, from ``start``.

    Parameters
    ----------
    cfg : ExperimentConfig
    inputs : RunInputs
        The training problems and the prompt template.
    cluster : Cluster
        The started workers.
    start : ResumePoint
        The checkpoint the attempt resumes from, if any (the problems drawn before it are
        not drawn again).
    reporter : Reporter
        Receives each step's record.
    step_evals : StepEvals
        The evaluations during training.
    """
    stream = ProblemStream(inputs.train_set, cfg.seed)
    if start.latest:  # the problems drawn before the checkpoint are not drawn again
        stream.next_batch(start.latest.controller["counts"]["rollouts_submitted"])
    params = SamplingParams(
        n=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    return AsyncController(
        cluster.rollout_workers,
        cluster.trainer,
        cluster.weight_buffers,
        MathRequests(stream, inputs.prompts, params, cfg.seed),
        run_plan(cfg),
        cfg.rollout,
        reporter.on_step,
        timeouts=cfg.launcher.timeouts,
        recovery=cfg.recovery,
        trainer_ranks=cluster.trainer_ranks,
        restart_rollout=cluster.restart_rollout,
        checkpoints=start.checkpoints if cfg.checkpoint.every_steps else None,
        resume=resume_state(cfg, start),
        step_evals=step_evals,
    )


def resume_state(cfg: ExperimentConfig, start: ResumePoint) -> Optional[dict]:
    """The checkpoint's controller state the controller resumes from (None: step 0); a
    reproducible run's also names the checkpoint, whose rollouts it trains, and the folder
    their shards are copied into (``<run dir>/shards/restored``)."""
    state = start.controller_state
    if state is None or not cfg.rollout.reproducible:
        return state
    restore_dir = cfg.run_dir / "shards" / "restored"
    return {**state, "checkpoint": str(start.latest.path), "restore_dir": str(restore_dir)}
