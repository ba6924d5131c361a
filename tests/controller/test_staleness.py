"""StalenessManager: capacity bounds, and the staleness of consumed groups, under random
sequences of submissions, completions and training steps."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_fast.controller.staleness import StalenessManager


class _Run:
    """A model of the controller around one manager: groups are submitted (up to capacity),
    finish accepted or rejected, and each train step consumes ``batch_size`` accepted groups
    in acceptance order (version += 1)."""

    def __init__(self, batch_size: int, eta: int, max_concurrent: int):
        self.m = StalenessManager(batch_size, eta, max_concurrent)
        self.B, self.eta, self.mc = batch_size, eta, max_concurrent
        self.version = 0
        self.running: list[int] = []  # group ids, in submission order
        self.submitted_at: dict[int, int] = {}  # group id -> version at submission
        self.accepted: list[int] = []  # acceptance order
        self.ready: collections.deque[int] = collections.deque()
        self.rejected = 0
        self.consumed: list[tuple[int, int]] = []  # (group id, version at consumption)

    def check_counts(self) -> None:
        c = self.m.counts
        assert (c.running, c.accepted, c.rejected) == (
            len(self.running),
            len(self.accepted),
            self.rejected,
        )
        assert self.m.capacity(self.version) >= 0
        assert c.running <= self.mc

    def submit(self, n: int) -> None:
        cap = self.m.capacity(self.version)
        assert 0 <= n <= cap
        self.m.on_submit(n)
        for _ in range(n):
            gid = len(self.submitted_at)
            self.submitted_at[gid] = self.version
            self.running.append(gid)
        c = self.m.counts
        assert c.accepted + c.running <= (self.eta + self.version + 1) * self.B
        assert c.running <= self.mc
        if n == cap:  # the capacity is tight: one more would break a bound
            assert self.m.capacity(self.version) == 0
            assert (
                c.running == self.mc
                or c.accepted + c.running == (self.eta + self.version + 1) * self.B
            )

    def finish(self, index: int, accepted: bool) -> None:
        gid = self.running.pop(index)
        self.m.on_finish(accepted)
        if accepted:
            self.accepted.append(gid)
            self.ready.append(gid)
        else:
            self.rejected += 1

    def train(self) -> None:
        assert len(self.ready) >= self.B
        for _ in range(self.B):
            self.consumed.append((self.ready.popleft(), self.version))
        self.version += 1


@st.composite
def _setup(draw):
    return (draw(st.integers(1, 4)), draw(st.integers(0, 3)), draw(st.integers(1, 12)))


def _drive(data, run: _Run, in_order: bool, num_ops: int) -> None:
    for _ in range(num_ops):
        op = data.draw(st.sampled_from(["submit", "finish", "train"]))
        if op == "submit":
            run.submit(data.draw(st.integers(0, run.m.capacity(run.version))))
        elif op == "finish" and run.running:
            index = 0 if in_order else data.draw(st.integers(0, len(run.running) - 1))
            run.finish(index, data.draw(st.booleans()))
        elif op == "train" and len(run.ready) >= run.B:
            run.train()
        run.check_counts()
        # never stuck: with nothing running and no full batch ready, something may start
        if not run.running and len(run.ready) < run.B:
            assert run.m.capacity(run.version) > 0


@settings(max_examples=300, deadline=None)
@given(setup=_setup(), data=st.data())
def test_random_order_keeps_bounds_and_the_true_staleness_bound(setup, data):
    """Any completion order: capacity >= 0, running <= max_concurrent, accepted + running <=
    (η + v + 1)·B; a consumed group's consumption version is at most η past the submission
    version of the newest group accepted up to and including it."""
    run = _Run(*setup)
    _drive(data, run, in_order=False, num_ops=data.draw(st.integers(0, 80)))
    newest, position = -1, {g: i for i, g in enumerate(run.accepted)}
    newest_upto = []
    for gid in run.accepted:
        newest = max(newest, run.submitted_at[gid])
        newest_upto.append(newest)
    for gid, version in run.consumed:
        assert version - newest_upto[position[gid]] <= run.eta


@settings(max_examples=300, deadline=None)
@given(setup=_setup(), data=st.data())
def test_in_order_completion_bounds_staleness_by_eta(setup, data):
    """Rollouts finishing in submission order (accepted or rejected at random): every consumed
    group's staleness (version at consumption − version at submission) is at most η."""
    run = _Run(*setup)
    _drive(data, run, in_order=True, num_ops=data.draw(st.integers(0, 80)))
    for gid, version in run.consumed:
        assert 0 <= version - run.submitted_at[gid] <= run.eta


