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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from areal_fast.controller.checkpoint_manager import CheckpointManager
from areal_fast.data.sft_data import load_sft_examples, step_rows
from areal_fast.launch import console
from areal_fast.launch.allocator import loaded_allocator
from areal_fast.launch.config import ExperimentConfig, LoggingConfig
from areal_fast.launch.experiment import seed_everything
from areal_fast.launch.factories import TorchTrainerFactory
from areal_fast.launch.interrupt import RunInterrupted, signal_of
from areal_fast.launch.packages import check_packages
from areal_fast.launch.run_dir import check_run_dir, mark_failed, prepare_run_dir
from areal_fast.launch.sft_config import SftConfig
from areal_fast.launch.sft_evals import SNAPSHOT_DIR, SftEvals, eval_due
from areal_fast.launch.sft_ranks import Rank, set_threads, started_ranks
from areal_fast.launch.sft_reports import open_reports
from areal_fast.models.loading import load_tokenizer
from areal_fast.rollout.config import RolloutConfig
from areal_fast.train.checkpoint import load_train_state, save_train_state
from areal_fast.train.config import ActorConfig
from areal_fast.train.sft_step import pack_rows, sft_step

FINAL_DIR = "checkpoint"  # the fine-tuned model: a model.path for areal-fast train


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
    RuntimeError
        A spawned trainer rank failed.
    """
    started = time.perf_counter()
    world = cfg.scheduler.train_world_size
    set_threads(cfg.threads, world)
    seed_everything(cfg.seed)
    inputs = check_sft_inputs(cfg)  # nothing is written before this passes
    run_dir = prepare_run_dir(cfg)
    try:
        ranks = started_ranks(world, rank_main, (cfg, inputs.examples))
        with ranks as rank:
            summary = train_sft(cfg, inputs, rank, show_progress)
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


def rank_main(cfg: SftConfig, examples: list, rank: Rank) -> None:
    """The body of a spawned trainer rank: the loop of :func:`train_sft` on its rows."""
    set_threads(cfg.threads, rank.world_size)
    seed_everything(cfg.seed)
    train_sft(cfg, SftInputs(None, examples, None), rank, show_progress=False)


def _interrupted_line(cfg: SftConfig) -> str:
    latest = _checkpoints(cfg).latest(quiet=True)
    where = f"step {latest.version} ({latest.path.name})" if latest else "step 0 (no checkpoint)"
    return f"interrupted; resume=true continues {cfg.run_dir} from {where}"


def _checkpoints(cfg: SftConfig) -> CheckpointManager:
    c = cfg.checkpoint
    return CheckpointManager(cfg.run_dir / "checkpoints", c.every_steps, c.keep, cfg.total_steps)


def new_engine(cfg: SftConfig, rank: Rank):
    """The trainer engine of ``rank`` (model loaded, LoRA applied, sharded with FSDP2 over
    several ranks, mixed precision on a CUDA device with a half-precision ``model.dtype``),
    as ``areal-fast train``'s trainer makes it."""
    factory = TorchTrainerFactory(
        model=cfg.model,
        actor=cfg.actor.trainer_actor(),
        rollout=RolloutConfig(temperature=1.0),
        seed=cfg.seed,
        total_steps=cfg.total_steps,
        rank=rank.rank,
        world_size=rank.world_size,
        dist_init_method=rank.init_method,
        dist_timeout=cfg.scheduler.dist_timeout,
    )
    return factory()


def _resume(cfg: SftConfig, engine, rank: Rank) -> bool:
    """Load the newest complete checkpoint (``resume=true``; chosen by rank 0, loaded by
    every rank); whether there was one."""
    checkpoints = _checkpoints(cfg)
    latest = checkpoints.latest() if cfg.resume and rank.main else None
    path = rank.share(str(latest.path) if latest else None)
    if path is not None:
        load_train_state(engine, path)
        if rank.main:
            checkpoints.remove_temporaries()
    return path is not None


def train_sft(cfg: SftConfig, inputs: SftInputs, rank: Rank, show_progress: bool) -> dict:
    """The training loop of one rank (the run directory prepared); on rank 0 returns the
    summary without ``wall_seconds`` and writes the run's files, elsewhere returns {}."""
    engine = new_engine(cfg, rank)
    resumed = _resume(cfg, engine, rank)
    start = engine.version
    with open_reports(cfg, inputs.evals, start, rank, show_progress) as reports:
        reports.before(resumed)
        for step in range(start + 1, cfg.total_steps + 1):
            record = _train_one(cfg, engine, inputs.examples, step, rank)
            if eval_due(cfg, step):
                snapshot = _snapshot(engine, cfg, inputs, rank, SNAPSHOT_DIR)
                record["eval_accuracy"] = reports.during(snapshot, step)
                _remove(snapshot, rank)
            reports.step(record)
            if _checkpoints(cfg).due(step):
                _save_checkpoint(engine, step, rank, cfg)
        if cfg.checkpoint.final_model:
            final = after = _snapshot(engine, cfg, inputs, rank, FINAL_DIR)
        else:
            final, after = (
                None,
                _snapshot(engine, cfg, inputs, rank, SNAPSHOT_DIR, reports.needs_after()),
            )
        reports.after(after)
        _remove(None if final else after, rank)
        reports.plot()
    return _summary(cfg, inputs, reports.records, final) if rank.main else {}


def _train_one(cfg: SftConfig, engine, examples: list, step: int, rank: Rank) -> dict:
    """One update on this rank's share of the rows of ``step``; its ``metrics.jsonl`` record
    (the stats of the whole step's rows)."""
    t0 = time.perf_counter()
    picked = step_rows(len(examples), cfg.batch_size, cfg.seed, step - 1)
    rows = [examples[i] for i in rank.rows(picked)]
    stats = sft_step(engine, pack_rows([(e.input_ids, e.targets) for e in rows]))
    seconds = time.perf_counter() - t0
    record = {"step": step, **{k: v for k, v in stats.items() if k != "version"}}
    record["step_seconds"] = seconds
    record["tokens_per_second"] = stats["tokens"] / max(seconds, 1e-9)
    return record


def _save_checkpoint(engine, step: int, rank: Rank, cfg: SftConfig) -> None:
    """A resumable checkpoint of the weights, optimizer, schedule and RNG states of every
    rank (a collective; rank 0 commits it)."""
    checkpoints = _checkpoints(cfg)
    tmp = rank.share(str(checkpoints.begin(step)) if rank.main else None)
    save_train_state(engine, tmp)
    if rank.main:
        checkpoints.commit(Path(tmp), step, {"sft_step": step})
    rank.barrier()


def _snapshot(engine, cfg: SftConfig, inputs: SftInputs, rank: Rank, name: str, needed=True):
    """Save the weights (HF format) and the tokenizer into ``<run dir>/<name>`` (a
    collective); its path on rank 0, None elsewhere or when not ``needed`` (rank 0's say)."""
    if not rank.share(needed):
        return None
    path = cfg.run_dir / name
    if rank.main:
        shutil.rmtree(path, ignore_errors=True)
    engine.save(str(path))
    if rank.main:
        inputs.tokenizer.save_pretrained(str(path))
        return path
    return None


def _remove(path, rank: Rank) -> None:
    """Delete an evaluation's copy of the weights (rank 0), after the ranks meet."""
    rank.barrier()  # the others waited here while rank 0 evaluated
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


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
        "allocator": loaded_allocator(),
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


__all__ = ["SftInputs", "check_sft_inputs", "new_engine", "rank_main", "run_sft", "train_sft"]
