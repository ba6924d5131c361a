"""The per-step metrics record (one line of ``metrics.jsonl``) and what every key means.

:data:`STEP_METRICS` is the list of keys with their meaning; :func:`step_record` builds the
record after each training step. Throughputs say what they divide: ``train_tokens_per_s`` is
this step's training speed, the ``*_cumulative`` ones are totals over wall time since the
controller started.
"""

from __future__ import annotations

import collections
import statistics

from areal_fast.controller.ledger import Ledger, TrainingBatch
from areal_fast.wire import messages as msg

STEP_METRICS: dict[str, str] = {
    # which step
    "step": "training step (1, 2, ...) = the policy version it produced (rollout workers "
    "load it next)",
    # the batch's rollouts
    "reward_mean": "mean reward over the batch's samples",
    "accuracy": "fraction of the batch's samples with reward 1",
    "solve_rate": "fraction of the batch's prompt groups with at least one sample of reward 1",
    "zero_adv_group_fraction": "fraction of groups whose rewards are all equal (no gradient)",
    "response_length_mean": "mean completion length of the batch's samples, tokens",
    "response_length_max": "longest completion of the batch, tokens",
    "truncated_fraction": "fraction of samples stopped by rollout.max_new_tokens",
    "sample_interruptions": "weight updates that reached the batch's samples mid-generation (aborted and resumed, or a kept pause's version seam)",
    # the trainer (TorchTrainEngine.train_step and the trainer worker)
    "loss": "policy loss, mean over the step's minibatches",
    "grad_norm": "global gradient norm before clipping, mean over the minibatches",
    "lr": "learning rate, mean over the step's optimizer updates",
    "num_micro_batches": "micro-batches of the step (all minibatches together)",
    "num_minibatches": "optimizer updates of the step",
    "staleness_mean": "mean over trained tokens of (trainer version - generating version)",
    "staleness_max": "largest (trainer version - generating version) of the step",
    "staleness_hist": "trained tokens per staleness 0, 1, 2, ... (list)",
    "behav_logprob_abs_diff": "mean |trainer - engine| log-prob of the trained tokens",
    "behav_weight_mean": "decoupled PPO: mean behaviour importance weight",
    "behav_weight_masked_fraction": "decoupled PPO: fraction of tokens over behav_weight_cap",
    "entropy_mean / clip_fraction / ratio_mean / approx_kl": "loss statistics of "
    "rl.objectives.grpo_loss (means over trained tokens; clip_fraction: clipped, or masked "
    "out by M2PO)",
    "rejected_fraction": "trained tokens whose weight IcePop or sequence rejection set to 0 "
    "(only with actor.loss.icepop or actor.loss.seq_rejection)",
    "kl": "KL to the reference policy, mean over trained tokens (only with actor.loss.kl_coef > 0)",
    "distill_kl": "on-policy distillation: reverse KL (student - teacher log-prob of the "
    "sampled tokens), mean over trained tokens (only with actor.distill.teacher_path)",
    "trainable_parameters": "parameter elements the optimizer updates (actor.lora: the adapters')",
    "weight_update_bytes": "bytes of one published weight version (actor.lora: the adapter's)",
    "trainer_peak_rss_mb": "trainer rank 0's peak resident memory so far (getrusage), MiB",
    "fetch_wait_seconds": "trainer waiting for the batch's shards after the step began, s",
    "train_threads_mean": "trainer rank 0's torch threads, time-weighted mean over "
    "train_seconds (launcher.share_cores: all cores while the rollout workers are idle)",
    # tokens and speed
    "trained_tokens": "completion tokens trained in this step (loss mask, every trainer rank)",
    "train_tokens_per_s": "this step: batch tokens (prompt + completion) / train_seconds",
    "trained_tokens_per_s_cumulative": "completion tokens trained since the controller started / wall seconds since then",
    "gen_tokens_per_s_cumulative": "completion tokens generated since the controller started / wall seconds since then",
    # time
    "fetch_seconds": "trainer fetching the batch's shards from the rollout workers, s",
    "train_seconds": "trainer forward, backward and optimizer updates, s",
    "publish_seconds": "trainer writing the new weights for the rollout workers, s",
    "trainer_wait_seconds": "from the previous step's end until this batch was sent, s",
    "step_seconds": "wall seconds since the previous step's record",
    "elapsed_seconds": "training wall seconds of the run (a resumed run continues them)",
    # the rollout ledger now
    "rollouts_running": "prompt groups running (or waiting for a worker) now",
    "rollouts_ready": "finished prompt groups waiting for a batch now",
    "rollouts_dropped_total": "prompt groups dropped so far, every reason together",
    # held-out evaluation during training (eval.every_steps) only
    "eval_accuracy": "held-out greedy accuracy (fraction) of the weights of step eval_step; "
    "only in the first record written after that evaluation finished, as it runs beside "
    "training (one that finishes after the last record, e.g. the last step's, is in no "
    "record: summary.json's eval_accuracy_by_step holds every one)",
    "eval_step": "the step (policy version) whose weights eval_accuracy measured, <= step",
    # agent workloads only
    "agent/* and trajectory/*": "agent session and trajectory-store totals over the rollout "
    "workers (trajectory/compression_ratio from summed bytes)",
}

