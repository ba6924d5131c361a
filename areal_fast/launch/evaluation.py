"""``areal-fast eval``: greedy held-out accuracy of any model, on the rollout workers of a job.

The model (``model.path``: a local directory such as a run's ``checkpoint/``, an HF id, or
the demo model) is loaded by the same rollout workers that training uses, started by the
same launcher (``scheduler.type``) without a trainer, and asked for the same greedy
evaluation as a training run's ``eval.before`` / ``eval.after``: the held-out set of
``data.*``, ``eval.max_new_tokens`` tokens per answer. The evaluation directory receives
``config.yaml``, ``eval.jsonl`` (one record per problem: uid, answer, completion, correct,
reward) and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from areal_fast.controller.requests import ChatPrompts, eval_requests
from areal_fast.launch.cluster import ClusterSpec
from areal_fast.launch.config import ConfigError, ExperimentConfig, to_yaml
from areal_fast.launch.inputs import check_positions, load_eval_set
from areal_fast.launch.packages import check_packages
from areal_fast.launch.run_dir import write_eval_records
from areal_fast.launch.worker_specs import (
    check_resources,
    check_reward,
    cluster_spec,
    make_cluster,
)
from areal_fast.models.loading import load_model_config, load_tokenizer
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError, WorkerHandle, wait_messages

EVAL_FILE = "eval.jsonl"


@dataclasses.dataclass
class RolloutOnlySpec(ClusterSpec):
    """A :class:`ClusterSpec` whose cluster starts the rollout workers and no trainer rank."""

    def trainer_specs(self) -> list:
        """No trainer rank: evaluation needs only the engines."""
        return []


def eval_dir(cfg: ExperimentConfig, out: str | None = None) -> Path:
    """Where an evaluation writes: ``out``, else ``fileroot/experiment_name/eval-<trial_name>``
    (beside the training run directory, never inside it)."""
    return Path(out) if out else Path(cfg.fileroot) / cfg.experiment_name / f"eval-{cfg.trial_name}"


def check_eval_dir(path: Path, overwrite: bool) -> None:
    """Fail before any work if ``path`` cannot receive an evaluation; changes nothing.

    Raises
    ------
    ConfigError
        ``path`` is a file or cannot be created, or is a non-empty folder without
        ``overwrite=true``, or (with it) a folder that holds no earlier evaluation (its
        ``eval.jsonl``).
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"evaluation directory {path} is a file")
    parent = next(p for p in [path, *path.parents] if p.exists())
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise ConfigError(
            f"evaluation directory {path} cannot be created ({parent} is not a writable folder)"
        )
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not overwrite:
        raise ConfigError(
            f"evaluation directory {path} already exists; pass overwrite=true, "
            f"--out DIR or another trial_name"
        )
    if not (path / EVAL_FILE).is_file():
        raise ConfigError(
            f"overwrite=true refuses to write into {path}: it holds no earlier "
            f"evaluation ({EVAL_FILE})"
        )


def evaluate_on(
    workers: list[WorkerHandle], requests: list[msg.GroupRequest], timeout: float
) -> list[dict]:
    """Spread greedy evaluation ``requests`` over ready rollout ``workers``; one record per
    request (uid, answer, completion, correct, reward), in request order.

    Raises
    ------
    WorkerError
        A worker died, failed, or did not finish within ``timeout`` seconds
        (``launcher.timeouts.evaluate``).
    """
    parts = {w.name: requests[i :: len(workers)] for i, w in enumerate(workers)}
    for worker in workers:
        worker.send(msg.Evaluate(parts[worker.name]))
    done: dict[str, list[dict]] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(workers):
        left = deadline - time.monotonic()
        if left <= 0:
            name = next(w.name for w in workers if w.name not in done)
            raise WorkerError(
                f"rollout worker {name!r} did not finish evaluation within "
                f"launcher.timeouts.evaluate = {timeout:g} s",
                name,
            )
        for handle, message in wait_messages(workers, min(left, 1.0), "during evaluation"):
            if isinstance(message, msg.EvalDone):
                done[handle.name] = message.records
    order = {r.uid: i for i, r in enumerate(requests)}
    records = [r for part in done.values() for r in part]
    return sorted(records, key=lambda r: order.get(r["uid"], 0))


