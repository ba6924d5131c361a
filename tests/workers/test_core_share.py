"""The core table of ``launcher.share_cores``: the decision, the shared slots across
processes (a dead one's lease runs out, a restarted one claims its slot afresh), the hooks
that change the torch threads inside a forward, a backward, an optimizer step and an engine
thread's decode steps, the config switch and the launcher's slots."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from areal_fast.workers.core_hooks import (
    SharedEngineFactory,
    decoder_layers,
    hook_engine,
    hook_trainer,
    rollout_cores,
    trainer_cores,
)
from areal_fast.workers.core_share import (
    PREFIX,
    CoreShare,
    CoreShareSpec,
    FixedCores,
    create_table,
    remove_orphaned_tables,
    remove_table,
    threads_wanted,
)
from areal_fast.workers.rollout_worker import RolloutWorkerSpec
from areal_fast.workers.trainer_worker import TrainerWorkerSpec


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def table(tmp_path):
    """A table of two slots with one thread each, on two cores."""
    spec = create_table((1, 1), 2, str(tmp_path))
    yield spec
    remove_table(spec)


def _in_thread(fn):
    """Run ``fn`` in a thread of its own (its torch threads are that thread's, not ours)."""
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0] if result else None


# ------------------------------------------------------------------ the decision


def test_threads_wanted_values():
    assert threads_wanted(1, 0, 2) == 2  # alone: every core
    assert threads_wanted(1, 1, 2) == 1  # both work: the configured split
    assert threads_wanted(2, 0, 4) == 4
    assert threads_wanted(2, 1, 4) == 2  # 4 · 2 // 3
    assert threads_wanted(1, 2, 4) == 1  # 4 · 1 // 3
    assert threads_wanted(2, 2, 4) == 2
    assert threads_wanted(3, 3, 2) == 3  # never below the share


def test_threads_wanted_never_oversubscribes_shares_that_fit():
    """For shares that fit the cores, the threads of the working processes never add up to
    more than the cores, a process alone gets them all, and none gets less than its share."""
    for cores in range(1, 9):
        for shares in itertools.product(range(1, 5), repeat=3):
            if sum(shares) > cores:
                continue
            for busy in itertools.product((False, True), repeat=3):
                wanted = [
                    threads_wanted(
                        s, sum(o for j, o in enumerate(shares) if busy[j] and j != i), cores
                    )
                    for i, s in enumerate(shares)
                    if busy[i]
                ]
                assert sum(wanted) <= cores, (cores, shares, busy)
                assert all(w >= s for w, s in zip(wanted, [s for s, b in zip(shares, busy) if b]))
                if sum(busy) == 1:
                    assert wanted == [cores]


# ------------------------------------------------------------------ the table


def test_table_file_and_spec_checks(tmp_path, table):
    assert os.path.basename(table.path).startswith(f"{PREFIX}{os.getpid()}-")
    assert table.slot == -1 and table.for_slot(1).slot == 1
    assert os.path.getsize(table.path) == 8 * (2 + 2 * 2)
    with pytest.raises(ValueError, match="slot 2 of 2"):
        table.for_slot(2)
    with pytest.raises(ValueError, match="must be >= 1"):
        CoreShareSpec("x", 0, (1, 0), 2)
    with pytest.raises(ValueError, match="slot >= 0"):
        CoreShare(table)
    wrong = create_table((1, 1, 1), 2, str(tmp_path))
    with pytest.raises(ValueError, match="is not one of 2 slots"):
        CoreShare(CoreShareSpec(wrong.path, 0, (1, 1), 2))
    (tmp_path / "junk").write_bytes(bytes(48))
    with pytest.raises(ValueError, match="junk is not one of 2 slots"):
        CoreShare(CoreShareSpec(str(tmp_path / "junk"), 0, (1, 1), 2))


def test_claim_writes_pid_and_idle(table):
    share = CoreShare(table.for_slot(0))
    assert torch.get_num_threads() == 1  # the claim sets the share
    other = CoreShare(table.for_slot(1), pulse_lease=60.0)
    _in_thread(other.pulse)
    assert share.others_working() == 1
    assert other._view[2 + 2 * 1] == os.getpid()  # slot 1's pid
    _in_thread(lambda: CoreShare(table.for_slot(1)))  # a restarted worker claims it afresh
    assert share.others_working() == 0