# keys of the trainer's stats that repeat a record key under another name
_TRAINER_DUPLICATES = ("version",)  # = step


def step_record(
    batch: TrainingBatch,
    done: msg.StepDone,
    ledger: Ledger,
    *,
    trained_tokens: int,
    since_start: float,
    since_last_step: float,
    trainer_wait: float,
    elapsed: float,
    agent_stats: dict,
) -> dict:
    """The metrics record of one step (keys: :data:`STEP_METRICS`).

    Parameters
    ----------
    batch : TrainingBatch
        The groups the step trained (each with its :class:`GroupDone`).
    done : StepDone
        The trainer's report.
    ledger : Ledger
        For the rollout counts now and the generated tokens so far.
    trained_tokens : int
        Completion tokens trained since the controller started, this step included.
    since_start, since_last_step, trainer_wait, elapsed : float
        Seconds: since the controller started, since the previous record, from the previous
        step until the batch was sent, and the run's training time.
    agent_stats : dict
        Per rollout worker, its latest agent running totals.
    """
    groups = [g.done for g in batch.groups]
    rewards = [r for g in groups for r in g.rewards]
    lengths = [n for g in groups for n in g.completion_lengths]
    trainer = {k: v for k, v in done.stats.items() if k not in _TRAINER_DUPLICATES}
    return {
        "step": done.version,
        "reward_mean": statistics.fmean(rewards),
        "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        "solve_rate": sum(max(g.rewards) == 1.0 for g in groups) / len(groups),
        "zero_adv_group_fraction": sum(len(set(g.rewards)) == 1 for g in groups) / len(groups),
        "response_length_mean": statistics.fmean(lengths),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": sum(r == "length" for g in groups for r in g.stop_reasons)
        / len(rewards),
        "sample_interruptions": sum(g.interruptions for g in groups),
        **trainer,
        "trained_tokens": done.trained_tokens,
        "train_tokens_per_s": sum(g.shard.num_tokens for g in groups)
        / max(done.train_seconds, 1e-9),
        "trained_tokens_per_s_cumulative": trained_tokens / since_start,
        "gen_tokens_per_s_cumulative": ledger.generated_tokens / since_start,
        "fetch_seconds": done.fetch_seconds,
        "train_seconds": done.train_seconds,
        "publish_seconds": done.publish_seconds,
        "trainer_wait_seconds": trainer_wait,
        "step_seconds": since_last_step,
        "elapsed_seconds": elapsed,
        "rollouts_running": ledger.running,
        "rollouts_ready": ledger.num_ready,
        "rollouts_dropped_total": sum(ledger.counts.dropped.values()),
        **agent_totals(agent_stats),
    }


def agent_totals(agent_stats: dict) -> dict:
    """Agent sessions and trajectory-store counters, summed over the rollout workers
    (``agent_stats``: per worker, its running totals); the store's compression ratio is
    recomputed from the summed byte counts."""
    totals: dict = collections.Counter()
    for stats in agent_stats.values():
        totals.update(stats)
    if "trajectory/compression_ratio" in totals:
        stored = totals.get("trajectory/stored_bytes", 0)
        totals["trajectory/compression_ratio"] = (
            totals.get("trajectory/raw_bytes", 0) / stored if stored else 0.0
        )
    return dict(totals)
