"""What the controller is told: worker deadlines (``launcher.timeouts.*``), recoverable
checkpoints (``checkpoint.*``), recovery (``recovery.*``) and how long it trains
(:class:`RunPlan`, from the top-level keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from areal_fast._checks import at_least


@dataclass
class Timeouts:
    """Seconds before the controller gives up on a worker (each error names the worker)."""

    train_step: float = 3600.0  # one TrainStep, fetch to publish
    weight_update: float = 600.0  # a rollout worker acknowledging new weights
    rollout_stall: float = 1800.0  # no rollout finished while some are running
    evaluate: float = 3600.0  # one held-out evaluation, over all rollout workers

    def __post_init__(self):
        for name in ("train_step", "weight_update", "rollout_stall", "evaluate"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} = {value} must be a finite number > 0")


@dataclass
class CheckpointConfig:
    """Recoverable checkpoints (trainer + controller state) under ``<run dir>/checkpoints``,
    and the trained model written at the end under ``<run dir>/checkpoint``."""

    every_steps: int = 0  # save after every this many steps (0: off); the last step too
    keep: int = 2  # complete checkpoints kept
    # write the trained model (HF format, the trainer's dtype: 4 bytes per parameter in
    # float32, about 517 MB for SmolLM2-135M) to <run dir>/checkpoint at the end; false for
    # trial runs that need only the metrics and held-out accuracies
    final_model: bool = True

    def __post_init__(self):
        at_least("every_steps", self.every_steps, 0)
        at_least("keep", self.keep, 1)


@dataclass
class RecoveryConfig:
    """What the job survives without a person."""

    max_rollout_restarts: int = 3  # dead rollout workers replaced before the run fails
    # a dead or failed trainer rank: the job restarts from the last checkpoint this often
    max_trainer_restarts: int = 2
    # keep every finished group also on disk (<run dir>/shards) until trained, so a rollout
    # worker's death loses no accepted rollout
    spool_shards: bool = True

    def __post_init__(self):
        at_least("max_rollout_restarts", self.max_rollout_restarts, 0)
        at_least("max_trainer_restarts", self.max_trainer_restarts, 0)


@dataclass
class RunPlan:
    """How long the controller trains and what ends a run early (everything else comes
    from the component configs: ``RolloutConfig``, ``RecoveryConfig``, ``Timeouts``).

    Attributes
    ----------
    total_steps : int
    batch_size : int
        B, prompt groups per training step.
    max_seconds : float or None
        No batch is sent after this much training time (batches in flight finish).
    max_filtered_in_a_row : int
        With ``rollout.dynamic_filter``, this many groups dropped in a row (all rewards
        equal) end the run with a ValueError instead of sampling forever.
    max_failed_agent_groups_in_a_row : int
        Agent groups in a row with every session dropped before the run fails.
    max_reward_drops_in_a_row : int
        Groups in a row dropped because their reward failed before the run fails.
    """

    total_steps: int
    batch_size: int
    max_seconds: Optional[float] = None
    max_filtered_in_a_row: int = 1000
    max_failed_agent_groups_in_a_row: int = 32
    max_reward_drops_in_a_row: int = 32
