"""CUDA weight slots (sync/cuda_slots.py, sync/trainer_slots.py) and the choice of each worker's
weight path (sync/config.py): on the CPU the choice, the export's JSON round trip through the
controller codec (no pickle), its checks, and the trainer's slots without a GPU; on a GPU a
slot written by the trainer and installed by an HF engine in a second process, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import secrets
import zlib

import pytest
import torch

from areal_fast.sync.config import SyncConfig, choose_transport, cuda_slots_usable
from areal_fast.sync.cuda_slots import (
    CudaWeightSlot,
    decode_share,
    encode_share,
    engine_gpu,
    slot_gpu,
)
from areal_fast.sync.shared_memory import CudaSlotSpec, SharedWeightBuffer
from areal_fast.sync.slot_broadcast import buffer_checksum
from areal_fast.sync.trainer_slots import TrainerSlots, cast_weights
from areal_fast.wire import messages as msg
from areal_fast.wire.codec import decode_message, encode_message

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_A, GPU_B = "GPU-1b4e7c1a-0000-0000-0000-00000000000a", "GPU-9d3f-b"


def _fields(seed: int) -> tuple:
    """Fields shaped like UntypedStorage._share_cuda_()'s: random handles and counters."""
    rng = torch.Generator().manual_seed(seed)
    size = int(torch.randint(256, 1 << 30, (1,), generator=rng))
    return (
        int(torch.randint(0, 8, (1,), generator=rng)),
        secrets.token_bytes(64),
        size,
        512 * int(torch.randint(0, 99, (1,), generator=rng)),
        f"/torch_{seed}_{secrets.token_hex(5)}".encode(),
        int(torch.randint(0, 10_000, (1,), generator=rng)),
        secrets.token_bytes(64),
        bool(seed % 2),
    )


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(97, 24, generator=gen)),
        ("odd", torch.randn(5, 123, generator=gen)),
        ("steps", torch.arange(7)),  # an integer buffer keeps its dtype
        ("vec", torch.randn(1003, generator=gen)),
    ]


# ------------------------------------------------------------------- choice of the weight path


def test_auto_takes_cuda_ipc_only_for_an_engine_on_the_trainers_gpu():
    assert choose_transport("auto", "local", "local", GPU_A, GPU_A) == "cuda_ipc"
    assert choose_transport("auto", "local", "local", GPU_B, GPU_A) == "shm"  # another GPU
    assert choose_transport("auto", "local", "local", "", GPU_A) == "shm"  # a CPU engine
    assert choose_transport("auto", "local", "local", GPU_A, "") == "shm"  # a CPU trainer
    assert choose_transport("auto", "local", "local", "", "") == "shm"  # both on the CPU
    assert choose_transport("auto", "n2", "n1", GPU_A, GPU_A) == "broadcast"  # other node
    assert choose_transport("auto", "n2", "n1") == "broadcast"
    for forced in ("shm", "broadcast", "disk"):  # forced paths stay as they are
        assert choose_transport(forced, "local", "local", GPU_A, GPU_A) == forced
    assert choose_transport("cuda_ipc", "local", "local", GPU_A, GPU_A) == "cuda_ipc"


@pytest.mark.parametrize(
    "worker_node, worker_gpu, trainer_gpu, why",
    [
        ("local", "", "", "the trainer keeps no CUDA slots"),
        ("local", GPU_A, "", "the trainer keeps no CUDA slots"),
        ("local", "", GPU_A, "not an in-process engine on a CUDA device"),
        ("local", GPU_B, GPU_A, f"engine is on GPU {GPU_B}, the trainer on GPU {GPU_A}"),
        ("n2", GPU_A, GPU_A, "the worker runs on node n2, the trainer on node local"),
    ],
)
def test_forced_cuda_ipc_that_cannot_work_is_one_line(worker_node, worker_gpu, trainer_gpu, why):
    with pytest.raises(ValueError) as info:
        choose_transport("cuda_ipc", worker_node, "local", worker_gpu, trainer_gpu)
    text = str(info.value)
    assert text.startswith("sync.transport = 'cuda_ipc' needs the engine on the trainer's GPU")
    assert why in text and "\n" not in text


def test_a_worker_maps_cuda_slots_as_the_choice_says():
    for setting in ("auto", "cuda_ipc"):
        assert cuda_slots_usable(setting, GPU_A, GPU_A)
        assert not cuda_slots_usable(setting, GPU_A, GPU_B)
        assert not cuda_slots_usable(setting, "", "")
    for setting in ("shm", "broadcast", "disk"):
        assert not cuda_slots_usable(setting, GPU_A, GPU_A)
    assert SyncConfig(transport="cuda_ipc").transport == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda_ipc"):  # the message lists it
        SyncConfig(transport="cuda")


def test_engines_report_a_gpu_only_when_they_copy_from_cuda_slots():
    class CpuEngine:
        device = torch.device("cpu")

    class ServingEngine:  # maps host slots itself, in other processes
        device = torch.device("cuda", 0)

        def update_weights_from_buffer(self, spec, version):
            pass

    assert engine_gpu(CpuEngine()) == engine_gpu(ServingEngine()) == engine_gpu(object()) == ""


