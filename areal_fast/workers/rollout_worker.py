"""Rollout worker process: runs GRPO groups on a request-level engine, keeps the results.

The worker owns an :class:`~areal_fast.rollout.engine.AsyncInferenceEngine`, a
:class:`~areal_fast.wire.shards.ShardStore` (finished groups stay here until a trainer
fetches them) and the group bookkeeping. On a weight update it pauses the engine (running
samples come back aborted with their partial tokens), installs the new weights, resumes,
and resubmits every aborted sample as prompt + partial with the remaining budget: log-probs
and versions stay per token across the seam, and no sample is lost or duplicated.

With an agent in its spec, training groups run as agent sessions instead
(:class:`~areal_fast.agent.workload.AgentWorkload`): the sessions' model calls share the
engine with the plain samples (held-out evaluation stays plain), and aborted calls are
resumed the same way.

A finished group is scored by ``spec.reward_fn`` on the main thread (the built-in math reward:
cheap), or, with ``reward.path`` set, by a :class:`~areal_fast.workers.reward_pool.RewardPool`
whose result comes back through the inbox like every other event, so a slow reward never
delays a weight update.

The main thread owns the agent groups handed to the workload and not reported: :class:`CancelAll`
counts and forgets them, so a group ending after the cancel is not reported (it was cancelled).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from areal_fast.data.user_reward import RewardConfig
from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import GenOutput, GenRequest, sample_seed
from areal_fast.sync.config import SyncConfig
from areal_fast.wire import messages as msg
from areal_fast.wire.shard_io import shard_tensors
from areal_fast.wire.shards import ShardMetadata, ShardStore, tensor_metadata
from areal_fast.workers.core_hooks import CoreShareSpec, rollout_cores
from areal_fast.workers.reward_pool import GroupScores, RewardPool
from areal_fast.workers.rollout_groups import (
    Group,
    Sample,
    eval_record,
    group_done,
    sample_dicts,
)
from areal_fast.workers.rollout_weights import PAUSE_TIMEOUT_S, WorkerWeights

FLUSH_TIMEOUT_S = 300.0  # trajectory store: writing out what is queued when training ends
log = logging.getLogger("areal_fast.rollout_worker")


@dataclass
class RolloutWorkerSpec:
    """How to build a rollout worker's parts inside its process (picklable).

    Attributes
    ----------
    engine_factory : callable () -> (engine, decode)
        Builds the :class:`AsyncInferenceEngine` and a ``decode(token_ids) -> str``. A
        factory with a ``for_worker(name)`` method is first specialised to the worker.
    reward_fn : callable (completion_text, answer) -> float
        Module-level function (pickled by reference), called on the main thread; used when
        ``reward`` names no ``path``.
    threads : int, optional
        torch CPU threads of this process.
    cores : CoreShareSpec, optional
        Its slot of the node's core table (``launcher.share_cores``, :mod:`.core_share`).
    agent : AgentWorkloadSpec, optional
        Run training groups as agent sessions (see :mod:`areal_fast.agent.workload`).
    spool_dir : str, optional
        Also write each finished group's shard to ``<spool_dir>/<worker name>/``, so that a
        trainer still gets it if this worker dies before the shard is fetched.
    host : str
        Address the shard server binds; a :class:`~areal_fast.launch.cluster.ClusterSpec`
        starts every rollout worker with its ``scheduler.bind_host`` here (on Ray: the
        node's IP unless that is set).
    sync : SyncConfig
        ``sync.checksum``: report a CRC-32 of every installed weights version.
    reward : RewardConfig, optional
        ``reward.*``: with ``reward.path`` set, groups are scored by that function in a
        :class:`~areal_fast.workers.reward_pool.RewardPool` (the worker loads it by path).
    """

    engine_factory: Callable
    reward_fn: Callable
    threads: Optional[int] = None
    cores: Optional[CoreShareSpec] = None
    agent: Optional[object] = None
    spool_dir: Optional[str] = None
    host: str = "127.0.0.1"
    sync: SyncConfig = field(default_factory=SyncConfig)
    reward: Optional[RewardConfig] = None


class RolloutWorker:
    """The worker's state and message handlers (its process runs :func:`rollout_worker_main`)."""

    def __init__(self, name: str, conn, spec: RolloutWorkerSpec, authkey: bytes):
        self.name, self.conn, self.spec = name, conn, spec
        factory = getattr(spec.engine_factory, "for_worker", lambda _: spec.engine_factory)
        self.engine, self.decode = factory(name)()  # for_worker: e.g. a server URL each
        spool = str(Path(spec.spool_dir) / name) if spec.spool_dir else None
        self.store = ShardStore(authkey, spec.host, spool)
        self.inbox: queue.Queue = queue.Queue()
        self.groups: dict[int, Group] = {}
        self.scoring: dict[int, tuple[Group, list[str]]] = {}  # with the reward pool
        self.running: dict[int, Sample] = {}
        self.eval_records, self.eval_pending, self.eval_of = None, 0, None
        self.weights = WorkerWeights(self.engine, conn, self.inbox.put, spec.host, spec.sync)
        self.rids = itertools.count()
        self.stopped = False
        use_pool = spec.reward is not None and spec.reward.path is not None
        self.rewards = RewardPool(spec.reward, self.inbox.put) if use_pool else None
        self.agent = None
        self.agent_groups: set[int] = set()  # handed to the agent, not reported or cancelled
        self.agent_resumed = 0  # the agent's resumed calls already reported in a GroupDone
        if spec.agent is not None:
            from areal_fast.agent.workload import AgentWorkload

            self.agent = AgentWorkload(
                spec.agent,
                self.engine,
                self.rids,
                name,
                lambda group: self.inbox.put(("agent_group", group)),
            )

    def run(self) -> None:
        """Serve until :class:`Shutdown` (or the controller's pipe closes).

        Raises
        ------
        Exception
            What stopped the loop; else the first error of closing the agent sessions, the
            engine, the shard store and the weight buffers (each is closed regardless).
        """
        failed = True
        try:
            self.engine.start()
            self.store.start()
            if self.agent is not None:
                self.agent.start()
            threading.Thread(target=self._read_control, daemon=True).start()
            threading.Thread(target=self._pump_outputs, daemon=True).start()
            self.conn.send(self.weights.ready(self.name, self.store.address))
            while not self.stopped:
                kind, item = self.inbox.get()
                if kind == "error":
                    raise item
                if kind == "control":
                    self._handle_control(item)
                elif kind == "weights":  # a version from the weight link
                    self.weights.install_received(item)
                elif kind == "agent_group":
                    self._finish_agent_group(item)
                elif kind == "rewards":
                    self._scored(item)
                else:
                    self._handle_outputs(item)
            failed = False
        finally:
            self.stopped = True
            self._close(raise_error=not failed)

    def _close(self, raise_error: bool) -> None:
        """Close every resource, each in its own try; the first error is raised (when
        ``raise_error``) after all of them, the others are logged."""
        closers = [("the agent sessions", self.agent.close)] if self.agent is not None else []
        closers += [("the engine", self.engine.close), ("the shard store", self.store.close)]
        closers += [("the weight buffers", self.weights.close)]
        closers += [("the reward pool", self.rewards.close)] if self.rewards is not None else []
        first = None
        for what, close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the others are closed all the same
                if first is None and raise_error:
                    first = exc
                else:
                    log.error(
                        "rollout worker %s: closing %s failed: %s: %s",
                        self.name,
                        what,
                        type(exc).__name__,
                        exc,
                    )
        if first is not None:
            raise first

    def _read_control(self) -> None:
        try:
            while True:
                self.inbox.put(("control", self.conn.recv()))
        except (EOFError, OSError):  # the controller is gone
            self.inbox.put(("control", msg.Shutdown()))
        except Exception as exc:  # noqa: BLE001 - e.g. an undecodable message
            self.inbox.put(("error", exc))

    def _pump_outputs(self) -> None:
        try:
            while not self.stopped:
                outputs = self.engine.get_outputs(1.0)
                if outputs:
                    self.inbox.put(("outputs", outputs))
        except Exception as exc:  # noqa: BLE001 - handed to the main loop
            self.inbox.put(("error", exc))

    def _handle_control(self, message) -> None:
        if isinstance(message, msg.SubmitGroups):
            self.weights.when_current(lambda: self._start_groups(message.groups, False))
        elif isinstance(message, msg.Evaluate):  # version None: on the newest weights
            self.weights.evaluate_at(message.version, lambda: self._start_eval(message))
        elif isinstance(message, msg.UpdateWeights):
            self.weights.on_update(message)
        elif isinstance(message, msg.ConnectWeights):
            self.weights.connect(message)
        elif isinstance(message, msg.DropShards):
            self.store.drop(message.shard_ids)
        elif isinstance(message, msg.CancelAll):  # the end of training
            cancelled = self._cancel_all()
            if self.agent is not None:  # a store failure fails the run now, not at exit
                self.agent.flush(FLUSH_TIMEOUT_S)
            self.conn.send(msg.Cancelled(cancelled))
        elif isinstance(message, msg.Shutdown):
            self.stopped = True

    def _start_eval(self, m: msg.Evaluate) -> None:
        self.eval_records, self.eval_pending, self.eval_of = [], len(m.groups), m.version
        self._start_groups(m.groups, evaluation=True)
        self._maybe_finish_eval()

    def _start_groups(self, requests: list[msg.GroupRequest], evaluation: bool) -> None:
        gen = []
        for request in requests:
            if self.agent is not None and not evaluation:
                self.agent_groups.add(request.group_id)
                self.agent.submit(request)
                continue
            samples = [
                Sample(
                    request.group_id,
                    i,
                    list(request.prompt_ids),
                    sample_seed(request.seed, i),
                    request.params.max_new_tokens,
                )
                for i in range(request.params.n)
            ]
            self.groups[request.group_id] = Group(request, samples, evaluation=evaluation)
            gen.extend(self._request(s) for s in samples)
        self.engine.submit(gen)

    def _request(self, sample: Sample) -> GenRequest:
        params = self.groups[sample.group_id].request.params
        rid = next(self.rids)
        self.running[rid] = sample
        return GenRequest(
            rid,
            sample.prompt_ids + sample.tokens,
            sample.budget - len(sample.tokens),
            params.temperature,
            params.top_p,
            sample.seed,
            len(sample.tokens),
        )

    def _handle_outputs(self, outputs: list[GenOutput]) -> None:
        resubmit = []
        for out in outputs:
            sample = self.running.pop(out.rid, None)
            if sample is None:  # an agent session's call, or cancelled
                again = self.agent.route(out) if self.agent is not None else None
                if again is not None:
                    resubmit.append(again)
                continue
            sample.tokens += out.output_ids
            sample.logprobs += out.logprobs
            sample.versions += out.versions
            if out.stop_reason == "abort" and len(sample.tokens) < sample.budget:
                sample.interruptions += 1
                resubmit.append(self._request(sample))
                continue
            sample.stop_reason = "length" if out.stop_reason == "abort" else out.stop_reason
            group = self.groups[sample.group_id]
            group.done += 1
            if group.done == len(group.samples):
                self._finish_group(self.groups.pop(sample.group_id))
        if resubmit:  # ahead of newer samples, so interruptions do not age them further
            self.engine.submit(resubmit, front=True)

    def _finish_group(self, group: Group) -> None:
        request = group.request
        texts = [self.decode(s.tokens) for s in group.samples]
        if self.rewards is not None:  # scored off this thread: back as ("rewards", scores)
            self.scoring[request.group_id] = (group, texts)
            self.rewards.submit(request.group_id, texts, sample_dicts(request))
            return
        rewards = [float(self.spec.reward_fn(text, request.answer)) for text in texts]
        self._report(group, texts, rewards)

    def _scored(self, scores: GroupScores) -> None:
        entry = self.scoring.pop(scores.group_id, None)
        if entry is not None:  # else cancelled while it was scored
            self._report(*entry, scores.rewards, scores.drop_reason, scores.error)

    def _report(self, group: Group, texts, rewards, drop_reason: str = "", error: str = "") -> None:
        request = group.request
        if group.evaluation:
            self.eval_records.append(eval_record(request, texts[0], rewards[0], error))
            self.eval_pending -= 1
            self._maybe_finish_eval()
            return
        if drop_reason:  # its reward failed (reward.on_error = drop): no shard
            self.conn.send(group_done(group, rewards, None, drop_reason, error))
            return
        trajectories = [
            Trajectory(
                s.prompt_ids,
                s.tokens,
                s.logprobs,
                s.versions,
                s.stop_reason,
                request.group_id,
                reward,
            )
            for s, reward in zip(group.samples, rewards)
        ]
        shard = self._put_shard(request.group_id, trajectories)
        self.conn.send(group_done(group, rewards, shard, error=error))

    def _put_shard(self, group_id: int, trajectories: list[Trajectory]) -> ShardMetadata:
        """Keep a finished group's packed tensors in the shard store; returns its metadata."""
        tensors = shard_tensors(trajectories)
        path = self.store.put(group_id, tensors)
        return ShardMetadata(
            self.name,
            self.store.address,
            group_id,
            len(trajectories),
            0,
            tensor_metadata(tensors),
            path,
        )

    def _finish_agent_group(self, group) -> None:
        if group.group_id not in self.agent_groups:
            return  # ended after CancelAll took it: counted as cancelled, not reported
        self.agent_groups.discard(group.group_id)
        trajectories, stats = self.agent.finish(group)
        # the bridge does not know which group a resumed call belonged to: each GroupDone
        # carries the calls resumed since the previous one, so their sum is the total
        resumed = int(stats.get("agent/resumed_calls", 0))
        interruptions, self.agent_resumed = resumed - self.agent_resumed, resumed
        shard = self._put_shard(group.group_id, trajectories) if trajectories else None
        self.conn.send(
            msg.GroupDone(
                shard,
                group.group_id,
                [t.reward for t in trajectories],
                [t.num_trained_tokens for t in trajectories],
                [t.stop_reason for t in trajectories],
                interruptions,
                stats,
                [f"{s.drop_reason}: {s.error}" for s in group.sessions if s.status != "done"],
            )
        )

    def _maybe_finish_eval(self) -> None:
        if self.eval_pending == 0 and self.eval_records is not None:
            self.conn.send(msg.EvalDone(self.eval_records, self.eval_of, self.weights.served))
            self.eval_records = None
            self.weights.evaluated(self.eval_of)  # may start the next evaluation

    def _cancel_all(self) -> int:
        self.engine.pause(PAUSE_TIMEOUT_S, keep=False)  # running samples come back aborted
        cancelled = len(self.agent_groups)  # whatever the agent loop has finished meanwhile
        self.agent_groups.clear()
        if self.agent is not None:
            self.agent.cancel_all()
        self.engine.drop_queued()
        self.weights.drop_held()  # submitted groups still waiting for the link's version
        cancelled += sum(not g.evaluation for g in self.groups.values())
        cancelled += sum(not g.evaluation for g, _ in self.scoring.values())
        self.groups = {k: g for k, g in self.groups.items() if g.evaluation}
        self.scoring = {k: e for k, e in self.scoring.items() if e[0].evaluation}
        kept, self.running = [s for s in self.running.values() if s.group_id in self.groups], {}
        self.engine.resume()  # evaluation samples go on under new ids (queued ones were dropped)
        self.engine.submit([self._request(s) for s in kept], front=True)
        return cancelled


def rollout_worker_main(conn, name: str, spec: RolloutWorkerSpec, authkey: bytes) -> None:
    """Process entry point of a rollout worker."""
    RolloutWorker(name, conn, rollout_cores(spec), authkey).run()
