"""Buckets of one plan_layout buffer move in place: no pack on the trainer, no unpack on the
engine, over gloo between real processes (one trainer, two engines).

Every tensor and every padding byte is fresh random data each run; engines compare bytes. The
counts of buckets sent from the source's memory (``SyncStats.direct_buckets``) and received in
place (``ReceiveSession.in_place_buckets``) show which path each bucket took.
"""

from __future__ import annotations

import random

import pytest
from sync_procs import LAYOUT_SPECS, run_ranks, sync_layout

from areal_fast.sync.buckets import TensorSpec, plan_buckets


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


def _plan(bucket_bytes: int, solo_bytes: int):
    specs = [TensorSpec(n, s, str(d).removeprefix("torch.")) for n, s, d in LAYOUT_SPECS]
    plan = plan_buckets(specs, bucket_bytes, solo_bytes)
    single = sum(
        1
        for k in range(plan.num_buckets)
        if len([c for c in plan.bucket_chunks(k) if c.numel > 0]) == 1
    )
    split = [s.name for s in specs if sum(c.tensor == specs.index(s) for c in plan.chunks) > 1]
    return plan, single, split


def _ok(reports):
    for rank, report in enumerate(reports):
        assert report is not None, f"rank {rank} sent no report"
        assert "trace" not in report, f"rank {rank} failed:\n{report['trace']}"


# (bucket_bytes, solo_bytes): one plan with the split tensor's tail sharing a bucket with four
# small tensors and a 0-element one, one with solo buckets
PLANS = [(8192, 0), (4096, 1000)]


@pytest.mark.parametrize("bucket_bytes,solo_bytes", PLANS)
def test_layout_buffers_move_without_pack_or_unpack(bucket_bytes, solo_bytes):
    # engine 1 declares its layout buffer; engine 2 has the same buffer but does not, so only
    # its one-tensor buckets arrive in place and its padding bytes stay untouched
    plan, single, split = _plan(bucket_bytes, solo_bytes)
    assert split == ["big"] and 0 < single < plan.num_buckets
    engines = {1: ("flat", True), 2: ("flat", False)}
    reports = run_ranks(
        sync_layout, 3, (_seed(), "flat", engines, bucket_bytes, solo_bytes), timeout=180
    )
    _ok(reports)
    n = plan.num_buckets
    assert reports[0]["stats"] == [{"buckets": n, "direct": n}] * 2  # no bucket packed
    flagged, plain = reports[1], reports[2]
    assert flagged["mismatch"] == [] and plain["mismatch"] == []
    assert flagged["in_place"] == [n, n] and flagged["unpacked"] == [0, 0]
    assert plain["in_place"] == [single] * 2 and plain["unpacked"] == [n - single] * 2
    assert plain["padding_bytes"] > 0 and plain["padding_kept"] is True


def test_other_layouts_fall_back_to_packing_bit_exact():
    # the trainer's tensors are views of one buffer at other offsets (16-byte aligned, no
    # 256-byte padding): multi-tensor buckets are packed; engine 1 declares a buffer with
    # such offsets, engine 2 separate tensors: both unpack them, and stay exact
    bucket_bytes, solo_bytes = PLANS[0]
    plan, single, _ = _plan(bucket_bytes, solo_bytes)
    engines = {1: ("dense", True), 2: ("separate", True)}
    reports = run_ranks(
        sync_layout, 3, (_seed(), "dense", engines, bucket_bytes, solo_bytes), timeout=180
    )
    _ok(reports)
    n = plan.num_buckets
    assert reports[0]["stats"] == [{"buckets": n, "direct": single}] * 2
    for engine in reports[1:]:
        assert engine["mismatch"] == []
        assert engine["in_place"] == [single] * 2 and engine["unpacked"] == [n - single] * 2
    assert reports[1]["padding_bytes"] > 0 and reports[1]["padding_kept"] is True


def test_packed_buckets_land_in_place_in_a_layout_buffer():
    # separate trainer tensors are packed, yet engine 1's layout buffer takes every bucket
    # in place; engine 2 (other offsets, no declaration) unpacks and keeps its padding
    bucket_bytes, solo_bytes = PLANS[1]
    plan, single, _ = _plan(bucket_bytes, solo_bytes)
    engines = {1: ("flat", True), 2: ("dense", False)}
    reports = run_ranks(
        sync_layout, 3, (_seed(), "separate", engines, bucket_bytes, solo_bytes), timeout=180
    )
    _ok(reports)
    n = plan.num_buckets
    assert reports[0]["stats"] == [{"buckets": n, "direct": single}] * 2
    assert reports[1]["mismatch"] == [] and reports[2]["mismatch"] == []
    assert reports[1]["in_place"] == [n, n] and reports[1]["unpacked"] == [0, 0]
    assert reports[2]["in_place"] == [single] * 2 and reports[2]["unpacked"] == [n - single] * 2
    assert reports[2]["padding_kept"] is True