# ------------------------------------------------------------------ the export, as JSON only


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_export_round_trips_through_the_codec_without_pickle(seed, monkeypatch):
    fields = _fields(seed)
    text = encode_share(fields)
    assert decode_share(text) == fields
    host = SharedWeightBuffer.create(_weights(seed))
    try:
        from dataclasses import replace

        spec = replace(host.spec, cuda=CudaSlotSpec(GPU_A, host.spec.total_bytes, text))

        def no_pickle(*args, **kwargs):
            raise AssertionError("unpickled")

        monkeypatch.setattr(pickle, "loads", no_pickle)
        monkeypatch.setattr(pickle, "load", no_pickle)
        back = decode_message(encode_message(msg.UpdateWeights(seed, spec))).buffer
    finally:
        host.close()
    assert back == spec and isinstance(back.cuda, CudaSlotSpec)
    assert slot_gpu(back) == GPU_A and slot_gpu(host.spec) == ""
    assert decode_share(back.cuda.share) == fields
    assert [type(v) for v in decode_share(back.cuda.share)] == [type(v) for v in fields]


@pytest.mark.parametrize(
    "text, field",
    [
        ("not json", "not JSON"),
        ("{}", "a list of 8 fields"),
        ("[1, 2]", "a list of 8 fields"),
        ('[0, "x", 1, 0, {"b64": ""}, 0, {"b64": ""}, true]', "'handle' is not {'b64': text}"),
        ('[0, {"b64": "@@"}, 1, 0, {"b64": ""}, 0, {"b64": ""}, true]', "'handle' is not base64"),
        ('[0, {"b64": "", "x": 1}, 1, 0, {"b64": ""}, 0, {"b64": ""}, 1]', "'handle'"),
        ('[true, {"b64": ""}, 1, 0, {"b64": ""}, 0, {"b64": ""}, true]', "'device' is bool"),
        ('[0, {"b64": ""}, -1, 0, {"b64": ""}, 0, {"b64": ""}, true]', "'size_bytes' is int"),
        ('[0, {"b64": ""}, 1, 0, {"b64": ""}, 0, {"b64": ""}, 1]', "'event_sync_required'"),
    ],
)
def test_a_malformed_export_is_one_line_naming_the_field(text, field):
    with pytest.raises(ValueError) as info:
        decode_share(text)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_an_export_of_the_wrong_shape_is_refused_before_encoding():
    with pytest.raises(ValueError, match="7 fields"):
        encode_share(_fields(1)[:7])
    with pytest.raises(ValueError, match="'handle' is NoneType"):
        encode_share((0, None, 0, 0, b"x", 0, b"y", False))


def test_a_slot_without_cuda_twin_is_not_mapped():
    host = SharedWeightBuffer.create(_weights(4))
    try:
        with pytest.raises(ValueError, match="has no CUDA twin"):
            CudaWeightSlot.attach(host.spec)
    finally:
        host.close()


def test_a_slot_is_made_on_a_cuda_device_and_mapped_only_from_a_whole_visible_export():
    from dataclasses import replace

    from areal_fast.sync.transports import WeightSyncError

    host = SharedWeightBuffer.create(_weights(8))
    try:
        with pytest.raises(ValueError, match="device cpu is not a CUDA device"):
            CudaWeightSlot.create(host.spec, "cpu")
        n = host.spec.total_bytes
        short = list(_fields(8))
        short[2] = n - 1
        spec = replace(host.spec, cuda=CudaSlotSpec(GPU_A, n, encode_share(short)))
        with pytest.raises(ValueError, match=f"holds {n - 1} bytes, the layout needs {n}"):
            CudaWeightSlot.attach(spec)
        whole = list(_fields(8))
        whole[2] = n
        spec = replace(host.spec, cuda=CudaSlotSpec(GPU_A, n, encode_share(whole)))
        with pytest.raises(WeightSyncError, match=f"GPU {GPU_A} is not visible"):
            CudaWeightSlot.attach(spec)  # no GPU here has that UUID
    finally:
        host.close()


def test_with_cuda_twins_the_host_slots_are_written_only_while_someone_reads_them(monkeypatch):
    """The publishing logic over CUDA slots, with CPU buffers standing in for device memory."""
    from dataclasses import replace

    monkeypatch.setattr(CudaWeightSlot, "finish_write", lambda self: None)
    named = _weights(9)
    host = [SharedWeightBuffer.create(cast_weights(named, torch.bfloat16)) for _ in range(2)]
    twins = [
        CudaWeightSlot(
            replace(h.spec, cuda=CudaSlotSpec(GPU_A, h.spec.total_bytes, encode_share(_fields(i)))),
            torch.zeros(h.spec.total_bytes, dtype=torch.uint8),
            owner=True,
        )
        for i, h in enumerate(host)
    ]
    slots = TrainerSlots(host, twins, torch.bfloat16)
    try:
        assert slots.gpu_uuid == GPU_A and [slot_gpu(s) for s in slots.specs] == [GPU_A] * 2
        empty = buffer_checksum(host[1])
        slots.host_readers = False
        slots.publish(iter(named), 1)
        assert buffer_checksum(host[1]) == empty  # not written
        assert slots.checksum(1) == _crc(cast_weights(named, torch.bfloat16)) != empty
        slots.host_readers = True
        slots.publish(iter(named), 1)
        assert buffer_checksum(host[1]) == slots.checksum(1)  # the same bytes in both
    finally:
        slots.close()


