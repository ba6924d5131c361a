"""Draining the rollout workers: the end of training, and evaluations outside training.

Both send every rollout worker one request (cancel its rollouts; evaluate its share of these
groups) and then run the controller's ordinary message handling (``pump``: deadlines,
finished groups, acknowledged weights, saved checkpoints, cancellations, deaths and restarts)
until every worker has answered, with one deadline (:meth:`Drain.until`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Callable

from areal_fast.controller.checkpoint_manager import PendingSaves
from areal_fast.controller.config import Timeouts
from areal_fast.controller.fleet import RolloutFleet
from areal_fast.controller.ledger import Ledger
from areal_fast.controller.step_evals import StepEvals
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError


class Drain:
    """The two drains of the rollout workers, and the state of an evaluation outside training.

    Parameters
    ----------
    ledger : Ledger
        Closed while training winds down (no group is submitted, finished ones are
        discarded with their reason) and reopened after.
    fleet : RolloutFleet
        The workers that get the cancel and the evaluation shares.
    pump : callable (doing) -> None
        One round of the controller's message handling: check the deadlines, wait up to 1 s
        for messages and act on each (``doing`` says what the wait is for, in errors).
    timeouts : Timeouts
        ``weight_update`` and ``evaluate`` are used.

    Attributes
    ----------
    shares : dict[str, list[GroupRequest]]
        Worker → its share of the evaluation running now (empty when none runs).
    records : dict[str, list[dict]]
        Worker → the records it answered for that evaluation.
    """

    def __init__(
        self,
        ledger: Ledger,
        fleet: RolloutFleet,
        pump: Callable[[str], None],
        timeouts: Timeouts,
    ):
        self.ledger, self.fleet, self.pump, self.timeouts = ledger, fleet, pump, timeouts
        self.shares: dict[str, list[msg.GroupRequest]] = {}
        self.records: dict[str, list[dict]] = {}

    def until(
        self,
        done: Callable[[], bool],
        late: Callable[[], list[str]],
        seconds: float,
        error: Callable[[str], WorkerError],
        doing: str,
    ) -> None:
        """Run ``pump(doing)`` until ``done()``.

        Raises
        ------
        WorkerError
            ``error(name)`` once ``seconds`` have passed while ``late()`` still names a worker;
            whatever ``pump`` raises (a deadline, a death with no restart left).
        """
        deadline = time.monotonic() + seconds
        while not done():
            names = late()
            if names and time.monotonic() > deadline:
                raise error(names[0])
            self.pump(doing)

    def wind_down(
        self, version: int, acked: Mapping[str, int], evals: StepEvals, saves: PendingSaves
    ) -> None:
        """End training at policy ``version``: cancel running rollouts, drop unused ones, let
        the evaluations during training finish, wait until every worker serves ``version``
        (``acked``: worker → the version it serves, kept current by ``pump``) and the last
        checkpoint is saved. Each discarded group is counted with its reason
        (:meth:`Ledger.close`, :meth:`Ledger.cancelled`).

        Raises
        ------
        WorkerError
            A rollout worker did not cancel and load the final weights within
            ``timeouts.weight_update``, or an evaluation missed ``timeouts.evaluate`` (or
            another deadline passed).
        """
        self.ledger.close()
        self.fleet.drop_shards(r.done for r in self.ledger.pop_released())
        self.fleet.cancel_all()
        # their deadline is the pump's (timeouts.evaluate)
        self.until(lambda: not evals.running, list, 0.0, WorkerError, "while evaluating")
        seconds = self.timeouts.weight_update

        def late() -> list[str]:
            cancelling = sorted(self.fleet.cancelling)
            return cancelling or [name for name in self.fleet.names if acked[name] < version]

        self.until(
            lambda: not late() and not saves.saving,
            late,
            seconds,
            lambda name: WorkerError(
                f"rollout worker {name!r} did not cancel its rollouts and load weights version "
                f"{version} within timeouts.weight_update = {seconds:g} s",
                name,
            ),
            "while winding down",
        )
        self.ledger.reopen()

    def evaluate(self, requests: list[msg.GroupRequest]) -> list[dict]:
        """Run evaluation groups (greedy, n=1) spread over the rollout workers (worker ``i``
        of ``n`` gets requests ``i, i + n, ...``); returns one record per request (uid,
        answer, completion, correct, reward), in request order.

        Raises
        ------
        WorkerError
            A worker died or did not finish within ``timeouts.evaluate``.
        RuntimeError
            Called while groups are running or in training.
        """
        if self.ledger.training or self.ledger.running:
            raise RuntimeError("evaluate() runs only before run() or after it has returned")
        workers = self.fleet.workers
        self.records = {}
        self.shares = {w.name: requests[i :: len(workers)] for i, w in enumerate(workers)}
        for worker in workers:
            self.fleet.send(worker, msg.Evaluate(self.shares[worker.name]))
        seconds = self.timeouts.evaluate

        def missing() -> list[str]:
            return [name for name in self.fleet.names if name not in self.records]

        self.until(
            lambda: not missing(),
            missing,
            seconds,
            lambda name: WorkerError(
                f"rollout worker {name!r} did not finish evaluation within timeouts.evaluate = "
                f"{seconds:g} s"
            ),
            "during evaluation",
        )
        self.shares = {}
        order = {r.uid: i for i, r in enumerate(requests)}
        records = [r for recs in self.records.values() for r in recs]
        return sorted(records, key=lambda r: order.get(r["uid"], 0))

    def answered(self, worker: str, records: list[dict]) -> None:
        """``worker`` answered the evaluation outside training (an :class:`EvalDone` without
        a version) with ``records``."""
        self.records[worker] = records

    def owed(self, worker: str) -> list[msg.Evaluate]:
        """What a restarted ``worker`` is to be sent again: its share of the evaluation
        running now, if it had not answered (else nothing)."""
        if worker in self.shares and worker not in self.records:
            return [msg.Evaluate(self.shares[worker])]
        return []
