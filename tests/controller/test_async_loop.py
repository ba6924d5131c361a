"""The asynchronous controller with simulated rollout and trainer worker processes:
accounting, interruption across weight updates, staleness, and worker death.

Worker processes are ``spawn``-ed and unpickle the factories below by reference, importing
this module by name (pytest puts this folder on ``sys.path``, and spawn hands ``sys.path`` to
the children).
"""

from __future__ import annotations

import collections
import heapq
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_fast.controller.async_loop import AsyncController, RunPlan
from areal_fast.controller.config import Timeouts
from areal_fast.controller.run_counts import RunCounts
from areal_fast.controller.step_evals import StepEvals
from areal_fast.launch.cluster import ClusterSpec, LocalCluster
from areal_fast.launch.config import LauncherConfig
from areal_fast.rollout.config import RolloutConfig
from areal_fast.rollout.engine import SamplingParams, sample_seed
from areal_fast.rollout.simulated import (
    SimulatedEngine,
    SimulatedEngineConfig,
    SimulatedEngineFactory,
    sim_decode,
    sim_reward,
)
from areal_fast.train.simulated import SimulatedTrainEngine
from areal_fast.wire.codec import MessageChannel
from areal_fast.wire.handles import WorkerError, WorkerHandle
from areal_fast.wire.messages import (
    CancelAll,
    Cancelled,
    EvalDone,
    Evaluate,
    GroupRequest,
    UpdateWeights,
)
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

PROMPT = [7] * 8
FLAT = "flat"  # answer of groups whose samples all get reward 1


# ---- module-level pieces the worker processes unpickle -------------------------------


def flat_or_parity_reward(completion_text: str, answer: str) -> float:
    """1.0 for every sample of a FLAT group (all equal: filtered out), else the parity
    reward of the simulated engine."""
    return 1.0 if answer == FLAT else sim_reward(completion_text, answer)