# --------------------------------------------------------------- the trainer's slots, on CPU


def test_cpu_trainer_slots_are_host_slots_in_the_engines_dtype():
    named = _weights(5)
    slots = TrainerSlots.start(iter(named), 3, leader=True, cuda_twins=True, dtype="bfloat16")
    try:
        assert slots and not slots.cuda and slots.gpu_uuid == ""
        assert [s.cuda for s in slots.specs] == [None, None]
        assert [s.path for s in slots.specs] == [h.spec.path for h in slots.host]
        dtypes = {e.name: e.dtype for e in slots.specs[1].entries}
        assert dtypes == {
            "embed": "bfloat16",
            "odd": "bfloat16",
            "steps": "int64",
            "vec": "bfloat16",
        }
        expected = list(cast_weights(named, torch.bfloat16))
        start = dict(slots[1].named_tensors())  # version 3 in slot 1
        for name, tensor in expected:
            assert torch.equal(start[name], tensor)
        newer = [(n, t + 1 if t.is_floating_point() else t) for n, t in named]
        slots.publish(iter(newer), 0)
        for name, tensor in cast_weights(newer, torch.bfloat16):
            assert torch.equal(dict(slots[0].named_tensors())[name], tensor)
        assert slots.checksum(0) == buffer_checksum(slots[0]) != slots.checksum(1)
    finally:
        slots.close()


def test_other_ranks_take_part_in_the_gather_and_keep_nothing():
    taken = []

    def gather():
        for name, tensor in _weights(6):
            taken.append(name)
            yield name, tensor

    slots = TrainerSlots.start(gather(), 0, leader=False, cuda_twins=True)
    assert not slots and slots.specs == () and slots.checksum(0) == ""
    slots.publish(gather(), 1)
    assert taken == ["embed", "odd", "steps", "vec"] * 2
    slots.close()


# ----------------------------------------------------------------------------- on a GPU


def _crc(named) -> str:
    value = 0
    for _, tensor in named:
        value = zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy(), value)
    return f"{value:08x}"


@pytest.mark.cuda
@CUDA
def test_trainer_cuda_slots_without_host_readers_write_the_device_only():
    named = [(n, t.cuda()) for n, t in _weights(7)]
    slots = TrainerSlots.start(iter(named), 0, leader=True, cuda_twins=True, dtype="bfloat16")
    try:
        assert len(slots.cuda) == 2 and slots.gpu_uuid
        assert all(slot_gpu(s) == slots.gpu_uuid for s in slots.specs)
        assert all(s.cuda.nbytes == s.total_bytes for s in slots.specs)
        slots.host_readers = False
        newer = [(n, t * 2 if t.is_floating_point() else t) for n, t in named]
        slots.publish(iter(newer), 1)
        assert _crc(slots.cuda[1].named_tensors()) == _crc(cast_weights(newer, torch.bfloat16))
        assert _crc(slots.host[1].named_tensors()) != _crc(slots.cuda[1].named_tensors())
        slots.host_readers = True
        slots.publish(iter(named), 1)
        assert buffer_checksum(slots.host[1]) == buffer_checksum(slots.cuda[1]) == slots.checksum(1)
    finally:
        slots.close()


@pytest.mark.cuda
@CUDA
def test_an_hf_engine_in_another_process_installs_cuda_slots_bit_exactly(tiny_model_dir):
    from cuda_slot_procs import engine_installs

    from areal_fast.models.loading import load_causal_lm

    trainer = load_causal_lm(str(tiny_model_dir), "float32", device="cuda")  # master weights
    params = list(trainer.named_parameters())
    slots = TrainerSlots.start(iter(params), 0, leader=True, cuda_twins=True, dtype="bfloat16")
    slots.host_readers = False
    expected, updates = {}, []
    try:
        for version in (1, 2):  # into slots 1 and 0, as the job does
            with torch.no_grad():
                for _, p in params:
                    p.add_(0.01 * version)
            slots.publish(iter(params), version % 2)
            expected[version] = _crc(cast_weights(params, torch.bfloat16))
            updates.append(encode_message(msg.UpdateWeights(version, slots.specs[version % 2])))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=engine_installs, args=(str(tiny_model_dir), updates, out))
        child.start()
        got = [out.get(timeout=300) for _ in updates]
        child.join(timeout=60)
    finally:
        slots.close()
    assert child.exitcode == 0, got
    for version, crc, seconds in got:
        assert version != "error", crc
        assert crc == expected[version] and 0 < seconds < 60