def test_manager_alone_does_not_bound_a_slow_rollout():
    """B = 1, η = 1: g1 runs while g0, g2, g3 are submitted, accepted and trained. The
    capacity rule alone lets g1 be consumed 3 versions after it started; this is why the
    controller drops such groups as "stale" (tested in test_async_loop.py)."""
    run = _Run(batch_size=1, eta=1, max_concurrent=8)
    run.submit(2)  # g0, g1 at version 0
    run.finish(0, True)  # g0
    run.train()  # v = 1
    run.submit(1)  # g2 at version 1
    run.finish(1, True)  # g2 (g1 still running)
    run.train()  # v = 2
    run.submit(1)  # g3 at version 2
    run.finish(1, True)  # g3
    run.train()  # v = 3
    run.finish(0, True)  # g1 at last
    run.train()  # consumed at version 3, submitted at version 0
    assert [g for g, _ in run.consumed] == [0, 2, 3, 1]
    assert run.consumed[-1][1] - run.submitted_at[1] == 3 > run.eta


def test_eta_zero_is_exactly_one_batch_per_version():
    m = StalenessManager(batch_size=3, max_head_offpolicyness=0, max_concurrent_rollouts=100)
    for version in range(4):
        assert m.capacity(version) == 3
        m.on_submit(3)
        assert m.capacity(version) == 0
        m.on_finish(accepted=False)  # a rejected rollout frees its slot
        assert m.capacity(version) == 1
        m.on_submit(1)
        for _ in range(3):
            m.on_finish(accepted=True)
        assert m.capacity(version) == 0  # the batch is full until it is trained
    assert (m.counts.accepted, m.counts.rejected, m.counts.running) == (12, 4, 0)


def test_max_concurrent_caps_capacity():
    m = StalenessManager(batch_size=4, max_head_offpolicyness=5, max_concurrent_rollouts=3)
    assert m.capacity(0) == 3
    m.on_submit(2)
    assert m.capacity(0) == 1
    m.on_finish(accepted=True)
    assert m.capacity(0) == 2


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=2.5), "batch_size"),
        (dict(max_head_offpolicyness=-1), "max_head_offpolicyness"),
        (dict(max_head_offpolicyness=0.5), "max_head_offpolicyness"),
        (dict(max_concurrent_rollouts=0), "max_concurrent_rollouts"),
        (dict(max_concurrent_rollouts=-3), "max_concurrent_rollouts"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, name):
    args = {**dict(batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=4), **kwargs}
    with pytest.raises(ValueError, match=name):
        StalenessManager(**args)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_argument_is_named(value):
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(batch_size=value, max_head_offpolicyness=0, max_concurrent_rollouts=1)


def test_finish_with_nothing_running_raises_and_changes_nothing():
    m = StalenessManager(batch_size=1, max_head_offpolicyness=0, max_concurrent_rollouts=1)
    with pytest.raises(RuntimeError, match="none was running"):
        m.on_finish(accepted=True)
    m.on_submit(1)
    m.on_finish(accepted=False)
    with pytest.raises(RuntimeError, match="none was running"):
        m.on_finish(accepted=False)
    assert (m.counts.running, m.counts.accepted, m.counts.rejected) == (0, 0, 1)
