"""Local launcher: build every component of one experiment in this process and run it."""

from __future__ import annotations

import copy
import json
import platform
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from areal_fast.controller.loop import LoopSettings, train_loop
from areal_fast.controller.metrics import MetricsLog, plot_progress
from areal_fast.controller.rollout import MathRollout, ProblemStream
from areal_fast.data.tasks import drop_eval_overlap, load_problems
from areal_fast.launch.config import ConfigError, ExperimentConfig, to_yaml
from areal_fast.models.loading import load_causal_lm, load_tokenizer
from areal_fast.rollout.engine import SamplingParams
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.train.torch_engine import TorchTrainEngine


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def unique_questions(problems):
    """``problems`` without repeated questions, first occurrence kept, order preserved."""
    seen, out = set(), []
    for problem in problems:
        if problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def load_datasets(cfg: ExperimentConfig):
    """Training and distinct held-out problems; held-out questions are removed from training.

    The held-out set is the first ``data.eval_size`` distinct questions of the eval split
    (GSM8K: a subset drawn with ``data.eval_seed``, in file order; generated tasks: drawn
    with ``data.eval_seed``).
    """
    d = cfg.data
    # generated tasks repeat questions: draw extra so that eval_size distinct ones remain
    pool_size = d.eval_size if d.task == "gsm8k" else 3 * d.eval_size
    pool = load_problems(d.task, split=d.eval_split, size=pool_size, seed=d.eval_seed,
                         path=d.path, task_kwargs=d.task_kwargs)
    eval_set = unique_questions(pool)[:d.eval_size]
    if len(eval_set) < d.eval_size:
        raise ValueError(f"data.eval_size = {d.eval_size}: the task offers only "
                         f"{len(eval_set)} distinct held-out questions")
    train_set = load_problems(d.task, split=d.train_split, size=d.train_size,
                              seed=d.train_seed, path=d.path, task_kwargs=d.task_kwargs)
    train_set, removed = drop_eval_overlap(train_set, eval_set)
    if not train_set:
        raise ValueError(f"data: every training problem also appears in the held-out set "
                         f"({removed} removed); raise data.train_size or change the task")
    return train_set, eval_set, removed


def check_run_dir(cfg: ExperimentConfig) -> None:
    """Fail early if the run directory cannot be (re)used; changes nothing on disk.

    An existing directory is replaced only with ``overwrite=true`` and only if it is a run
    directory (holds ``config.yaml``), never an arbitrary folder.
    """
    run_dir = cfg.run_dir
    for parent in reversed(run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"fileroot: {parent} is a file, so run directory {run_dir} "
                              f"cannot be created")
    if not run_dir.exists():
        return
    if not cfg.overwrite:
        raise ConfigError(f"run directory {run_dir} already exists; pass overwrite=true "
                          f"or choose another trial_name")
    if not (run_dir.is_dir() and (run_dir / "config.yaml").is_file()):
        raise ConfigError(f"overwrite=true refuses to delete {run_dir}: it is not an areal-fast "
                          f"run directory (no config.yaml)")


def prepare_run_dir(cfg: ExperimentConfig) -> Path:
    """Create the run directory (replacing an old run's when allowed) with ``config.yaml``."""
    check_run_dir(cfg)
    run_dir = cfg.run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"fileroot: cannot create run directory {run_dir} "
                          f"({exc.strerror})") from exc
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def check_lengths(cfg: ExperimentConfig, rollout: MathRollout, problems, max_positions) -> None:
    """Fail before any work if the longest possible sequence fits no micro-batch or model.

    Raises
    ------
    ValueError
        Naming ``actor.max_tokens_per_mb`` or ``rollout.max_new_tokens`` /
        ``eval.max_new_tokens``.
    """
    longest_prompt = max(len(rollout.prompt_ids(p)) for p in problems)
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if max_positions and longest_prompt + new_tokens > max_positions:
        raise ValueError(f"rollout.max_new_tokens / eval.max_new_tokens = {new_tokens}: with "
                         f"the longest prompt ({longest_prompt} tokens) this exceeds the "
                         f"model's {max_positions} positions")
    need = longest_prompt + cfg.rollout.max_new_tokens
    if cfg.actor.keep_groups:
        need *= cfg.rollout.group_size
    if need > cfg.actor.max_tokens_per_mb:
        what = "a GRPO group" if cfg.actor.keep_groups else "one sequence"
        raise ValueError(f"actor.max_tokens_per_mb = {cfg.actor.max_tokens_per_mb} is smaller "
                         f"than {what} can be ({need} tokens: longest prompt {longest_prompt} "
                         f"+ rollout.max_new_tokens {cfg.rollout.max_new_tokens})")


