"""Which finished groups are kept for training besides staleness: the dynamic filter (DAPO,
Yu et al. 2025: a group whose rewards are all equal gives no GRPO gradient) and agent groups
whose every session was dropped, or whose reward failed; too many such drops in a row end the run with a ValueError
instead of sampling forever."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_fast.wire import messages as msg

# what to check for an agent drop reason (the start of the error)
_AGENT_HINTS = {
    "timeout": "check agent.timeout (and that the agent does not block the event loop)",
    "bad_reward": "run_agent_return_reward must return a finite number",
    "no_calls": "the agent must call the model through its client",
    "agent_error": "the agent raised: its log lines name the error",
}


@dataclass
class Acceptance:
    """Drop reasons of finished groups, with the counts of drops in a row.

    Attributes
    ----------
    dynamic_filter : bool
        ``rollout.dynamic_filter``.
    max_filtered_in_a_row, max_failed_agent_groups_in_a_row, max_reward_drops_in_a_row : int
        The limits of :class:`~areal_fast.controller.config.RunPlan`.
    """

    dynamic_filter: bool
    max_filtered_in_a_row: int
    max_failed_agent_groups_in_a_row: int
    max_reward_drops_in_a_row: int = 32
    filtered_in_a_row: int = 0
    failed_in_a_row: int = 0  # agent groups in a row whose sessions were all dropped
    reward_drops_in_a_row: int = 0  # groups in a row the worker dropped (failed rewards)

    @classmethod
    def from_plan(cls, dynamic_filter: bool, plan) -> "Acceptance":
        """The acceptance of a run: ``rollout.dynamic_filter`` and the limits of ``plan`` (a
        :class:`~areal_fast.controller.config.RunPlan`)."""
        return cls(
            dynamic_filter,
            plan.max_filtered_in_a_row,
            plan.max_failed_agent_groups_in_a_row,
            plan.max_reward_drops_in_a_row,
        )

    def drop_reason(self, done: msg.GroupDone, stale: bool) -> Optional[str]:
        """The ledger's drop reason of ``done`` (None: keep it); ``stale``: it would be
        trained more than η versions after it started.

        Raises
        ------
        ValueError
            ``max_failed_agent_groups_in_a_row`` agent groups in a row lost every session, or
            ``max_reward_drops_in_a_row`` groups in a row were dropped by a failed reward.
        """
        if done.drop_reason:  # the worker dropped it: its reward failed
            self.reward_drops_in_a_row += 1
            if self.reward_drops_in_a_row >= self.max_reward_drops_in_a_row:
                first = done.errors[0] if done.errors else "no reason given"
                raise ValueError(
                    f"reward: the last {self.reward_drops_in_a_row} groups were all dropped "
                    f"({done.drop_reason}: {first}); check reward.path and reward.timeout, "
                    "or set reward.on_error=zero"
                )
            return done.drop_reason
        self.reward_drops_in_a_row = 0
        filtered = self.dynamic_filter and len(set(done.rewards)) == 1
        self.filtered_in_a_row = self.filtered_in_a_row + 1 if filtered else 0
        self.failed_in_a_row = self.failed_in_a_row + 1 if done.shard is None else 0
        if done.shard is None and self.failed_in_a_row >= self.max_failed_agent_groups_in_a_row:
            first = done.errors[0] if done.errors else "no reason given"
            hint = _AGENT_HINTS.get(first.split(":", 1)[0], "check agent.path")
            raise ValueError(
                f"agent: every session of the last {self.failed_in_a_row} "
                f"groups was dropped (e.g. {first}); {hint}"
            )
        if done.shard is None:
            return "agent_sessions_dropped"
        return "dynamic_filter" if filtered else "stale" if stale else None

    def check_filter_limit(self) -> None:
        """Raise ``ValueError`` once more than ``max_filtered_in_a_row`` groups in a row
        were dropped by the dynamic filter (no batch could be filled)."""
        if self.filtered_in_a_row > self.max_filtered_in_a_row:
            raise ValueError(
                f"rollout.dynamic_filter: the last {self.filtered_in_a_row} "
                f"groups all had equal rewards and were dropped, so no batch can "
                f"be filled; check the reward function or turn the filter off"
            )
