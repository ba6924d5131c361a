"""Multi-process weight sync on CPU: one trainer rank, two engine ranks, bit-exact checks.

Every scenario runs in spawned processes (see ``sync_procs.py``) with fresh random values
each run; engines rebuild the trainer's tensors from the shared seed and compare bytes.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from sync_procs import (
    BF16,
    FP32,
    run_ranks,
    sync_fsdp2,
    sync_hf_engines,
    sync_lora_adapter,
    sync_mixed,
    sync_partial_failure,
    sync_peer_dies,
    sync_rejected,
)

TRANSPORTS = ["gloo", "shm", "disk", "gloo-nccl-path"]


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


def _ok(reports):
    for rank, report in enumerate(reports):
        assert report is not None, f"rank {rank} sent no report"
        assert "trace" not in report, f"rank {rank} failed:\n{report['trace']}"


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_bit_exact_mixed_dtypes_two_engines(kind, tmp_path):
    # fp32 / bf16 / fp16 parameters, odd shapes, a 3001-element fp32 tensor (12 KB) over
    # 4 KB buckets, untied head; two versions in a row on the same transport.
    reports = run_ranks(
        sync_mixed, 3, (kind, str(tmp_path), _seed(), {}, {}, (False, False), None, 4096, 2)
    )
    _ok(reports)
    buckets, nbytes = reports[0]["stats"][0]
    assert buckets >= 4  # the big tensor alone spans three buckets
    for engine in reports[1:]:
        assert engine["versions"] == [1, 2]
        assert engine["mismatch"] == []


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_solo_tensors_travel_unpacked_bit_exact(wire, tmp_path):
    # solo_bytes 1000: embed, head (9312 B) and big (12004 B, split over 4 KB buckets) get
    # buckets of their own and go straight from parameter to parameter when dtypes allow
    names = ("embed", "odd", "f16", "b16", "big", "norm", "head")
    engine_dtypes = {k: BF16 for k in names} if wire else {}  # bf16 wire: bf16 engine
    reports = run_ranks(
        sync_mixed,
        3,
        ("gloo", str(tmp_path), _seed(), {}, engine_dtypes, (False, False), wire, 4096, 2, 1000),
    )
    _ok(reports)
    for engine in reports[1:]:
        assert engine["versions"] == [1, 2] and engine["mismatch"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_same_gpu_bit_exact(tmp_path):
    # the engine reads the trainer's buckets in place on the same GPU (device keyed by UUID)
    reports = run_ranks(
        sync_mixed, 2, ("cuda-ipc", str(tmp_path), _seed(), {}, {}, (True, True), None, 4096, 2)
    )
    _ok(reports)
    assert reports[1]["versions"] == [1, 2] and reports[1]["mismatch"] == []


@pytest.mark.parametrize("tied", [(True, True), (False, False)])
def test_tied_and_untied_heads(tied, tmp_path):
    reports = run_ranks(
        sync_mixed, 3, ("gloo", str(tmp_path), _seed(), {}, {}, tied, None, 1024, 1)
    )
    _ok(reports)
    for engine in reports[1:]:
        assert engine["mismatch"] == []
        assert engine["tied_alias"] is tied[1]
    # tied: the shared 97 x 24 fp32 matrix travels once
    sent = reports[0]["stats"][0][1]
    embed_bytes = 97 * 24 * 4
    others = 7 * 13 * 4 + 33 * 5 * 2 + 257 * 2 + 3001 * 4 + 4
    assert sent == others + embed_bytes * (1 if tied[0] else 2)


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_fp32_trainer_to_bf16_engine(wire, tmp_path):
    # receiver-side cast (wire None) and sender-side cast (wire bf16) give torch's rounding
    engine_dtypes = {k: BF16 for k in ("embed", "odd", "f16", "b16", "big", "norm", "head")}
    trainer_dtypes = {k: FP32 for k in engine_dtypes}
    reports = run_ranks(
        sync_mixed,
        3,
        (
            "gloo",
            str(tmp_path),
            _seed(),
            trainer_dtypes,
            engine_dtypes,
            (True, True),
            wire,
            2048,
            1,
        ),
    )
    _ok(reports)
    for engine in reports[1:]:
        assert engine["mismatch"] == []
    fp32_bytes = (97 * 24 + 7 * 13 + 33 * 5 + 257 + 3001 + 1) * 4
    assert reports[0]["stats"][0][1] == (fp32_bytes // 2 if wire else fp32_bytes)


@pytest.mark.parametrize("fault", ["name", "shape", "dtype"])
def test_bad_plan_rejected_everywhere_nothing_changes(fault, tmp_path):
    reports = run_ranks(sync_rejected, 3, ("gloo", str(tmp_path), _seed(), fault))
    assert reports[0]["type"] == "WeightSyncError"
    assert "engine rank 2" in reports[0]["error"]
    culprit = {
        "name": "'odd' is not a parameter",
        "shape": "'odd' has shape (7, 13)",
        "dtype": "'big' arrives as float32",
    }[fault]
    assert culprit in reports[0]["error"]
    for engine in reports[1:]:
        assert "rejected" in engine["error"] and culprit in engine["error"]
        assert engine["unchanged"]


@pytest.mark.parametrize("kind", ["gloo", "shm", "disk"])
def test_one_engine_fails_part_way_others_install_group_survives(kind, tmp_path):
    reports = run_ranks(sync_partial_failure, 3, (kind, str(tmp_path), _seed()))
    _ok(reports)
    assert "engine rank 1: injected unpack failure" in reports[0][1]
    assert reports[0][2] is None
    assert reports[1][1] == {"error": "injected unpack failure", "exact": False}
    assert reports[2][1] == {"error": "", "exact": True}
    for engine in reports[1:]:
        assert engine[2] == {"error": "", "exact": True}


def test_trainer_dies_mid_update_engines_refuse_to_serve(tmp_path):
    reports = run_ranks(sync_peer_dies, 3, ("gloo", str(tmp_path), _seed()), timeout=90)
    assert reports[0] is None  # the trainer died without reporting
    for engine in reports[1:]:
        assert engine["type"] in ("WeightSyncError", "WeightSyncTimeout"), engine
        assert engine["seconds"] < 15  # within the 10 s receiver timeout (+ slack)
        assert engine["served_after_failure"] is False
        assert "weights incomplete" in engine["refusal"]
        assert engine["version"] == 0


def test_hf_engines_bf16_receive_fp32_trainer(tmp_path):
    reports = run_ranks(sync_hf_engines, 3, ("gloo", str(tmp_path), _seed()))
    _ok(reports)
    assert reports[0]["buckets"] > 1
    for engine in reports[1:]:
        assert engine["version"] == 7
        assert engine["mismatch"] == []
        assert engine["tied"] is True
        assert engine["output_versions"] == [7]


def test_hf_engines_merge_a_bucketed_lora_adapter(tmp_path):
    reports = run_ranks(sync_lora_adapter, 3, ("gloo", str(tmp_path), _seed()))
    _ok(reports)
    assert reports[0]["buckets"] > 1
    assert reports[0]["names"] and all(
        n.endswith((".lora_A", ".lora_B")) for n in reports[0]["names"]
    )
    for engine in reports[1:]:
        assert engine["version"] == 5
        assert engine["worst"] < 1e-6


def test_fsdp2_source_two_trainer_ranks(tmp_path):
    reports = run_ranks(sync_fsdp2, 3, (str(tmp_path), _seed()))
    _ok(reports)
    assert reports[0]["sharded"] and reports[1]["sharded"]
    assert reports[0]["bytes"] > 0 and reports[1]["bytes"] == 0  # only rank 0 sends
    assert reports[2]["version"] == 3 and reports[2]["mismatch"] == []
    assert reports[0]["all_reduce"] == reports[1]["all_reduce"] == 2


def test_fsdp2_rejected_update_stops_every_training_rank(tmp_path):
    reports = run_ranks(sync_fsdp2, 3, (str(tmp_path), _seed(), True))
    _ok(reports)
    assert "rejected" in reports[0]["error"] and "'extra'" in reports[0]["error"]
    assert "stopped by the sending rank" in reports[1]["error"]
    assert reports[0]["all_reduce"] == reports[1]["all_reduce"] == 2  # group still in step
    assert "rejected" in reports[2]["error"]


# ---------------------------------------------------------------- disk transport, in-process


def _disk_pair(tmp_path, run_id="run-a"):
    from areal_fast.sync.transports import DiskTransport

    return (DiskTransport(str(tmp_path), 0, 2, run_id), DiskTransport(str(tmp_path), 1, 2, run_id))


def test_disk_reused_directory_never_serves_an_earlier_run(tmp_path):
    from sync_procs import Mixed

    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource
    from areal_fast.sync.transports import DiskTransport, WeightSyncTimeout

    sender_tp, receiver_tp = _disk_pair(tmp_path)
    model = Mixed({}, False).fill(_seed())
    thread = threading.Thread(
        target=lambda: WeightSender(sender_tp, bucket_bytes=4096, timeout=20).send(
            ModuleSource(model), 1
        )
    )
    thread.start()
    params = dict(Mixed({}, False).named_parameters())
    session = WeightReceiver(receiver_tp, timeout=20).start(lambda p: check_against(p, params))
    session.unpack_into([params.get(s.name) for s in session.plan.specs])
    session.finish()
    thread.join(timeout=30)
    with pytest.raises(ValueError, match="already holds updates of run 'run-a'"):
        DiskTransport(str(tmp_path), 0, 2, "run-a")
    later = DiskTransport(str(tmp_path), 1, 2, "run-b")  # a new job, no trainer yet
    with pytest.raises(WeightSyncTimeout, match="header of update 0"):
        WeightReceiver(later, timeout=0.3).start()


def test_disk_truncated_bucket_names_the_file(tmp_path):
    from sync_procs import Mixed

    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource
    from areal_fast.sync.transports import WeightSyncError

    sender_tp, receiver_tp = _disk_pair(tmp_path)
    real_write = sender_tp._write_atomic

    def truncating_write(path, write):
        if path.name != "bucket-1.safetensors":
            return real_write(path, write)

        def write_then_truncate(tmp):  # before the rename: a reader never sees it whole
            write(tmp)
            data = Path(tmp).read_bytes()
            Path(tmp).write_bytes(data[: len(data) // 2])

        real_write(path, write_then_truncate)

    sender_tp._write_atomic = truncating_write
    seed = _seed()
    errors = {}

    def send():
        try:
            WeightSender(sender_tp, bucket_bytes=4096, timeout=20).send(
                ModuleSource(Mixed({}, False).fill(seed)), 1
            )
        except WeightSyncError as exc:
            errors["sender"] = str(exc)

    thread = threading.Thread(target=send)
    thread.start()
    engine = Mixed({}, False).fill(seed + 1)
    params = dict(engine.named_parameters())
    session = WeightReceiver(receiver_tp, timeout=20).start(
        accept=lambda plan: check_against(plan, params)
    )
    with pytest.raises(WeightSyncError, match=r"bucket 1 file .*bucket-1\.safetensors"):
        session.unpack_into([params.get(s.name) for s in session.plan.specs])
    session.finish("bucket 1 damaged")
    thread.join(timeout=30)
    assert "engine rank 1: bucket 1 damaged" in errors["sender"]


def test_header_timeout_is_prompt_and_named(tmp_path):
    from areal_fast.sync.receiver import WeightReceiver
    from areal_fast.sync.transports import WeightSyncTimeout

    _, receiver_tp = _disk_pair(tmp_path)
    with pytest.raises(WeightSyncTimeout, match=r"header of update 0 .* within 0.3 s"):
        WeightReceiver(receiver_tp, timeout=0.3).start()


def test_receiver_rejects_sender_endpoint_and_bad_timeout(tmp_path):
    from areal_fast.sync.receiver import WeightReceiver
    from areal_fast.sync.sender import WeightSender

    sender_tp, receiver_tp = _disk_pair(tmp_path)
    with pytest.raises(ValueError, match="rank 0"):
        WeightReceiver(sender_tp)
    with pytest.raises(ValueError, match="timeout"):
        WeightReceiver(receiver_tp, timeout=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightSender(sender_tp, bucket_bytes=1000)


def test_source_maps_names_and_dedups_tied():
    from sync_procs import Mixed

    from areal_fast.sync.sources import ModuleSource

    model = Mixed({}, tied=True)
    source = ModuleSource(model, name_map=lambda n: None if n == "norm" else "model." + n)
    names = [s.name for s in source.specs()]
    assert "model.norm" not in names and "model.head.weight" not in names
    assert source.aliases == {"model.head.weight": "model.embed.weight"}
    with pytest.raises(ValueError, match="engine name 'x'"):
        ModuleSource(model, name_map=lambda n: "x")
    index = names.index("model.embed.weight")
    assert next(source.tensors([index])).data_ptr() == model.embed.weight.data_ptr()  # no copy