def run_experiment(cfg: ExperimentConfig, show_progress: bool = True) -> dict:
    """Run one synchronous GRPO experiment end to end; returns the summary dict.

    Everything that can fail on bad input (data files, task names, model path) is loaded
    before the run directory is created. The run directory gets ``config.yaml``,
    ``metrics.jsonl`` (one line per step), ``eval_before.jsonl`` / ``eval_after.jsonl``,
    ``progress.png``, ``checkpoint/`` and, last of all, ``summary.json``: a run directory
    without ``summary.json`` did not finish (a failed run also gets ``FAILED`` with the error).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    check_run_dir(cfg)  # raises the one-line error before any slow work
    train_set, eval_set, removed = load_datasets(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    policy = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation,
                            cfg.model.device)
    engine = HFEngine(copy.deepcopy(policy), tokenizer, cfg.rollout.max_batch_size)
    ref = copy.deepcopy(policy) if cfg.actor.loss.kl_coef > 0 else None
    trainer = TorchTrainEngine(policy, cfg.actor.loss, cfg.actor.optim,
                               temperature=cfg.rollout.temperature,
                               max_tokens_per_mb=cfg.actor.max_tokens_per_mb,
                               pack_method=cfg.actor.pack_method,
                               keep_groups=cfg.actor.keep_groups, ref_model=ref)
    rollout = MathRollout(engine, tokenizer, cfg.data.instruction)
    check_lengths(cfg, rollout, train_set + eval_set,
                  getattr(policy.config, "max_position_embeddings", None))
    run_dir = prepare_run_dir(cfg)
    try:
        return _run(cfg, run_dir, rollout, trainer, train_set, eval_set, removed, show_progress)
    except BaseException as exc:
        (run_dir / "FAILED").write_text(f"{type(exc).__name__}: {exc}\n")
        raise


def _run(cfg, run_dir, rollout, trainer, train_set, eval_set, removed, show_progress):
    start = time.perf_counter()
    summary: dict = {"train_problems": len(train_set), "eval_problems": len(eval_set),
                     "train_removed_overlap": removed, "seed": cfg.seed}
    eval_points = {}
    if cfg.eval.before:
        summary["eval_before"] = _evaluate(rollout, eval_set, cfg, run_dir / "eval_before.jsonl")
        eval_points["before"] = (0, summary["eval_before"])
    settings = LoopSettings(cfg.total_steps, cfg.batch_size, SamplingParams(
        n=cfg.rollout.group_size, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens), adv_mode=cfg.actor.adv_mode)
    log = MetricsLog(run_dir / "metrics.jsonl")
    train_loop(rollout, trainer, ProblemStream(train_set, cfg.seed), settings, log,
               show_progress)
    if cfg.eval.after:
        summary["eval_after"] = _evaluate(rollout, eval_set, cfg, run_dir / "eval_after.jsonl")
        eval_points["after"] = (cfg.total_steps, summary["eval_after"])
    if log.records:
        plot_progress(log.records, eval_points, run_dir / "progress.png")
    trainer.save(str(run_dir / "checkpoint"))
    rollout.tokenizer.save_pretrained(str(run_dir / "checkpoint"))
    summary.update(steps=cfg.total_steps, wall_seconds=time.perf_counter() - start,
                   torch=torch.__version__, torch_threads=torch.get_num_threads(),
                   machine=platform.machine())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _evaluate(rollout: MathRollout, eval_set, cfg: ExperimentConfig, path: Path) -> float:
    accuracy, records = rollout.evaluate(eval_set, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    with path.open("w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    return accuracy