def run_evaluation(cfg: ExperimentConfig, out: str | None = None) -> dict:
    """Evaluate ``cfg.model.path`` greedily on the held-out set; returns the summary.

    Everything that can fail on bad input (data, model path, the output folder, Ray's
    resources) is checked before a worker starts; the folder is written only when the
    evaluation has finished, so a failed one leaves nothing behind.

    Parameters
    ----------
    cfg : ExperimentConfig
        ``model.*``, ``data.*`` (the held-out set), ``eval.max_new_tokens``,
        ``rollout.num_workers`` / ``max_batch_size``, ``scheduler.*``, ``launcher.*``.
    out : str, optional
        Evaluation directory; default :func:`eval_dir`.

    Returns
    -------
    dict
        ``accuracy`` (fraction in [0, 1], the mean of ``eval.jsonl``'s ``correct``),
        ``correct``, ``problems``, ``model_path``, ``task``, ``max_new_tokens``,
        ``wall_seconds``, ``eval_dir``.

    Raises
    ------
    ConfigError, ValueError, FileNotFoundError, ImportError
        Bad input, one line naming the key or file.
    WorkerError
        A rollout worker failed, died or missed ``launcher.timeouts.evaluate``.
    """
    if cfg.resume:
        raise ConfigError(
            "resume=true: areal-fast eval has nothing to resume (it writes a "
            "new evaluation directory)"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    path, requests = check_eval_inputs(cfg, out)
    spec = rollout_only_spec(cfg)
    print(
        f"evaluating {len(requests)} held-out problems on {cfg.rollout.num_workers} rollout "
        f"worker(s) ...",
        file=sys.stderr,
        flush=True,
    )
    with make_cluster(cfg, spec) as cluster:
        records = evaluate_on(cluster.rollout_workers, requests, cfg.launcher.timeouts.evaluate)
    return write_evaluation(cfg, path, records, time.perf_counter() - start)


def check_eval_inputs(
    cfg: ExperimentConfig, out: str | None
) -> tuple[Path, list[msg.GroupRequest]]:
    """Check everything an evaluation can fail on before a worker starts; returns the
    evaluation directory (not created yet) and the held-out problems as greedy requests.

    Raises
    ------
    ConfigError, ValueError, FileNotFoundError, ImportError
        Bad input, one line naming the key or file.
    """
    check_packages(cfg, training=False)
    path = eval_dir(cfg, out)
    check_eval_dir(path, cfg.overwrite)
    check_resources(cfg)
    check_reward(cfg)
    problems = load_eval_set(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    prompts = ChatPrompts(tokenizer, cfg.data.instruction)
    check_positions(
        "eval.max_new_tokens",
        cfg.eval.max_new_tokens,
        max(len(prompts(p)) for p in problems),
        getattr(load_model_config(cfg.model.path), "max_position_embeddings", None),
    )
    return path, eval_requests(problems, prompts, cfg.eval.max_new_tokens)


def rollout_only_spec(cfg: ExperimentConfig) -> RolloutOnlySpec:
    """The workers of an evaluation: the rollout workers of ``cfg``'s job, without agent or
    trajectory spool (held-out evaluation is plain sampling), each with its share of the
    cores, and no trainer rank."""
    spec = cluster_spec(cfg)
    cores = cfg.threads or os.cpu_count() or 1
    rollout = dataclasses.replace(
        spec.rollout,
        agent=None,
        spool_dir=None,
        threads=cfg.launcher.rollout_threads or max(1, cores // cfg.rollout.num_workers),
    )
    return RolloutOnlySpec(
        **{
            **{f.name: getattr(spec, f.name) for f in dataclasses.fields(ClusterSpec)},
            "rollout": rollout,
            "workers_file": None,
        }
    )


def write_evaluation(
    cfg: ExperimentConfig, path: Path, records: list[dict], seconds: float
) -> dict:
    """Write the finished evaluation into ``path`` (``config.yaml``, ``eval.jsonl``,
    ``summary.json``); returns the summary (see :func:`run_evaluation`)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(to_yaml(cfg))
    correct = write_eval_records(path / EVAL_FILE, records)
    summary = {
        "accuracy": correct / max(len(records), 1),
        "correct": correct,
        "problems": len(records),
        "model_path": cfg.model.path,
        "task": cfg.data.task,
        "eval_split": cfg.data.eval_split,
        "eval_seed": cfg.data.eval_seed,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "rollout_workers": cfg.rollout.num_workers,
        "wall_seconds": seconds,
        "eval_dir": str(path),
    }
    (path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def accuracy_line(summary: dict) -> str:
    """``held-out accuracy: 38.5% (77/200) of model.path=..., data.task=..., greedy, ...``."""
    where = (
        f"{summary['eval_split']} split"
        if summary["task"] == "gsm8k"
        else f"data.eval_seed={summary['eval_seed']}"
    )
    return (
        f"held-out accuracy: {100 * summary['accuracy']:.1f}% ({summary['correct']}/"
        f"{summary['problems']}) of model.path={summary['model_path']} on "
        f"data.task={summary['task']} ({where}), greedy, "
        f"eval.max_new_tokens={summary['max_new_tokens']}"
    )
