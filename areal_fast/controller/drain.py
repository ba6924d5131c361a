"""Draining the rollout workers: the end of training and evaluation.

Both send every rollout worker one request (cancel its rollouts; evaluate these groups) and
then handle messages the one ordinary way (:meth:`AsyncController.handle`: finished groups,
acknowledged weights, saved checkpoints, cancellations, deaths and restarts) until every
worker has answered, with one deadline (:func:`drain`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError

if TYPE_CHECKING:
    from areal_fast.controller.async_loop import AsyncController


def drain(
    c: "AsyncController",
    done: Callable[[], bool],
    late: Callable[[], list[str]],
    seconds: float,
    error: Callable[[str], WorkerError],
    doing: str,
) -> None:
    """Handle every worker's messages until ``done()``.

    Raises
    ------
    WorkerError
        ``error(name)`` once ``seconds`` have passed while ``late()`` still names a worker;
        any deadline of :meth:`Recovery.check_deadlines`; a death with no restart left.
    """
    deadline = time.monotonic() + seconds
    while not done():
        names = late()
        if names and time.monotonic() > deadline:
            raise error(names[0])
        c.recovery.check_deadlines()  # a final checkpoint has its own deadline
        c.handle(c.wait(1.0, doing))


def wind_down(c: "AsyncController") -> None:
    """End training: cancel running rollouts, drop unused ones, let the evaluations during
    training finish (:class:`~areal_fast.controller.step_evals.StepEvals`), wait until every
    worker serves the final weights and the last checkpoint is saved. Each discarded group is
    counted with its reason (:meth:`Ledger.close`, :meth:`Ledger.cancelled`).

    Raises
    ------
    WorkerError
        A rollout worker did not cancel and load the final weights within
        ``timeouts.weight_update``, or an evaluation missed ``timeouts.evaluate`` (or another
        deadline passed).
    """
    c.ledger.close()
    c.free_released()
    c.cancelling = {w.name for w in c.workers}
    for worker in c.workers:
        c.send_rollout(worker, msg.CancelAll())
    # their deadline is Recovery.check_deadlines' (timeouts.evaluate)
    drain(c, lambda: not c.evals.running, list, 0.0, WorkerError, "while evaluating")
    seconds = c.timeouts.weight_update

    def late() -> list[str]:
        return sorted(c.cancelling) or [w.name for w in c.workers if c.acked[w.name] < c.version]

    drain(
        c,
        lambda: not late() and not c.saves.saving,
        late,
        seconds,
        lambda name: WorkerError(
            f"rollout worker {name!r} did not cancel its rollouts and load weights version "
            f"{c.version} within timeouts.weight_update = {seconds:g} s",
            name,
        ),
        "while winding down",
    )
    c.ledger.reopen()


def evaluate(c: "AsyncController", requests: list[msg.GroupRequest]) -> list[dict]:
    """Evaluation groups spread over the rollout workers; one record per request, in
    request order (see :meth:`AsyncController.evaluate`)."""
    if c.ledger.training or c.ledger.running:
        raise RuntimeError("evaluate() runs only before run() or after it has returned")
    c.eval_records = {}
    c.eval_assignment = {w.name: requests[i :: len(c.workers)] for i, w in enumerate(c.workers)}
    for worker in c.workers:
        c.send_rollout(worker, msg.Evaluate(c.eval_assignment[worker.name]))
    seconds = c.timeouts.evaluate

    def missing() -> list[str]:
        return [w.name for w in c.workers if w.name not in c.eval_records]

    drain(
        c,
        lambda: not missing(),
        missing,
        seconds,
        lambda name: WorkerError(
            f"rollout worker {name!r} did not finish evaluation within timeouts.evaluate = "
            f"{seconds:g} s"
        ),
        "during evaluation",
    )
    c.eval_assignment = {}
    order = {r.uid: i for i, r in enumerate(requests)}
    records = [r for recs in c.eval_records.values() for r in recs]
    return sorted(records, key=lambda r: order.get(r["uid"], 0))