class RecordingTrainEngine(SimulatedTrainEngine):
    """Simulated trainer that appends every trained sequence to a JSONL file: group id,
    reward, completion tokens, their versions and the trainer version at the step."""

    def __init__(self, token_seconds: float, path: str, die_at_step: int = 0, how: str = "exit"):
        super().__init__(token_seconds, num_weights=16)
        self.path, self.die_at_step, self.how = path, die_at_step, how

    def train_step(self, batch):
        if self.die_at_step and self.version + 1 == self.die_at_step:
            _die(self.how)
        bounds = batch.cu_seqlens.tolist()
        rows = []
        for s in range(batch.num_seqs):
            span = slice(bounds[s], bounds[s + 1])
            mask = batch.loss_mask[span]
            rows.append(
                {
                    "trainer_version": self.version,
                    "group_id": int(batch.group_ids[s]),
                    "reward": float(batch.rewards[s]),
                    "completion": batch.labels[span][mask].tolist(),
                    "versions": batch.versions[span][mask].tolist(),
                }
            )
        stats = super().train_step(batch)
        with open(self.path, "a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        return stats


@dataclass
class RecordingTrainerFactory:
    token_seconds: float
    path: str
    die_at_step: int = 0
    how: str = "exit"

    def __call__(self) -> RecordingTrainEngine:
        return RecordingTrainEngine(self.token_seconds, self.path, self.die_at_step, self.how)


def _die(how: str) -> None:
    if how == "exit":
        os._exit(3)
    raise SystemExit(3)


class DyingEngine(SimulatedEngine):
    """Simulated engine whose process dies at its ``die_at``-th submit call."""

    def __init__(self, config: SimulatedEngineConfig, die_at: int, how: str):
        super().__init__(config)
        self.die_at, self.how, self.calls = die_at, how, 0

    def submit(self, requests):
        self.calls += 1
        if self.calls == self.die_at:
            _die(self.how)
        super().submit(requests)


class HoldingEngine(SimulatedEngine):
    """Simulated engine that does not finish the samples with seeds in ``hold`` before it
    serves version ``until`` (they decode, and return partial tokens when paused)."""

    def __init__(self, config: SimulatedEngineConfig, hold: frozenset, until: int):
        super().__init__(config)
        self.hold, self.until = hold, until

    def _admit(self, now: float) -> None:
        super()._admit(now)
        if self._version < self.until:
            self._heap = [
                (now + 3600.0 if run.request.seed in self.hold else finish, rid, run)
                for finish, rid, run in self._heap
            ]
            heapq.heapify(self._heap)


@dataclass
class HoldingEngineFactory:
    config: SimulatedEngineConfig
    hold: frozenset
    until: int

    def __call__(self):
        return HoldingEngine(self.config, self.hold, self.until), sim_decode


@dataclass
class DyingEngineFactory:
    config: SimulatedEngineConfig
    die_at: int
    how: str

    def __call__(self):
        return DyingEngine(self.config, self.die_at, self.how), sim_decode


# ---- helpers ---------------------------------------------------------------------------


def engine_config(median: float = 20.0, cap: int = 60, sigma: float = 0.8) -> SimulatedEngineConfig:
    return SimulatedEngineConfig(
        token_seconds=2e-4,
        max_running=256,
        median_length=median,
        sigma=sigma,
        max_length=cap,
        vocab_size=1000,
    )


def expected_completion(config: SimulatedEngineConfig, seed: int, budget: int) -> list[int]:
    """Tokens of an uninterrupted simulated sample (ids continue across resumptions)."""
    length = config.length(seed)
    n = min(length, budget)
    base = seed % (config.vocab_size - 1)
    ids = [1 + (base + j) % (config.vocab_size - 1) for j in range(n)]
    if length <= budget:
        ids[-1] = SimulatedEngine.eos_token_id
    return ids


@dataclass
class Requests:
    """next_request of the controller (runs in the test process; need not be picklable)."""

    run_seed: int
    params: SamplingParams
    flat_every: int = 0  # every flat_every-th group gets the FLAT answer

    def seed(self, group_id: int) -> int:
        return sample_seed(self.run_seed, group_id)

    def __call__(self, group_id: int) -> GroupRequest:
        flat = self.flat_every and group_id % self.flat_every == 0
        return GroupRequest(
            group_id, PROMPT, self.params, self.seed(group_id), FLAT if flat else ""
        )


def run_controller(
    rollout: RolloutWorkerSpec,
    trainer: TrainerWorkerSpec,
    requests,
    settings: tuple[RunPlan, RolloutConfig],
    num_workers: int = 1,
    weight_files: list | None = None,
    timeouts: Timeouts | None = None,
):
    """Start a LocalCluster and run the controller; ``weight_files`` receives the paths of
    the trainer's shared-memory weight buffers."""
    records: list[dict] = []
    spec = ClusterSpec(
        rollout,
        trainer,
        num_rollout_workers=num_workers,
        launcher=LauncherConfig(startup_timeout=60),
    )
    with LocalCluster(spec) as cluster:
        if weight_files is not None:
            weight_files.extend(Path(b.path) for b in cluster.weight_buffers)
        plan, rollout_config = settings
        controller = AsyncController(
            cluster.rollout_workers,
            cluster.trainer,
            cluster.weight_buffers,
            requests,
            plan,
            rollout_config,
            records.append,
            timeouts=timeouts,
        )
        counts = controller.run()
    return counts, records


def read_trained(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_trained_samples(
    rows: list[dict], requests: Requests, config: SimulatedEngineConfig, eta: int | None
) -> None:
    """Each trained group once, its samples complete and in order, versions non-decreasing
    and (unless ``eta`` is None) no token staler than η."""
    by_group: dict[int, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_group[row["group_id"]].append(row)
    budget = requests.params.max_new_tokens
    for gid, samples in by_group.items():
        assert len(samples) == requests.params.n, f"group {gid} trained more than once"
        assert len({s["trainer_version"] for s in samples}) == 1
        for i, s in enumerate(samples):
            seed = sample_seed(requests.seed(gid), i)
            assert s["completion"] == expected_completion(config, seed, budget), (gid, i)
            assert len(s["versions"]) == min(config.length(seed), budget)
            assert s["versions"] == sorted(s["versions"])
            for v in s["versions"]:
                assert 0 <= s["trainer_version"] - v <= (float("inf") if eta is None else eta), (
                    gid,
                    i,
                    s["trainer_version"],
                    s["versions"],
                )


def cluster_specs(
    tmp_path: Path, config: SimulatedEngineConfig, train_token_seconds: float, reward=sim_reward
):
    log = tmp_path / "trained.jsonl"
    rollout = RolloutWorkerSpec(SimulatedEngineFactory(config), reward, threads=1)
    trainer = TrainerWorkerSpec(
        RecordingTrainerFactory(train_token_seconds, str(log)), fetch_timeout=30.0, threads=1
    )
    return rollout, trainer, log


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"run seed {seed}")
    return seed


# ---- tests -----------------------------------------------------------------------------


def test_children_import_this_module_by_name():
    """Spawned workers unpickle the factories as ``test_async_loop.X``."""
    assert RecordingTrainerFactory.__module__ == "test_async_loop"
    assert sys.modules["test_async_loop"].RecordingTrainerFactory is RecordingTrainerFactory
    assert str(Path(__file__).parent) in sys.path


def test_accounting_with_dynamic_filter(tmp_path):
    """Every submitted rollout is trained once or dropped with a reason; flat groups are
    filtered and every step still trains batch_size groups."""
    config = engine_config()
    rollout, trainer, log = cluster_specs(tmp_path, config, 1e-5, flat_or_parity_reward)
    requests = Requests(fresh_seed(), SamplingParams(n=3, max_new_tokens=50), flat_every=3)
    settings = (
        RunPlan(total_steps=5, batch_size=4),
        RolloutConfig(max_head_offpolicyness=1, max_concurrent_rollouts=8, dynamic_filter=True),
    )
    timeouts = Timeouts(train_step=30, weight_update=30, rollout_stall=30)
    counts, records = run_controller(
        rollout, trainer, requests, settings, num_workers=2, timeouts=timeouts
    )

    assert counts.trained == 5 * 4
    assert counts.submitted == counts.trained + sum(counts.dropped.values())
    assert set(counts.dropped) <= {"dynamic_filter", "stale", "unused_at_end", "in_flight_at_end"}
    assert counts.dropped["dynamic_filter"] > 0
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    rows = read_trained(log)
    assert len(rows) == 5 * 4 * 3
    steps = collections.defaultdict(set)
    for row in rows:
        steps[row["trainer_version"]].add(row["group_id"])
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert all(len(groups) == 4 for groups in steps.values())
    trained = [g for groups in steps.values() for g in groups]
    assert len(set(trained)) == len(trained) == counts.trained
    assert all(g % 3 != 0 for g in trained)  # no FLAT group was trained
    assert set(trained) <= set(range(counts.submitted))
    rewards = collections.defaultdict(set)
    for row in rows:
        rewards[row["group_id"]].add(row["reward"])
    assert all(len(r) > 1 for r in rewards.values())  # every trained group has variance
    for record in records:
        assert record["zero_adv_group_fraction"] == 0.0
        assert record["trained_tokens"] == sum(
            len(r["completion"]) for r in rows if r["trainer_version"] == record["step"] - 1
        )
    check_trained_samples(rows, requests, config, eta=1)  # too-stale groups were dropped


def test_interrupted_samples_lose_and_repeat_nothing(tmp_path):
    """Weight updates land mid-generation: samples resume across the seam with their tokens
    intact, versions non-decreasing, and staleness within η (equal lengths, so rollouts
    finish in submission order)."""
    config = engine_config(median=60, cap=60, sigma=0.0)
    rollout, trainer, log = cluster_specs(tmp_path, config, 2e-5)
    requests = Requests(fresh_seed(), SamplingParams(n=3, max_new_tokens=50))
    eta = 2
    settings = (
        RunPlan(total_steps=8, batch_size=3),
        RolloutConfig(max_head_offpolicyness=eta, max_concurrent_rollouts=9),
    )
    counts, records = run_controller(rollout, trainer, requests, settings)

    assert counts.interruptions > 0
    assert counts.submitted == counts.trained + sum(counts.dropped.values())
    rows = read_trained(log)
    assert len({r["group_id"] for r in rows}) == counts.trained == 8 * 3
    check_trained_samples(rows, requests, config, eta)
    assert any(len(set(r["versions"])) > 1 for r in rows)
    assert max(r["staleness_max"] for r in records) <= eta
    assert sum(r["sample_interruptions"] for r in records) <= counts.interruptions


def test_varied_lengths_resume_exactly(tmp_path):
    """Lognormal lengths (some truncated at max_new_tokens), two workers: each trained group
    once, every sample's tokens and length as if never interrupted."""
    config = engine_config(median=30, cap=90)
    rollout, trainer, log = cluster_specs(tmp_path, config, 2e-5)
    requests = Requests(fresh_seed(), SamplingParams(n=3, max_new_tokens=60))
    settings = (
        RunPlan(total_steps=8, batch_size=3),
        RolloutConfig(max_head_offpolicyness=2, max_concurrent_rollouts=9),
    )
    counts, records = run_controller(rollout, trainer, requests, settings, num_workers=2)

    assert counts.interruptions > 0
    assert counts.submitted == counts.trained + sum(counts.dropped.values())
    rows = read_trained(log)
    assert len({r["group_id"] for r in rows}) == counts.trained == 8 * 3
    check_trained_samples(rows, requests, config, eta=2)  # too-stale groups were dropped
    assert any(len(set(r["versions"])) > 1 for r in rows)
    assert any(len(r["versions"]) == 60 for r in rows)  # a truncated sample


def test_eta_zero_is_on_policy(tmp_path):
    """η = 0: every trained token was generated by the trainer's current version."""
    config = engine_config()
    rollout, trainer, log = cluster_specs(tmp_path, config, 1e-5)
    requests = Requests(fresh_seed(), SamplingParams(n=2, max_new_tokens=50))
    settings = (
        RunPlan(total_steps=5, batch_size=3),
        RolloutConfig(max_head_offpolicyness=0, max_concurrent_rollouts=16),
    )
    counts, records = run_controller(rollout, trainer, requests, settings, num_workers=2)

    rows = read_trained(log)
    assert len(rows) == 5 * 3 * 2
    for row in rows:
        assert row["versions"] and set(row["versions"]) == {row["trainer_version"]}
    assert counts.interruptions == 0
    assert sorted({r["group_id"] for r in rows}) == list(range(15))  # nothing over-submitted
    assert counts.submitted == 15 and sum(counts.dropped.values()) == 0
    assert all(r["staleness_max"] == 0.0 for r in records)
    check_trained_samples(rows, requests, config, eta=0)


def run_with_held_group(tmp_path, drop_stale: bool):
    """B = 1, η = 1, 6 steps: group 1 cannot finish before version 3 while groups 0, 2, 3
    train. Returns (counts, trained rows, requests, engine config)."""
    config = engine_config(median=20, cap=20, sigma=0.0)
    requests = Requests(fresh_seed(), SamplingParams(n=2, max_new_tokens=50))
    hold = frozenset(sample_seed(requests.seed(1), i) for i in range(2))
    log = tmp_path / "trained.jsonl"
    rollout = RolloutWorkerSpec(HoldingEngineFactory(config, hold, until=3), sim_reward, threads=1)
    trainer = TrainerWorkerSpec(RecordingTrainerFactory(1e-5, str(log)), threads=1)
    settings = (
        RunPlan(total_steps=6, batch_size=1),
        RolloutConfig(max_head_offpolicyness=1, max_concurrent_rollouts=4, drop_stale=drop_stale),
    )
    counts, _ = run_controller(rollout, trainer, requests, settings)
    return counts, read_trained(log), requests, config


def test_too_stale_group_is_dropped(tmp_path):
    """The held group is dropped as "stale" instead of being trained 3 versions late."""
    counts, rows, requests, config = run_with_held_group(tmp_path, drop_stale=True)
    assert not [r for r in rows if r["group_id"] == 1]
    assert counts.dropped["stale"] >= 1
    assert counts.submitted == counts.trained + sum(counts.dropped.values())
    assert counts.trained == 6
    check_trained_samples(rows, requests, config, eta=1)


def test_drop_stale_off_trains_the_late_group(tmp_path):
    """drop_stale=False (AReaL's behaviour): the held group is trained, 3 versions late."""
    counts, rows, _, _ = run_with_held_group(tmp_path, drop_stale=False)
    slow = [r for r in rows if r["group_id"] == 1]
    assert len(slow) == 2 and slow[0]["trainer_version"] >= 3 and slow[0]["versions"][0] == 0
    assert "stale" not in counts.dropped
    assert counts.submitted == counts.trained + sum(counts.dropped.values())


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_rollout_worker_death_is_reported_by_name(tmp_path, how):
    config = engine_config()
    log = tmp_path / "trained.jsonl"
    rollout = RolloutWorkerSpec(
        DyingEngineFactory(config, die_at=4, how=how), sim_reward, threads=1
    )
    trainer = TrainerWorkerSpec(RecordingTrainerFactory(1e-5, str(log)), threads=1)
    requests = Requests(fresh_seed(), SamplingParams(n=2, max_new_tokens=50))
    settings = (
        RunPlan(total_steps=50, batch_size=2),
        RolloutConfig(max_head_offpolicyness=0, max_concurrent_rollouts=2),
    )
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        run_controller(rollout, trainer, requests, settings)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "'rollout-0'" in message
    assert ("exit code 3" in message) if how == "exit" else ("SystemExit: 3" in message)
    assert 1 <= len({r["trainer_version"] for r in read_trained(log)}) < 50


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_trainer_death_is_reported_by_name(tmp_path, how):
    config = engine_config()
    log = tmp_path / "trained.jsonl"
    rollout = RolloutWorkerSpec(SimulatedEngineFactory(config), sim_reward, threads=1)
    trainer = TrainerWorkerSpec(
        RecordingTrainerFactory(1e-5, str(log), die_at_step=3, how=how), threads=1
    )
    requests = Requests(fresh_seed(), SamplingParams(n=2, max_new_tokens=50))
    settings = (
        RunPlan(total_steps=50, batch_size=2),
        RolloutConfig(max_head_offpolicyness=1, max_concurrent_rollouts=4),
    )
    start, files = time.monotonic(), []
    try:
        with pytest.raises(WorkerError) as err:
            run_controller(rollout, trainer, requests, settings, weight_files=files)
    finally:
        for path in files:  # a killed trainer leaves them (test_killed_trainer_...)
            path.unlink(missing_ok=True)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "'trainer'" in message
    assert ("exit code 3" in message) if how == "exit" else ("SystemExit: 3" in message)
    assert sorted({r["trainer_version"] for r in read_trained(log)}) == [0, 1]


def test_killed_trainer_leaves_no_weight_files(tmp_path):
    log = tmp_path / "trained.jsonl"
    rollout = RolloutWorkerSpec(SimulatedEngineFactory(engine_config()), sim_reward, threads=1)
    trainer = TrainerWorkerSpec(RecordingTrainerFactory(1e-5, str(log), die_at_step=2), threads=1)
    requests = Requests(fresh_seed(), SamplingParams(n=2, max_new_tokens=50))
    settings = (
        RunPlan(total_steps=50, batch_size=2),
        RolloutConfig(max_head_offpolicyness=0, max_concurrent_rollouts=2),
    )
    files: list[Path] = []
    try:
        with pytest.raises(WorkerError, match="'trainer'.*exit code 3"):
            run_controller(rollout, trainer, requests, settings, weight_files=files)
        assert len(files) == 2
        assert [p for p in files if p.exists()] == []
    finally:
        for path in files:
            path.unlink(missing_ok=True)


# ---- a restarted rollout worker, in process ------------------------------------------------
class PipeHandle(WorkerHandle):
    """A worker's handle over an in-process pipe: what it is sent is recorded; closing
    ``peer`` (the worker's end) is its death."""

    def __init__(self, name: str):
        ours, theirs = multiprocessing.Pipe()
        self.name, self.conn, self.peer, self.sent = name, MessageChannel(ours), theirs, []

    def send(self, message) -> None:
        self.sent.append(message)


def test_a_restarted_worker_is_told_what_the_dead_one_was_told():
    """Its death is noticed by the wait; the new worker gets the current weights, the
    wind-down's cancel and its shares of both running evaluations, in that order."""
    a, b, trainer = PipeHandle("a"), PipeHandle("b"), PipeHandle("trainer")
    restarted = PipeHandle("a")
    params = SamplingParams(n=1, temperature=0.0)
    held_out = [GroupRequest(-1 - i, [1], params, 0, "1", f"u{i}") for i in range(4)]
    resume = {"version": 3, "counts": RunCounts().as_dict(), "pending_groups": 0}
    controller = AsyncController(
        [a, b],
        trainer,
        ("slot-0", "slot-1"),
        lambda group_id: None,
        RunPlan(total_steps=5, batch_size=2),
        RolloutConfig(),
        lambda record: None,
        restart_rollout=lambda name: restarted,
        resume={**resume, "elapsed_seconds": 5.0},
        step_evals=StepEvals(every_steps=1, requests=held_out),
    )
    assert controller.version == 3 and controller.elapsed_before == 5.0
    assert a.sent == b.sent == [UpdateWeights(3, "slot-1")]  # the resumed version's weights
    controller.evals.start(3, controller.fleet)
    controller.drain.shares = {"a": held_out[:2], "b": held_out[2:]}  # evaluate() under way
    controller.ledger.close()  # training is winding down
    a.peer.close()
    assert controller.wait(1.0, "in the test") == []
    assert controller.workers == [restarted, b] and controller.weights.acked["a"] == 0
    assert controller.ledger.counts.rollout_restarts == 1 and "a" in controller.recovery.warming
    assert restarted.sent == [
        UpdateWeights(3, "slot-1"),
        CancelAll(),
        Evaluate(held_out[:2]),
        Evaluate([held_out[0], held_out[2]], 3),
    ]
    # answers to evaluate() go to the drain, cancels to the fleet
    controller.fleet.cancelling = {"a", "b"}
    controller.handle([(b, EvalDone([{"uid": "u2"}])), (b, Cancelled(0))])
    assert controller.drain.records == {"b": [{"uid": "u2"}]}
    assert controller.fleet.cancelling == {"a"}