def test_orphaned_tables_are_removed(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = tmp_path / f"{PREFIX}{gone.pid}-abcd"
    orphan.write_bytes(b"")
    assert remove_orphaned_tables(str(tmp_path)) == 1 and not orphan.exists()
    orphan.write_bytes(b"")
    alive = create_table((1,), 1, str(tmp_path))  # deletes the orphans first
    assert not orphan.exists() and os.path.exists(alive.path)
    assert remove_orphaned_tables(str(tmp_path)) == 0


def _peer(spec: CoreShareSpec, hold_lease: float, conn) -> None:
    """Another process on the table: runs the commands it is sent, answers what it sees."""
    share = CoreShare(spec, hold_lease=hold_lease)
    block = None
    while True:
        command = conn.recv()
        if command == "begin":
            block = share.working()
            block.__enter__()
        elif command == "end":
            block.__exit__(None, None, None)
        conn.send((share.others_working(), torch.get_num_threads()))


def _start_peer(spec: CoreShareSpec, hold_lease: float):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=_peer, args=(spec, hold_lease, theirs), daemon=True)
    process.start()
    return process, mine


def _ask(conn, command: str):
    conn.send(command)
    assert conn.poll(120), f"the peer process did not answer {command!r}"
    return conn.recv()


def test_two_processes_see_each_other(table):
    process, conn = _start_peer(table.for_slot(1), 60.0)
    try:
        share = CoreShare(table.for_slot(0))
        assert _ask(conn, "look") == (0, 1)
        with share.working() as use:
            assert torch.get_num_threads() == 2  # the peer is idle: both cores
            assert _ask(conn, "look") == (1, 1)  # it sees this process working
            assert _ask(conn, "begin") == (1, 1)  # both work: each its share
            assert share.check() == 1 and torch.get_num_threads() == 1
            assert _ask(conn, "end") == (1, 1)  # the peer's block ends: its share again
            assert share.check() == 2
        assert torch.get_num_threads() == 1 and 1.0 <= use.mean <= 2.0
        assert _ask(conn, "look") == (0, 1)
    finally:
        process.kill()
        process.join()


def test_a_killed_process_stops_counting_when_its_lease_runs_out(table):
    process, conn = _start_peer(table.for_slot(1), 2.0)  # two seconds of lease
    share = CoreShare(table.for_slot(0))
    _ask(conn, "begin")
    process.kill()  # inside its working block
    process.join()
    assert share.others_working() == 1
    time.sleep(2.1)
    assert share.others_working() == 0
    with share.working():
        assert torch.get_num_threads() == 2


# ------------------------------------------------------------------ the hooks


