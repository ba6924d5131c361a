"""The held-out evaluations of an ``areal-fast sft`` run: before training (``eval.before``),
every ``eval.every_steps`` steps and after it (``eval.after``).

Each is the evaluation ``areal-fast train`` and ``areal-fast eval`` run: the held-out
problems of ``eval.data`` as greedy requests, answered by rollout workers started (without
a trainer) on the weights being evaluated, scored by the task's reward, one JSON line per
problem in ``eval_before.jsonl`` / ``eval_step_<k>.jsonl`` / ``eval_after.jsonl`` and the
same console lines. A supervised run has no rollout workers while it trains, so each
evaluation starts its own on a copy of the weights saved for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from areal_fast.controller.requests import ChatPrompts, eval_requests
from areal_fast.launch import console
from areal_fast.launch.evaluation import evaluate_on, rollout_only_spec
from areal_fast.launch.held_out import accuracy, read_records
from areal_fast.launch.inputs import load_eval_set
from areal_fast.launch.run_dir import write_eval_records
from areal_fast.launch.sft_config import SftConfig
from areal_fast.launch.worker_specs import check_reward, make_cluster

SNAPSHOT_DIR = ".eval_model"  # weights saved for an evaluation during training, then removed


def eval_due(cfg: SftConfig, step: int) -> bool:
    """Whether the weights of step ``step`` are evaluated during training
    (``eval.every_steps``)."""
    every = cfg.eval.every_steps
    return every > 0 and step > 0 and step % every == 0


class SftEvals:
    """The held-out set of a supervised run and the accuracies measured on it.

    Built before anything is written: a bad ``eval.data`` or reward fails here.

    Parameters
    ----------
    cfg : SftConfig
        ``eval.*`` (``eval.data``: the problems), ``model.*``, ``seed``, ``threads``.
    tokenizer
        The model's tokenizer (the prompts' chat template).

    Attributes
    ----------
    accuracy : dict[int, float]
        Step -> held-out accuracy of the evaluations during training.
    before, after : float or None
        The accuracies before and after training (None: not evaluated).
    problems : int
        Held-out problems (0 when no evaluation is on).
    """

    def __init__(self, cfg: SftConfig, tokenizer):
        self.cfg = cfg
        self.accuracy: dict[int, float] = {}
        self.before: Optional[float] = None
        self.after: Optional[float] = None
        self.requests: list = []
        if cfg.eval.enabled:
            ecfg = cfg.eval_experiment(cfg.model.path)
            check_reward(ecfg)
            problems = load_eval_set(ecfg)
            prompts = ChatPrompts(tokenizer, ecfg.data.instruction)
            self.requests = eval_requests(problems, prompts, cfg.eval.max_new_tokens)
        self.problems = len(self.requests)

    def run(self, model_path: str, path: Path, when: str) -> float:
        """Evaluate the model at ``model_path`` on rollout workers started for it; writes
        the records to ``path`` and prints the two console lines; returns the accuracy.

        Raises
        ------
        WorkerError
            A rollout worker failed, died or missed ``launcher.timeouts.evaluate``.
        """
        ecfg = self.cfg.eval_experiment(model_path)
        workers = ecfg.rollout.num_workers
        tokens = self.cfg.eval.max_new_tokens
        console.say(console.eval_started(when, len(self.requests), workers, tokens))
        t0 = time.perf_counter()
        with make_cluster(ecfg, rollout_only_spec(ecfg)) as cluster:
            records = evaluate_on(
                cluster.rollout_workers, self.requests, ecfg.launcher.timeouts.evaluate
            )
        right = write_eval_records(path, records)
        console.say(console.eval_finished(when, right, len(records), time.perf_counter() - t0))
        return accuracy(records)

    def evaluate_before(self, run_dir: Path, resumed: bool) -> None:
        """``eval.before`` on the starting model, or the result a resumed run measured."""
        path = run_dir / "eval_before.jsonl"
        if not self.cfg.eval.before:
            return
        if resumed and path.is_file():
            records = read_records(path)
            self.before = accuracy(records)
            return
        self.before = self.run(self.cfg.model.path, path, "before training")

    def keep_until(self, run_dir: Path, step: int) -> None:
        """A run resumed at ``step``: keep the evaluations of steps up to it, delete later
        ones (those steps are trained again)."""
        for path in run_dir.glob("eval_step_*.jsonl"):
            suffix = path.stem.rsplit("_", 1)[1]
            if not suffix.isdigit():
                continue
            if int(suffix) > step:
                path.unlink()
                continue
            try:
                self.accuracy[int(suffix)] = accuracy(read_records(path))
            except ValueError:
                path.unlink()

    def summary(self) -> dict:
        """The summary's held-out keys: ``eval_problems``, ``eval_before``,
        ``eval_accuracy_by_step``, ``eval_after`` (each when measured)."""
        out: dict = {"eval_problems": self.problems} if self.problems else {}
        if self.before is not None:
            out["eval_before"] = self.before
        if self.accuracy:
            out["eval_accuracy_by_step"] = {str(k): v for k, v in sorted(self.accuracy.items())}
        if self.after is not None:
            out["eval_after"] = self.after
        return out
