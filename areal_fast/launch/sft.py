"""``areal-fast sft``: supervised fine-tuning in this process, through the trainer engine.

The run reads and tokenizes every row before anything is written, then trains
``total_steps`` updates of ``batch_size`` rows each (:func:`~areal_fast.train.sft_step.sft_step`:
packed micro-batches, the fused token-mean NLL, AdamW, LoRA when ``actor.lora.rank`` > 0),
with the run directory of ``areal-fast train``: ``config.yaml``, ``metrics.jsonl`` (one line
per step), ``eval_*.jsonl`` (:mod:`areal_fast.launch.sft_evals`), ``tensorboard/`` /
``wandb/``, ``checkpoints/step-<k>/`` (``checkpoint.every_steps``), ``checkpoint/`` (the
fine-tuned model: a ``model.path`` for ``areal-fast train``) and ``summary.json`` last.
``resume=true`` continues from the newest complete checkpoint; the rows of step k depend on
``seed`` and k alone, so a resumed run ends with the weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from areal_fast.controller.checkpoint_manager import CheckpointManager
from areal_fast.controller.metrics import MetricsLog
from areal_fast.data.sft_data import load_sft_examples, step_rows
from areal_fast.launch import console
from areal_fast.launch.config import ExperimentConfig, LoggingConfig
from areal_fast.launch.experiment import seed_everything
from areal_fast.launch.factories import TorchTrainerFactory
from areal_fast.launch.interrupt import RunInterrupted, signal_of
from areal_fast.launch.log_sinks import LogSinks
from areal_fast.launch.packages import check_packages
from areal_fast.launch.run_dir import check_run_dir, mark_failed, prepare_run_dir
from areal_fast.launch.sft_config import SftConfig
from areal_fast.launch.sft_evals import SftEvals
from areal_fast.models.loading import load_tokenizer
from areal_fast.rollout.config import RolloutConfig
from areal_fast.train.checkpoint import load_train_state, save_train_state
from areal_fast.train.config import ActorConfig
from areal_fast.train.sft_step import pack_rows, sft_step


@dataclass
class SftInputs:
    """A supervised run's checked inputs: the tokenizer, the tokenized rows, the held-out
    evaluations."""

    tokenizer: object
    examples: list
    evals: SftEvals


def check_sft_inputs(cfg: SftConfig) -> SftInputs:
    """Load and check everything that can fail on bad input (packages, the run directory,
    the rows, the tokenizer, the held-out set) before anything is written.

    Raises
    ------
    ConfigError, ValueError, FileNotFoundError, ImportError
        Bad input, one line naming the key, or the file, row and key of a bad row.
    """
    needs = ExperimentConfig(
        actor=ActorConfig(lora=cfg.actor.lora),
        logging=LoggingConfig(tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb),
        data=cfg.eval.data,
    )
    check_packages(needs, training=True)
    check_run_dir(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    examples = load_sft_examples(cfg.data, tokenizer, cfg.actor.max_tokens_per_mb)
    if not any(e.num_targets for e in examples):
        raise ValueError(f"data.path {cfg.data.path}: no row has a token to train on")
    return SftInputs(tokenizer, examples, SftEvals(cfg, tokenizer))


def run_sft(cfg: SftConfig, show_progress: bool = True) -> dict:
    """Run one supervised fine-tuning job end to end; returns the summary.

    Raises
    ------
    ConfigError, ValueError, FileNotFoundError, ImportError
        Bad input, before anything is written.
    RunInterrupted
        Ctrl-C or SIGTERM: ``INTERRUPTED`` names the last checkpoint ``resume=true`` uses.
    """
    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    inputs = check_sft_inputs(cfg)  # nothing is written before this passes
    run_dir = prepare_run_dir(cfg)
    try:
        summary = train_sft(cfg, inputs, show_progress)
    except KeyboardInterrupt as exc:
        line = _interrupted_line(cfg)
        (run_dir / "INTERRUPTED").write_text(line + "\n")
        raise RunInterrupted(line, signal_of(exc)) from None
    except Exception as exc:
        mark_failed(run_dir, exc)
        raise
    summary["wall_seconds"] = time.perf_counter() - started
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for line in _end_lines(summary, cfg):
        console.say(line)
    return summary


def _interrupted_line(cfg: SftConfig) -> str:
    latest = _checkpoints(cfg).latest(quiet=True)
    where = f"step {latest.version} ({latest.path.name})" if latest else "step 0 (no checkpoint)"
    return f"interrupted; resume=true continues {cfg.run_dir} from {where}"


def _checkpoints(cfg: SftConfig) -> CheckpointManager:
    c = cfg.checkpoint
    return CheckpointManager(cfg.run_dir / "checkpoints", c.every_steps, c.keep, cfg.total_steps)


def new_engine(cfg: SftConfig):
    """The trainer engine of the run (model loaded, LoRA applied, mixed precision on a CUDA
    device with a half-precision ``model.dtype``), as ``areal-fast train``'s trainer makes it."""
    factory = TorchTrainerFactory(
        model=cfg.model,
        actor=cfg.actor.trainer_actor(),
        rollout=RolloutConfig(temperature=1.0),
        seed=cfg.seed,
        total_steps=cfg.total_steps,
    )
    return factory()


