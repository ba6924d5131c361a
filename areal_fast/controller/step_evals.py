"""Held-out evaluation during training (``eval.every_steps``).

After every k-th step the controller sends each rollout worker its share of the held-out
requests right behind that step's weights (:class:`~areal_fast.wire.messages.Evaluate`
with ``version`` k). A worker runs them on exactly those weights: newer versions wait on the
worker until its share is done (:meth:`WorkerWeights.evaluate_at`), while the training
rollouts it already runs go on beside them. The trainer goes on as the staleness bound and
its weight slots allow (a version may be written only once every worker serves the one
n slots before it, n = 2 unless a reproducible run keeps more), so training waits for an
evaluation only where it needs the workers to load newer weights. Evaluations of later steps
queue behind the running one, each on its own version. When every worker has answered, ``on_done`` receives the records and the accuracy
goes into the next step record (``eval_accuracy``, ``eval_step``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from areal_fast.controller.fleet import RolloutFleet
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError

log = logging.getLogger("areal_fast.controller")


@dataclass
class _Eval:
    version: int
    parts: dict[str, list[msg.GroupRequest]]  # worker -> its requests
    sent: float  # time.monotonic() of the Evaluate messages
    records: dict[str, list[dict]] = field(default_factory=dict)  # worker -> its answer
    served: dict[str, int] = field(default_factory=dict)  # worker -> version it ran on


class StepEvals:
    """The evaluations of training steps: which are due, which run, what they found.

    Parameters
    ----------
    every_steps : int
        Evaluate the weights of every step ``k`` with ``k % every_steps == 0`` (0: never).
    requests : list[GroupRequest]
        The held-out set (greedy, n = 1), spread over the workers in their order (worker
        ``i`` of ``n`` gets requests ``i, i + n, ...``).
    on_done : callable (version, records, seconds) -> None
        Called once per finished evaluation with its records (uid, answer, completion,
        correct, reward; in request order) and the seconds from its start to its end.
    timeout : float
        ``launcher.timeouts.evaluate``: seconds one evaluation may take, counted from when it
        was sent or, if it queued, from when the one before it finished.

    Attributes
    ----------
    accuracy : dict[int, float]
        Version -> held-out accuracy (fraction in [0, 1]) of every finished evaluation.
    seconds : dict[int, float]
        Version -> seconds from sending that evaluation until its last answer (a queued one
        includes its wait), for the evaluations of this run (not those read after a resume).
    """

    def __init__(
        self,
        every_steps: int = 0,
        requests: Optional[list[msg.GroupRequest]] = None,
        on_done: Optional[Callable[[int, list[dict], float], None]] = None,
        timeout: float = 3600.0,
    ):
        self.every_steps, self.requests = every_steps, list(requests or [])
        self.on_done, self.timeout = on_done, timeout
        self.accuracy: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.running: list[_Eval] = []  # oldest first
        self._clock = 0.0  # when the oldest running evaluation became the oldest
        self._answered: dict[str, float] = {}  # worker -> when it last answered one
        self._latest: Optional[int] = None  # finished, not yet in a step record

    def due(self, version: int) -> bool:
        """Whether the weights of step ``version`` are to be evaluated."""
        every = self.every_steps
        return bool(every and self.requests) and version > 0 and version % every == 0

    def after_step(self, version: int, record: dict, fleet: RolloutFleet) -> dict:
        """Called once step ``version``'s weights were sent to ``fleet``: start its evaluation
        if due; returns ``record`` with ``eval_accuracy`` and ``eval_step`` of the newest
        evaluation finished since the previous record, if any."""
        if self.due(version):
            self.start(version, fleet)
        if self._latest is None:
            return record
        version, self._latest = self._latest, None
        return {**record, "eval_accuracy": self.accuracy[version], "eval_step": version}

    def start(self, version: int, fleet: RolloutFleet) -> None:
        """Send every rollout worker of ``fleet`` its share of the held-out set, on weights
        ``version``."""
        workers = fleet.workers
        parts = {w.name: self.requests[i :: len(workers)] for i, w in enumerate(workers)}
        if not self.running:
            self._clock = time.monotonic()
        self.running.append(_Eval(version, parts, time.monotonic()))
        for worker in workers:
            fleet.send(worker, msg.Evaluate(parts[worker.name], version))

    def on_eval_done(self, worker: str, done: msg.EvalDone) -> None:
        """A worker's :class:`EvalDone` for one of these evaluations (``done.version``: the
        evaluated step; an evaluation outside training is :class:`~.drain.Drain`'s).

        Raises
        ------
        WorkerError
            No running evaluation of ``done.version`` asked ``worker`` for an answer.
        """
        now = time.monotonic()
        self._answered[worker] = now
        run = next((e for e in self.running if e.version == done.version), None)
        if run is None or worker not in run.parts:
            raise WorkerError(
                f"rollout worker {worker!r} answered an evaluation of version {done.version} "
                f"that was not asked of it",
                worker,
            )
        run.records[worker], run.served[worker] = done.records, done.served
        if len(run.records) < len(run.parts):
            return
        if run is self.running[0]:  # the next one's deadline counts from now
            self._clock = now
        self.running.remove(run)
        other = sorted({v for v in run.served.values() if v != run.version})
        if other:  # a restarted worker, or weights that came over a link first
            log.warning(
                "the evaluation of step %d ran partly on weights version(s) %s",
                run.version,
                other,
            )
        order = {r.uid: i for i, r in enumerate(self.requests)}
        records = sorted(
            (r for part in run.records.values() for r in part),
            key=lambda r: order.get(r["uid"], 0),
        )
        self.accuracy[run.version] = sum(r["correct"] for r in records) / max(len(records), 1)
        self.seconds[run.version] = now - run.sent
        self._latest = run.version
        if self.on_done is not None:
            self.on_done(run.version, records, now - run.sent)

    def evaluating(self, worker: str) -> bool:
        """Whether ``worker`` owes an answer to a running evaluation."""
        return any(worker in e.parts and worker not in e.records for e in self.running)

    def excused(self, worker: str, now: float, seconds: float) -> bool:
        """Whether ``worker`` may still be behind on weights because of an evaluation: it
        owes one, or answered one less than ``seconds`` ago (newer versions waited for it)."""
        return self.evaluating(worker) or now - self._answered.get(worker, -seconds) < seconds

    def check_deadline(self, now: float) -> None:
        """Raise a :class:`WorkerError` naming the first worker that has not answered the
        oldest running evaluation within ``timeout``."""
        if self.running and now - max(self._clock, self.running[0].sent) > self.timeout:
            oldest = self.running[0]
            name = next(n for n in oldest.parts if n not in oldest.records)
            raise WorkerError(
                f"rollout worker {name!r} did not finish the evaluation of step "
                f"{oldest.version} within launcher.timeouts.evaluate = {self.timeout:g} s",
                name,
            )

    def owed(self, worker: str) -> list[msg.Evaluate]:
        """What a restarted ``worker`` is to be sent again: its share of every running
        evaluation it had not answered, oldest first (it runs them on the weights it serves
        then, reported in its answers)."""
        return [
            msg.Evaluate(run.parts[worker], run.version)
            for run in self.running
            if worker in run.parts and worker not in run.records
        ]
