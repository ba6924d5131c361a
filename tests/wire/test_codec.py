"""The msgpack wire format of controller messages and shard transfers: exact round trips,
whitelisted types only, nothing unpickled."""

from __future__ import annotations

import os
import pickle
import random
import secrets
from multiprocessing import AuthenticationError

import msgpack
import pytest
import torch

from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import SamplingParams
from areal_fast.sync.cuda_slots import CudaSlotSpec, encode_share
from areal_fast.sync.shared_memory import WeightBufferSpec, WeightEntry
from areal_fast.sync.slot_broadcast import WeightLink
from areal_fast.wire import messages as msg
from areal_fast.wire.codec import MESSAGE_TYPES, CodecError, decode_message, encode_message
from areal_fast.wire.shard_io import shard_tensors
from areal_fast.wire.shards import (
    DistributedBatch,
    ShardMetadata,
    ShardStore,
    TensorMetadata,
    fetch_shards,
    tensor_metadata,
)


def _shard(rng: random.Random, node: str = "rollout-0") -> ShardMetadata:
    n = rng.randint(3, 50)
    fields = {
        "input_ids": TensorMetadata((n,), "int64"),
        "rewards": TensorMetadata((rng.randint(2, 8),), "float32"),
    }
    return ShardMetadata(
        node,
        f"127.0.0.1:{rng.randint(1024, 65535)}",
        rng.randint(0, 10**6),
        rng.randint(2, 8),
        0,
        fields,
    )


def _examples(rng: random.Random) -> list:
    params = SamplingParams(
        n=rng.randint(1, 8),
        temperature=rng.random() + 0.1,
        top_p=rng.uniform(0.5, 1.0),
        max_new_tokens=rng.randint(1, 99),
    )
    request = msg.GroupRequest(
        rng.randint(0, 10**9),
        [rng.randint(0, 50000) for _ in range(17)],
        params,
        rng.getrandbits(63),
        answer="42",
        uid="q-7",
        data={"question": "1+1?", "answer": "2", "nested": [1, {"a": None}]},
    )
    entries = tuple(
        WeightEntry(f"layers.{i}.w", (rng.randint(1, 9), 3), "float32", 256 * i, 36)
        for i in range(3)
    )
    buffer = WeightBufferSpec("/dev/shm/x", 4096, entries)
    share = encode_share((0, secrets.token_bytes(64), 4096, 512, b"/torch_1_2", 3, bytes(64), True))
    twin = WeightBufferSpec("/dev/shm/y", 4096, entries, CudaSlotSpec("GPU-8f2e", 4096, share))
    shards = [_shard(rng) for _ in range(3)]
    done = msg.GroupDone(
        shards[0],
        5,
        [rng.random(), 1.0, float("-inf")],
        [3, 4, 5],
        ["stop", "length", "abort"],
        2,
        {"agent/sessions": 3},
        ["timeout: slow"],
    )
    return [
        request,
        msg.SubmitGroups([request, request]),
        msg.UpdateWeights(7, buffer),
        msg.DropShards([1, 2, 3]),
        msg.Evaluate([request]),
        msg.CancelAll(),
        msg.Shutdown(),
        msg.WorkerReady("rollout-1", "127.0.0.1:5000", (buffer, buffer)),
        msg.WorkerReady("trainer", weight_buffers=(twin, twin), gpu_uuid="GPU-8f2e"),
        msg.UpdateWeights(8, twin),
        msg.SlotReaders(host=False),
        done,
        msg.GroupDone(None, 6, [], [], [], 0),
        msg.WeightsUpdated(3, rng.random()),
        msg.EvalDone([{"uid": "a", "correct": True}]),
        msg.Cancelled(4),
        msg.WorkerFailed("trainer", "RuntimeError: boom"),
        msg.TrainStep(DistributedBatch(shards), slot=1),
        msg.StepDone(
            3, {"loss": rng.random(), "staleness_hist": [4, 0, 2]}, [1, 2], 77, 0.1, 0.2, 0.3
        ),
        msg.SaveCheckpoint("/tmp/ckpt"),
        msg.Saved("/tmp/ckpt"),
        msg.SaveState("/tmp/state"),
        msg.StateSaved("/tmp/state", 4),
        msg.ConnectWeights(
            "rollout-1", WeightLink("broadcast", "rollout-1-ab12-3", "10.0.0.7:4711", "", 30.5)
        ),
    ]


def test_every_message_round_trips_exactly(fresh_seed):
    rng = random.Random(fresh_seed)
    examples = _examples(rng)
    sent_types = {type(m).__name__ for m in examples}
    # every message dataclass of the messages module is exercised
    missing = {n for n, c in MESSAGE_TYPES.items() if c.__module__ == msg.__name__} - sent_types
    assert not missing, missing
    for message in examples:
        back = decode_message(encode_message(message))
        assert type(back) is type(message)
        assert back == message  # dataclass equality: every field, nested, tuples as tuples
    spec = decode_message(encode_message(examples[2])).buffer
    assert isinstance(spec.entries, tuple) and isinstance(spec.entries[0].shape, tuple)


def test_unknown_types_and_bad_fields_are_refused():
    with pytest.raises(TypeError, match="cannot send a Random"):
        encode_message(msg.EvalDone([{"rng": random.Random()}]))
    evil = msgpack.packb({"__t": "Popen", "args": ["touch", "/tmp/x"]})
    with pytest.raises(CodecError, match="unknown message type 'Popen'"):
        decode_message(evil)
    with pytest.raises(CodecError, match="bad Cancelled message"):
        decode_message(msgpack.packb({"__t": "Cancelled", "groups": 1, "extra": 2}))


def test_pickle_bytes_are_never_executed(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(CodecError):
        decode_message(pickle.dumps(Evil()))
    assert not marker.exists()


def test_shard_transfer_is_exact_and_raw(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    trajectories = []
    for i in range(3):
        prompt = torch.randint(
            0, 1000, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen
        ).tolist()
        n = int(torch.randint(1, 12, (1,), generator=gen))
        out = torch.randint(0, 1000, (n,), generator=gen).tolist()
        logps = (-torch.rand(n, generator=gen)).tolist()
        trajectories.append(
            Trajectory(prompt, out, logps, [i] * n, "stop", 9, float(torch.rand(1, generator=gen)))
        )
    tensors = shard_tensors(trajectories)
    authkey = secrets.token_bytes(32)
    store = ShardStore(authkey)
    store.start()
    try:
        store.put(9, tensors)
        shard = ShardMetadata("rollout-0", store.address, 9, 3, 0, tensor_metadata(tensors))
        (got,) = fetch_shards(DistributedBatch([shard]), authkey, timeout=10)
        assert got.keys() == tensors.keys()
        for key, value in tensors.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        with pytest.raises(RuntimeError, match="shard 9 is not held"):
            fetch_shards(DistributedBatch([shard]), authkey, timeout=10)
        store.put(9, tensors)
        with pytest.raises(AuthenticationError):  # a peer without the job's key gets no data
            fetch_shards(DistributedBatch([shard]), secrets.token_bytes(32), timeout=10)
        assert len(store) == 1
    finally:
        store.close()