def train_sft(cfg: SftConfig, inputs: SftInputs, show_progress: bool) -> dict:
    """The training loop of :func:`run_sft` (the run directory prepared); returns the summary
    without ``wall_seconds``."""
    engine, checkpoints, evals, run_dir = (
        new_engine(cfg),
        _checkpoints(cfg),
        inputs.evals,
        cfg.run_dir,
    )
    latest = checkpoints.latest() if cfg.resume else None
    if latest is not None:
        load_train_state(engine, str(latest.path))
        checkpoints.remove_temporaries()
    start = engine.version
    metrics_path = run_dir / "metrics.jsonl"
    metrics = MetricsLog.resume(metrics_path, start) if cfg.resume else MetricsLog(metrics_path)
    evals.keep_until(run_dir, start)
    with LogSinks(cfg, run_dir, start if cfg.resume else None) as sinks:
        evals.evaluate_before(run_dir, resumed=latest is not None)
        if evals.before is not None:
            sinks.log_eval("eval_before", 0, evals.before)
        bar = console.StepBar(cfg.total_steps, start, enabled=show_progress)
        try:
            for step in range(start + 1, cfg.total_steps + 1):
                record = _train_one(cfg, engine, inputs, step)
                if evals.due(step):
                    record["eval_accuracy"] = evals.run_snapshot(
                        engine, inputs.tokenizer, run_dir, step
                    )
                metrics.append(record)
                sinks.log_step(record)
                bar.update(record)
                if checkpoints.due(step):
                    _save_checkpoint(engine, checkpoints, step)
        finally:
            bar.close()
        final = _save_final(cfg, engine, inputs.tokenizer)
        _evaluate_after(cfg, engine, inputs, final, sinks)
    return _summary(cfg, inputs, metrics.records, final)


def _train_one(cfg: SftConfig, engine, inputs: SftInputs, step: int) -> dict:
    """One update on the rows of ``step``; its ``metrics.jsonl`` record."""
    t0 = time.perf_counter()
    rows = [
        inputs.examples[i]
        for i in step_rows(len(inputs.examples), cfg.batch_size, cfg.seed, step - 1)
    ]
    stats = sft_step(engine, pack_rows([(e.input_ids, e.targets) for e in rows]))
    seconds = time.perf_counter() - t0
    record = {"step": step, **{k: v for k, v in stats.items() if k != "version"}}
    record["step_seconds"] = seconds
    record["tokens_per_second"] = stats["tokens"] / max(seconds, 1e-9)
    return record


def _save_checkpoint(engine, checkpoints: CheckpointManager, step: int) -> None:
    """A resumable checkpoint of the weights, optimizer, schedule and RNG states."""
    tmp = checkpoints.begin(step)
    save_train_state(engine, str(tmp))
    checkpoints.commit(tmp, step, {"sft_step": step})


def _save_final(cfg: SftConfig, engine, tokenizer):
    """Write ``checkpoint/`` (HF format, with the tokenizer) unless
    ``checkpoint.final_model`` is false; its path or None."""
    if not cfg.checkpoint.final_model:
        return None
    path = cfg.run_dir / "checkpoint"
    engine.save(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _evaluate_after(cfg: SftConfig, engine, inputs: SftInputs, final, sinks: LogSinks) -> None:
    """``eval.after`` on the fine-tuned weights (the evaluation of the last step reused)."""
    evals, run_dir, step = inputs.evals, cfg.run_dir, cfg.total_steps
    if not cfg.eval.after:
        return
    if step in evals.accuracy:
        (run_dir / "eval_after.jsonl").write_text((run_dir / f"eval_step_{step}.jsonl").read_text())
        evals.after = evals.accuracy[step]
    elif final is not None:
        evals.after = evals.run(
            str(final), run_dir / "eval_after.jsonl", f"after training (step {step})"
        )
    else:
        evals.after = evals.run_snapshot(engine, inputs.tokenizer, run_dir, step)
        (run_dir / f"eval_step_{step}.jsonl").rename(run_dir / "eval_after.jsonl")
        del evals.accuracy[step]
    sinks.log_eval("eval_after", step, evals.after)


def _summary(cfg: SftConfig, inputs: SftInputs, records: list[dict], final) -> dict:
    """``summary.json``'s content (``wall_seconds`` is added by the caller)."""
    return {
        "command": "sft",
        "steps": len(records),
        "rows": len(inputs.examples),
        "trained_tokens": int(sum(r["trained_tokens"] for r in records)),
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
        "model_path": cfg.model.path,
        "final_model": str(final) if final is not None else None,
        **inputs.evals.summary(),
    }


def _end_lines(summary: dict, cfg: SftConfig) -> list[str]:
    """The lines printed when the run ends."""
    took = console.format_seconds(summary["wall_seconds"])
    lines = [f"finished {summary['steps']} supervised steps in {took}"]
    if summary["loss_first"] is not None:
        lines.append(f"loss: {summary['loss_first']:.4f} → {summary['loss_last']:.4f} (nats/token)")
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before is not None and after is not None:
        lines.append(
            f"held-out accuracy: {before:.1%} → {after:.1%} ({summary['eval_problems']} problems)"
        )
    elif after is not None:
        lines.append(f"held-out accuracy after training: {after:.1%}")
    lines.append(f"run directory: {cfg.run_dir}")
    if summary["final_model"]:
        lines.append(f"  checkpoint/: the fine-tuned model (model.path={summary['final_model']})")
    return lines


__all__ = ["SftInputs", "check_sft_inputs", "new_engine", "run_sft", "train_sft"]