class _Record(torch.autograd.Function):
    """Identity whose backward logs the torch threads it runs with."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.log("backward")
        return grad, None


class _Layer(torch.nn.Module):
    def __init__(self, index: int, log: list, flips: dict):
        super().__init__()
        self.index, self._log, self.flips = index, log, flips
        self.linear = torch.nn.Linear(16, 16)

    def log(self, phase: str) -> None:
        time.sleep(0.005)  # some work at this count, for the mean
        self._log.append((phase, self.index, torch.get_num_threads(), threading.get_ident()))
        self.flips.pop((phase, self.index), lambda: None)()

    def forward(self, x):
        self.log("forward")
        return _Record.apply(torch.tanh(self.linear(x)), self)


class _Decoder(torch.nn.Module):
    def __init__(self, log: list, flips: dict, n: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(i, log, flips) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _CausalLM(torch.nn.Module):
    def __init__(self, log: list, flips: dict):
        super().__init__()
        self.decoder = _Decoder(log, flips)
        self.head = torch.nn.Linear(16, 4)

    def get_decoder(self):
        return self.decoder

    def forward(self, x):
        return self.head(self.decoder(x))


def _trainer(log: list, flips: dict):
    model = _CausalLM(log, flips)
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _step(trainer) -> None:
    trainer.optimizer.zero_grad()
    trainer.model(torch.randn(8, 16)).square().sum().backward()
    trainer.optimizer.step()


def test_decoder_layers_found():
    model = _CausalLM([], {})
    decoder, layers = decoder_layers(model)
    assert decoder is model.decoder and layers == list(model.decoder.layers)
    plain = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 2))
    assert decoder_layers(plain) == (plain, list(plain[0]))
    assert decoder_layers(torch.nn.Linear(2, 2))[1] == []


def test_hooks_follow_the_other_side_in_forward_backward_and_optimizer(table):
    """Idle peer: every forward and backward layer runs on both cores; the peer starts
    working after layer 1's forward (layer 2 on, the backward of 2 run on the share) and
    stops after layer 2's backward (1 and 0 back on both cores); the optimizer step sees a
    peer that started again."""
    log, flips = [], {}
    trainer = _trainer(log, flips)
    share = CoreShare(table.for_slot(0))
    handles = hook_trainer(share, trainer)
    assert len(handles) == 2 * 3 + 2  # layers' pre- and post-hooks, decoder, optimizer
    other = CoreShare(table.for_slot(1), pulse_lease=60.0)
    seen_by_optimizer = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen_by_optimizer.append(torch.get_num_threads())
    )

    with share.working() as use:
        _step(trainer)
    assert [n for *_, n, _ in log] == [2] * 6
    assert torch.get_num_threads() == 1 and use.mean > 1.8
    assert {ident for *_, ident in log} == {threading.get_ident()}  # backward: this thread
    assert seen_by_optimizer == [2]

    log.clear()
    flips[("forward", 1)] = lambda: _in_thread(other.pulse)
    flips[("backward", 2)] = lambda: _in_thread(lambda: CoreShare(table.for_slot(1)))
    flips[("backward", 0)] = lambda: _in_thread(other.pulse)
    with share.working() as use:
        _step(trainer)
    assert [(phase, i, n) for phase, i, n, _ in log] == [
        ("forward", 0, 2),
        ("forward", 1, 2),
        ("forward", 2, 1),
        ("backward", 2, 1),
        ("backward", 1, 2),
        ("backward", 0, 2),
    ]
    assert seen_by_optimizer == [2, 1]
    assert 1.0 < use.mean < 2.0

    log.clear()  # the peer still works: the share throughout
    with share.working():
        _step(trainer)
    assert [n for *_, n, _ in log] == [1] * 6


def test_no_grad_forward_is_checked_too(table):
    log, flips = [], {}
    trainer = _trainer(log, flips)
    share = CoreShare(table.for_slot(0))
    hook_trainer(share, trainer)
    with share.working(), torch.no_grad():
        trainer.model(torch.randn(2, 16))
    assert [n for *_, n, _ in log] == [2] * 3


def test_engine_hooks_pulse_in_the_engine_thread(table):
    """An engine thread's forwards mark its slot working and run on both cores while the
    trainer is idle, on its share while the trainer works; a weight install is a block of
    work."""
    log, flips = [], {}
    installs = []
    trainer_share = CoreShare(table.for_slot(0))
    engine_share = CoreShare(table.for_slot(1), pulse_lease=0.3)
    engine = SimpleNamespace(model=_CausalLM(log, flips))
    engine.update_weights = lambda version: installs.append(trainer_share.others_working())
    hook_engine(engine_share, engine)

    with torch.inference_mode():
        _in_thread(lambda: engine.model(torch.randn(2, 16)))
    assert [n for *_, n, _ in log] == [2] * 3
    assert {ident for *_, ident in log} != {threading.get_ident()}
    assert trainer_share.others_working() == 1  # the pulse's lease runs on
    time.sleep(0.35)
    assert trainer_share.others_working() == 0

    log.clear()
    with trainer_share.working(), torch.inference_mode():
        _in_thread(lambda: engine.model(torch.randn(2, 16)))
        assert trainer_share.check() == 1  # the engine's pulse
    assert [n for *_, n, _ in log] == [1] * 3

    time.sleep(0.35)
    engine.update_weights(3)
    assert installs == [1] and trainer_share.others_working() == 0
    assert engine.update_weights.__wrapped__ is not None


def test_engine_without_a_model_counts_as_always_working(table):
    trainer_share = CoreShare(table.for_slot(0))
    assert hook_engine(CoreShare(table.for_slot(1)), SimpleNamespace()) == []
    assert trainer_share.others_working() == 1
    with trainer_share.working():
        assert torch.get_num_threads() == 1


def test_hf_engine_decode_steps_use_the_cores(table, tiny_model_dir):
    """A real HFEngine generating in its own thread: each decode step's layers run with the
    threads the table gives it (both cores alone, its share beside a working trainer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_fast.rollout.engine import GenRequest
    from areal_fast.rollout.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), 4)
    trainer_share = CoreShare(table.for_slot(0))
    hook_engine(CoreShare(table.for_slot(1)), engine)
    seen = []
    layer = decoder_layers(model)[1][0]
    layer.register_forward_pre_hook(
        lambda *_: seen.append((torch.get_num_threads(), threading.get_ident()))
    )

    def generate(rid: int) -> None:
        engine.submit([GenRequest(rid, [5, 6, 7], 4, 0.0, 1.0, 1, 0)])
        deadline = time.monotonic() + 60
        while not engine.get_outputs(1.0):
            assert time.monotonic() < deadline

    engine.start()
    try:
        generate(0)
        assert seen and {n for n, _ in seen} == {2}
        assert threading.get_ident() not in {ident for _, ident in seen}
        seen.clear()
        with trainer_share.working():
            generate(1)
        assert seen and {n for n, _ in seen} == {1}
    finally:
        engine.close()


