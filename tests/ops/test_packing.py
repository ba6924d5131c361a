"""Tests for areal_fast.ops.packing: partitioning and packed-batch index helpers.

Both implementations are exercised: the native one (areal_fast._C) and the pure-Python
twin, selected with AREAL_FAST_DISABLE_NATIVE. The native cases skip only when the
extension genuinely cannot be imported. Property tests draw fresh random inputs every run
(seed in the failure message); the two quality comparisons use fixed seeds because they
hold on average, not for every instance.
"""

from __future__ import annotations

import heapq
import importlib
import sys
import warnings

import numpy as np
import pytest
import torch

from areal_fast import _native
from areal_fast.ops import packing
from areal_fast.ops.packing import (
    cu_seqlens_from_lengths,
    partition_balanced,
    position_ids_from_cu_seqlens,
)

try:
    _C = importlib.import_module("areal_fast._C")
except ImportError as exc:  # not built: native cases skip, Python cases still run
    _C = None
    _C_ERROR = repr(exc)

needs_native = pytest.mark.skipif(_C is None, reason="areal_fast._C is not importable")


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Run a test once through _C and once through the pure-Python implementation."""
    if request.param == "native":
        if _C is None:
            pytest.skip(f"areal_fast._C is not importable: {_C_ERROR}")
        monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
        assert _native.load_native() is _C
    else:
        monkeypatch.setenv(_native.DISABLE_ENV, "1")
        assert _native.load_native() is None
    return request.param


# ---------------------------------------------------------------------------
# References and checks
# ---------------------------------------------------------------------------


def _random_case(rng, *, max_n=80, zeros=False, groups=False):
    n = int(rng.integers(0, max_n + 1))
    hi = int(rng.integers(1, 3000))
    seqlens = rng.integers(0 if zeros else 1, hi + 1, size=n)
    group_ids = None
    if groups and n:
        group_ids = rng.integers(-3, max(1, n // 3), size=n)
    budget_floor = hi
    if group_ids is not None:
        budget_floor = max(int(seqlens[group_ids == g].sum()) for g in np.unique(group_ids))
    budget = int(rng.integers(max(budget_floor, 1), 4 * max(budget_floor, 1) + 1))
    return seqlens.astype(np.int64), group_ids, budget


def _assert_valid_partition(mbs, seqlens, budget, group_ids=None, seed=None):
    seqlens = np.asarray(seqlens)
    where = f" (seed {seed})"
    flat = [i for mb in mbs for i in mb]
    assert sorted(flat) == list(range(len(seqlens))), "every index exactly once" + where
    for mb in mbs:
        assert mb, "no empty micro-batch" + where
        assert mb == sorted(mb), "indices ascending inside a micro-batch" + where
        assert int(seqlens[mb].sum()) <= budget, "micro-batch within budget" + where
        assert all(isinstance(i, int) for i in mb)
    assert [mb[0] for mb in mbs] == sorted(mb[0] for mb in mbs), "ordered by first index" + where
    if group_ids is not None:
        bins_of = {}
        for b, mb in enumerate(mbs):
            for i in mb:
                bins_of.setdefault(int(group_ids[i]), set()).add(b)
        assert all(len(bins) == 1 for bins in bins_of.values()), "a group was split" + where


def _ffd_reference(seqlens, budget):
    """Textbook first-fit decreasing with a linear scan over open bins."""
    order = sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i))
    loads, bins = [], []
    for i in order:
        for b, load in enumerate(loads):
            if load + seqlens[i] <= budget:
                loads[b] += seqlens[i]
                bins[b].append(i)
                break
        else:
            loads.append(seqlens[i])
            bins.append([i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _ldm_dense_reference(seqlens, k):
    """Textbook k-way largest differencing method on dense k-tuples."""
    heap = []
    for i, w in enumerate(seqlens):
        tup = [(w, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-(tup[0][0] - tup[-1][0]), i, tup))
    counter = len(seqlens)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        c = sorted(
            ((a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)),
            key=lambda s: -s[0],
        )
        heapq.heappush(heap, (-(c[0][0] - c[-1][0]), counter, c))
        counter += 1
    return sorted((sorted(s[1]) for s in heap[0][2]), key=lambda b: b[0])


def _lpt_max_load(seqlens, k):
    """Greedy (longest processing time first): each item to the least-loaded part."""
    loads = [0] * k
    heapq.heapify(loads)
    for w in sorted(seqlens, reverse=True):
        heapq.heapreplace(loads, loads[0] + w)
    return max(loads)


def _max_load(mbs, seqlens):
    return max(int(np.asarray(seqlens)[mb].sum()) for mb in mbs)


# ---------------------------------------------------------------------------
# partition_balanced
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kk", "ffd"])
@pytest.mark.parametrize("groups", [False, True])
def test_partition_is_valid_on_random_inputs(impl, method, groups, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for _ in range(150):
        seqlens, group_ids, budget = _random_case(rng, zeros=True, groups=groups)
        mbs = partition_balanced(seqlens, budget, method=method, group_ids=group_ids)
        _assert_valid_partition(mbs, seqlens, budget, group_ids, fresh_seed)
        if len(seqlens):
            assert len(mbs) >= -(-int(seqlens.sum()) // budget), f"seed {fresh_seed}"


def test_ffd_matches_textbook_first_fit(impl, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for _ in range(200):
        seqlens, _, budget = _random_case(rng, zeros=True)
        # Few distinct lengths make ties common, which exercises the tie-breaking.
        seqlens = seqlens // 500 * 500
        expected = _ffd_reference(seqlens.tolist(), budget)
        got = partition_balanced(seqlens, budget, method="ffd")
        assert got == expected, f"seed {fresh_seed}"


def test_kk_single_run_matches_textbook_ldm(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        k = int(rng.integers(1, n + 1))
        # Distinct large values: no ties, so any correct LDM gives the same parts.
        seqlens = (rng.choice(10**9, size=n, replace=False) + 1).tolist()
        expected = _ldm_dense_reference(seqlens, k)
        mbs, max_load = packing._karmarkar_karp_py(seqlens, k)
        assert mbs == expected, f"seed {fresh_seed}"
        assert max_load == _max_load(mbs, seqlens)
        if _C is not None:
            native = _C.karmarkar_karp(np.asarray(seqlens, dtype=np.int64), k)
            assert native == expected, f"seed {fresh_seed}"


def test_kk_uses_first_k_that_fits(impl, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for _ in range(150):
        seqlens, _, budget = _random_case(rng, max_n=60)
        min_mbs = int(rng.integers(1, 6))
        mbs = partition_balanced(seqlens, budget, method="kk", min_num_mbs=min_mbs)
        n = len(seqlens)
        if n == 0:
            assert mbs == []
            continue
        k = min(max(min_mbs, -(-int(seqlens.sum()) // budget)), n)
        while k < n and packing._karmarkar_karp_py(seqlens.tolist(), k)[1] > budget:
            k += 1
        assert len(mbs) == k, f"seed {fresh_seed}"
        assert len(mbs) >= min(min_mbs, n)
        _assert_valid_partition(mbs, seqlens, budget, seed=fresh_seed)


def test_kk_balance_no_worse_than_greedy():
    """LDM beats greedy (LPT) on most instances; it is not a per-instance guarantee."""
    rng = np.random.default_rng(4)
    kk_total = greedy_total = kk_wins = greedy_wins = 0
    for _ in range(400):
        n = int(rng.integers(2, 150))
        seqlens = rng.integers(1, int(rng.integers(2, 5000)), size=n).tolist()
        k = int(rng.integers(2, min(n, 32) + 1))
        kk = packing._karmarkar_karp_py(seqlens, k)[1]
        greedy = _lpt_max_load(seqlens, k)
        kk_total += kk
        greedy_total += greedy
        kk_wins += kk < greedy
        greedy_wins += greedy < kk
        # Never far off: LDM's worst case is within 4/3 of optimal, greedy's too.
        assert kk <= greedy * 4 / 3 + 1
    assert kk_total <= greedy_total
    assert kk_wins > greedy_wins


def test_kk_balances_loads_better_than_ffd(impl):
    rng = np.random.default_rng(5)
    seqlens = rng.integers(1, 4097, size=3000)
    budget = 16384
    kk = partition_balanced(seqlens, budget, method="kk")
    ffd = partition_balanced(seqlens, budget, method="ffd")
    kk_loads = [int(seqlens[mb].sum()) for mb in kk]
    ffd_loads = [int(seqlens[mb].sum()) for mb in ffd]
    assert max(kk_loads) - min(kk_loads) < 0.1 * budget
    assert max(kk_loads) - min(kk_loads) < max(ffd_loads) - min(ffd_loads)
    assert len(kk) <= len(ffd) + 2


@needs_native
@pytest.mark.parametrize("method", ["kk", "ffd"])
def test_native_and_python_give_identical_partitions(method, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for trial in range(400):
        seqlens, group_ids, budget = _random_case(rng, zeros=trial % 3 == 0, groups=trial % 2 == 1)
        if trial % 5 == 0:
            seqlens = seqlens // 300 * 300  # many ties
            budget = max(budget, 1)
        min_mbs = int(rng.integers(1, 8))
        py_groups = None if group_ids is None else group_ids.tolist()
        expected = packing._partition_py(method, seqlens.tolist(), py_groups, budget, min_mbs)
        if method == "kk":
            got = _C.partition_kk(seqlens, budget, min_mbs, group_ids=group_ids)
        else:
            got = _C.partition_ffd(seqlens, budget, group_ids=group_ids)
        assert got == expected, f"seed {fresh_seed}"


@needs_native
def test_native_and_python_agree_on_a_large_grouped_batch(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    seqlens = rng.integers(1, 2049, size=4000)
    group_ids = np.repeat(np.arange(500), 8)
    rng.shuffle(group_ids)
    for method in ("kk", "ffd"):
        native = (
            _C.partition_kk(seqlens, 32768, 1, group_ids=group_ids)
            if method == "kk"
            else _C.partition_ffd(seqlens, 32768, group_ids=group_ids)
        )
        python = packing._partition_py(method, seqlens.tolist(), group_ids.tolist(), 32768)
        assert native == python, f"seed {fresh_seed}"
        _assert_valid_partition(native, seqlens, 32768, group_ids, fresh_seed)


def test_groups_stay_together(impl):
    seqlens = [5, 5, 5, 5, 1, 1, 9, 2]
    group_ids = [7, 7, 3, 3, 7, 3, 1, 1]
    for method in ("kk", "ffd"):
        mbs = partition_balanced(seqlens, 12, method=method, group_ids=group_ids)
        _assert_valid_partition(mbs, seqlens, 12, np.asarray(group_ids))
        assert sorted(mbs) == [[0, 1, 4], [2, 3, 5], [6, 7]]


def test_small_cases(impl):
    assert partition_balanced([], 10) == []
    assert partition_balanced([], 10, method="ffd") == []
    assert partition_balanced(np.zeros(0, dtype=np.int64), 10, group_ids=[]) == []
    assert partition_balanced([10], 10) == [[0]]
    assert partition_balanced([0, 0, 0], 1) == [[0, 1, 2]]
    two = partition_balanced([0, 0, 0], 1, min_num_mbs=2)
    assert len(two) == 2
    _assert_valid_partition(two, [0, 0, 0], 1)
    assert partition_balanced([3, 3, 3], 9, min_num_mbs=5) == [[0], [1], [2]]
    assert partition_balanced([3, 3, 3], 9, method="ffd") == [[0, 1, 2]]
    assert partition_balanced([6, 5, 4, 3], 9, method="ffd") == [[0, 3], [1, 2]]


def test_input_types_give_the_same_result(impl):
    seqlens = [700, 12, 300, 300, 999, 1, 0, 450]
    expected = partition_balanced(seqlens, 1000)
    assert partition_balanced(np.asarray(seqlens, dtype=np.int32), 1000) == expected
    assert partition_balanced(torch.tensor(seqlens), 1000) == expected
    assert partition_balanced(torch.tensor(seqlens, dtype=torch.int32), np.int64(1000)) == expected
    assert partition_balanced(tuple(seqlens), 1000, group_ids=torch.arange(8)) == expected


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (
            dict(seqlens=[1, 2, 5000], max_tokens_per_mb=4096),
            ValueError,
            "seqlens[2] = 5000 exceeds max_tokens_per_mb = 4096",
        ),
        (dict(seqlens=[1, -2, 3], max_tokens_per_mb=10), ValueError, "seqlens[1] = -2 is negative"),
        (
            dict(seqlens=[1, 2], max_tokens_per_mb=0),
            ValueError,
            "max_tokens_per_mb must be positive",
        ),
        (dict(seqlens=[1, 2], max_tokens_per_mb=10, min_num_mbs=0), ValueError, "min_num_mbs"),
        (dict(seqlens=[1, 2], max_tokens_per_mb=10, method="greedy"), ValueError, "method"),
        (
            dict(seqlens=[6, 6, 1], max_tokens_per_mb=10, group_ids=[4, 4, 5]),
            ValueError,
            "group 4 (first at seqlens[0]) has 12 tokens, exceeding max_tokens_per_mb = 10",
        ),
        (dict(seqlens=[6, 6, 1], max_tokens_per_mb=10, group_ids=[4, 4]), ValueError, "group_ids"),
        (dict(seqlens=[[1, 2]], max_tokens_per_mb=10), ValueError, "seqlens must be 1-D"),
        (dict(seqlens=[1.5, 2.0], max_tokens_per_mb=10), TypeError, "seqlens"),
        (dict(seqlens=torch.ones(3), max_tokens_per_mb=10), TypeError, "seqlens"),
        (dict(seqlens=[1, 2], max_tokens_per_mb=10.0), TypeError, "max_tokens_per_mb"),
        (dict(seqlens=[1, 2], max_tokens_per_mb=10, group_ids=[0.5, 1.0]), TypeError, "group_ids"),
    ],
)
@pytest.mark.parametrize("method", ["kk", "ffd"])
def test_bad_inputs_raise(impl, kwargs, exc, message, method):
    kwargs = dict(kwargs)
    kwargs.setdefault("method", method)
    seqlens = kwargs.pop("seqlens")
    budget = kwargs.pop("max_tokens_per_mb")
    with pytest.raises(exc) as info:
        partition_balanced(seqlens, budget, **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------
# cu_seqlens / position_ids
# ---------------------------------------------------------------------------


def test_cu_seqlens_from_lengths(impl, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for n in (0, 1, 2, 17, 1003):
        lengths = rng.integers(0, 500, size=n)
        expected = np.concatenate([[0], np.cumsum(lengths)])
        for given in (lengths, lengths.tolist(), torch.from_numpy(lengths).to(torch.int32)):
            out = cu_seqlens_from_lengths(given)
            assert out.dtype == torch.int32 and out.shape == (n + 1,)
            assert out.tolist() == expected.tolist()


def test_cu_seqlens_from_lengths_errors(impl):
    with pytest.raises(ValueError, match=r"lengths\[2\] = -1 is negative"):
        cu_seqlens_from_lengths([3, 4, -1, 5])
    with pytest.raises(ValueError, match=r"int32 range of cu_seqlens at lengths\[2\]"):
        cu_seqlens_from_lengths([2**30, 2**30 - 1, 1, -5])
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        cu_seqlens_from_lengths(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="lengths"):
        cu_seqlens_from_lengths([1.0, 2.0])


def _position_ids_reference(cu):
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        out.extend(range(b - a))
    return out


def test_position_ids_from_cu_seqlens(impl, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for n in (0, 1, 3, 64, 257):
        lengths = rng.integers(0, 300, size=n)
        lengths[rng.random(n) < 0.2] = 0  # empty sequences
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        expected = _position_ids_reference(cu.tolist())
        for given in (cu, cu.astype(np.int64), torch.from_numpy(cu), cu.tolist()):
            out = position_ids_from_cu_seqlens(given)
            assert out.dtype == torch.int64 and out.shape == (int(cu[-1]),)
            assert out.tolist() == expected


def test_position_ids_roundtrip_with_partition(impl):
    seqlens = [5, 1, 7, 3]
    cu = cu_seqlens_from_lengths(seqlens)
    assert position_ids_from_cu_seqlens(cu).tolist() == [
        0,
        1,
        2,
        3,
        4,
        0,
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        0,
        1,
        2,
    ]


@pytest.mark.parametrize(
    "cu, message",
    [
        ([], "at least one element"),
        ([1, 3, 5], "cu_seqlens[0] must be 0, got 1"),
        (
            [0, 3, 2, 5],
            "cu_seqlens must be non-decreasing, but cu_seqlens[2] = 2 < cu_seqlens[1] = 3",
        ),
    ],
)
def test_position_ids_errors(impl, cu, message):
    with pytest.raises(ValueError) as info:
        position_ids_from_cu_seqlens(np.asarray(cu, dtype=np.int32))
    assert message in str(info.value)


# ---------------------------------------------------------------------------
# Loading the extension
# ---------------------------------------------------------------------------


def test_disable_env_forces_python(monkeypatch):
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.load_native() is None
    monkeypatch.setenv(_native.DISABLE_ENV, "0")
    assert _native.load_native() is _C


def test_failed_import_warns_once(monkeypatch):
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.delenv(_native.REQUIRE_ENV, raising=False)  # CI sets it
    monkeypatch.setitem(sys.modules, "areal_fast._C", None)  # makes the import fail
    monkeypatch.delattr("areal_fast._C", raising=False)
    _native._import_native.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _native.load_native() is None
            assert _native.load_native() is None
            assert partition_balanced([3, 4, 5], 8) == [[0, 1], [2]]
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert "native extension is unavailable" in messages[0]
        assert "Python implementation" in messages[0]
    finally:
        _native._import_native.cache_clear()