# ------------------------------------------------------------------ worker processes


def test_trainer_cores_and_rollout_cores(table):
    fixed = trainer_cores(None, SimpleNamespace())
    assert isinstance(fixed, FixedCores)
    torch.set_num_threads(1)
    with fixed.working() as use:
        pass
    assert use.mean == 1.0
    share = trainer_cores(table.for_slot(0), SimpleNamespace())
    assert isinstance(share, CoreShare)
    share.close()
    share.close()  # twice: nothing left to release

    class Factory:
        def __init__(self, name=""):
            self.name = name

        def for_worker(self, name):
            return Factory(name)

        def __call__(self):
            return SimpleNamespace(model=torch.nn.Linear(2, 2)), str

    spec = RolloutWorkerSpec(Factory(), print, threads=1)
    assert rollout_cores(spec) is spec and torch.get_num_threads() == 1
    shared = rollout_cores(RolloutWorkerSpec(Factory(), print, threads=1, cores=table.for_slot(1)))
    factory = shared.engine_factory
    assert isinstance(factory, SharedEngineFactory)
    worker = factory.for_worker("rollout-3")
    assert worker.factory.name == "rollout-3" and worker.share is factory.share
    engine, decode = worker()
    assert decode is str
    with torch.no_grad():
        _in_thread(lambda: engine.model(torch.zeros(1, 2)))
    assert CoreShare(table.for_slot(0)).others_working() == 1
    assert TrainerWorkerSpec(print).cores is None


# ------------------------------------------------------------------ config and launcher


def _cfg(*overrides):
    from areal_fast.launch.config import load_config

    return load_config(None, ["threads=4", *overrides])


def test_shared_cores_only_where_it_applies():
    from areal_fast.launch.worker_specs import cluster_spec, shared_cores

    assert shared_cores(_cfg()) == 4
    assert cluster_spec(_cfg()).shared_cores == 4
    for off in (
        "launcher.share_cores=false",
        "launcher.trainer_threads=2",
        "launcher.rollout_threads=2",
        "scheduler.type=ray",
        "rollout.engine=vllm",
        "rollout.max_head_offpolicyness=0",  # trainer and engine take turns on all cores
    ):
        assert shared_cores(_cfg(off)) is None, off
    assert cluster_spec(_cfg("launcher.share_cores=false")).shared_cores is None
    # η = 0 with two workers: each worker's share is half the cores
    assert shared_cores(_cfg("rollout.max_head_offpolicyness=0", "rollout.num_workers=2")) == 4


def test_share_cores_key_is_checked():
    from areal_fast.launch.config import ConfigError

    assert _cfg().launcher.share_cores is True
    with pytest.raises(ConfigError, match="launcher.share_cores"):
        _cfg("launcher.share_cores=sometimes")


def test_local_cluster_gives_each_worker_its_slot(tmp_path):
    from areal_fast.launch.cluster import ClusterSpec, LocalCluster
    from areal_fast.launch.config import SchedulerConfig

    class Handle:
        def __init__(self, name, spec):
            self.name, self.spec, self.pid = name, spec, None

        def stop(self, *args, **kwargs):
            pass

    class Recording(LocalCluster):
        def _start_worker(self, name, target, spec, env=None):
            return Handle(name, spec)

        def _wait_ready(self, handles):
            pass

        def link_weights(self, worker):
            pass

    spec = ClusterSpec(
        rollout=RolloutWorkerSpec(print, print, threads=1),
        trainer=TrainerWorkerSpec(print, threads=2),
        num_rollout_workers=2,
        scheduler=SchedulerConfig(train_world_size=2),
        shared_cores=4,
    )
    with Recording(spec) as cluster:
        cores = [h.spec.cores for h in [*cluster.trainer_ranks, *cluster.rollout_workers]]
        assert [c.slot for c in cores] == [0, 1, 2, 3]
        assert {c.path for c in cores} == {cores[0].path} and os.path.exists(cores[0].path)
        assert cores[0].shares == (2, 2, 1, 1) and cores[0].cores == 4
        assert cluster.restart_rollout("rollout-1").spec.cores.slot == 3
    assert not os.path.exists(cores[0].path)
    with pytest.raises(ValueError, match="shared_cores = 4 needs"):
        ClusterSpec(
            rollout=RolloutWorkerSpec(print, print),
            trainer=TrainerWorkerSpec(print, threads=2),
            num_rollout_workers=1,
            shared_cores=4,
        )
