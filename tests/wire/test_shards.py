"""DistributedBatch metadata, ShardStore / fetch_shards, assemble_packed_batch, and the
shared-memory weight buffers."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from pathlib import Path

import pytest
import torch

from areal_fast.rl.advantages import group_advantages
from areal_fast.rl.batch import (
    SEQ_FIELDS,
    TOKEN_FIELDS,
    PackedBatch,
    Trajectory,
    assemble_packed_batch,
    pack_trajectories,
)
from areal_fast.sync.shared_memory import ALIGNMENT, SharedWeightBuffer
from areal_fast.wire.shard_io import shard_tensors
from areal_fast.wire.shards import (
    DistributedBatch,
    ShardMetadata,
    ShardStore,
    TensorMetadata,
    fetch_packed_batch,
    fetch_shards,
    tensor_metadata,
)

AUTHKEY = b"test-authkey-0123456789abcdef012"


def _random_group(rng: random.Random, group_id: int, size: int) -> list[Trajectory]:
    """One GRPO group with random lengths (empty completions included), log-probs, versions
    and rewards."""
    prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))]
    out = []
    for _ in range(size):
        n = rng.randint(0, 12)
        out.append(
            Trajectory(
                prompt,
                [rng.randrange(1, 500) for _ in range(n)],
                [-rng.random() * 5 for _ in range(n)],
                sorted(rng.randrange(0, 6) for _ in range(n)),
                rng.choice(["stop", "length"]),
                group_id,
                float(rng.choice([0.0, 0.5, 1.0])),
            )
        )
    return out


def _random_groups(rng: random.Random, num_groups: int) -> list[list[Trajectory]]:
    ids = rng.sample(range(10_000), num_groups)
    return [_random_group(rng, gid, rng.randint(1, 4)) for gid in ids]


@pytest.fixture
def rng(fresh_seed) -> random.Random:
    return random.Random(fresh_seed)


@pytest.fixture
def stores():
    """Two started shard stores (two "rollout workers"), closed afterwards."""
    made = [ShardStore(AUTHKEY), ShardStore(AUTHKEY)]
    for store in made:
        store.start()
    yield made
    for store in made:
        store.close()


def _put(store: ShardStore, node: str, group: list[Trajectory]):
    tensors = shard_tensors(group)
    store.put(group[0].group_id, tensors)
    meta = ShardMetadata(
        node, store.address, group[0].group_id, len(group), 0, tensor_metadata(tensors)
    )
    return meta, tensors


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


# ---- ShardStore / fetch_shards -------------------------------------------------------


def test_fetch_returns_what_was_put_in_batch_order_and_removes_it(stores, rng):
    groups = _random_groups(rng, 6)
    nodes = ["rollout-0", "rollout-1"]
    put = [_put(stores[i % 2], nodes[i % 2], g) for i, g in enumerate(groups)]
    order = list(range(len(put)))
    rng.shuffle(order)
    batch = DistributedBatch([put[i][0] for i in order])
    fetched = fetch_shards(batch, AUTHKEY, timeout=10.0)
    assert len(fetched) == len(order)
    for got, i in zip(fetched, order):
        _assert_same_tensors(got, put[i][1])
        meta = put[i][0]
        assert {
            k: TensorMetadata(tuple(v.shape), str(v.dtype).split(".")[-1]) for k, v in got.items()
        } == meta.fields
    assert len(stores[0]) == len(stores[1]) == 0
    with pytest.raises(RuntimeError, match=r"worker 'rollout-[01]'.*not held"):
        fetch_shards(batch, AUTHKEY, timeout=10.0)


def test_fetch_of_a_missing_shard_takes_nothing(stores, rng):
    (g0, g1) = _random_groups(rng, 2)
    m0, t0 = _put(stores[0], "rollout-3", g0)
    m1, _ = _put(stores[0], "rollout-3", g1)
    assert stores[0].drop([m1.shard_id, 12345]) == 1
    with pytest.raises(RuntimeError, match=rf"worker 'rollout-3'.*shard {m1.shard_id}"):
        fetch_shards(DistributedBatch([m0, m1]), AUTHKEY, timeout=10.0)
    assert len(stores[0]) == 1  # the held shard stays for a later fetch
    _assert_same_tensors(fetch_shards(DistributedBatch([m0]), AUTHKEY, 10.0)[0], t0)


def test_wrong_authkey_cannot_fetch_and_the_store_keeps_serving(stores, rng):
    (group,) = _random_groups(rng, 1)
    meta, tensors = _put(stores[0], "rollout-0", group)
    batch = DistributedBatch([meta])
    for _ in range(2):
        with pytest.raises(AuthenticationError):
            fetch_shards(batch, b"x" * 32, timeout=10.0)
    assert len(stores[0]) == 1
    _assert_same_tensors(fetch_shards(batch, AUTHKEY, timeout=10.0)[0], tensors)


def _fetch_in_thread(batch, timeout: float) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fetch_shards(batch, AUTHKEY, timeout)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_store_survives_a_peer_that_resets_during_the_handshake(stores, rng):
    (group,) = _random_groups(rng, 1)
    meta, tensors = _put(stores[0], "rollout-0", group)
    host, port = stores[0].address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as peer:
        peer.recv(1, socket.MSG_PEEK)  # the server's challenge has arrived, unread
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    thread, result = _fetch_in_thread(DistributedBatch([meta]), timeout=5.0)
    thread.join(5.0)
    assert not thread.is_alive(), "fetch hangs: the shard server stopped serving"
    _assert_same_tensors(result["value"][0], tensors)


def test_fetch_times_out_when_the_worker_does_not_answer(rng):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never speaks
    try:
        (group,) = _random_groups(rng, 1)
        tensors = shard_tensors(group)
        meta = ShardMetadata(
            "rollout-9",
            "127.0.0.1:%d" % silent.getsockname()[1],
            group[0].group_id,
            len(group),
            0,
            tensor_metadata(tensors),
        )
        start = time.monotonic()
        thread, result = _fetch_in_thread(DistributedBatch([meta]), timeout=1.0)
        thread.join(4.0)
        assert not thread.is_alive(), "fetch_shards ignored its timeout"
        assert isinstance(result.get("error"), TimeoutError)
        assert "rollout-9" in str(result["error"])
        assert time.monotonic() - start < 5.0
    finally:
        silent.close()  # unblocks a hung fetch (connection reset)


# ---- DistributedBatch ----------------------------------------------------------------


def _meta(shard_id: int, seqs: int, tokens: int, offset: int = 99) -> ShardMetadata:
    fields = {
        "input_ids": TensorMetadata((tokens,), "int64"),
        "seq_lens": TensorMetadata((seqs,), "int64"),
    }
    return ShardMetadata(
        f"rollout-{shard_id % 3}",
        f"127.0.0.1:{4000 + shard_id % 3}",
        shard_id,
        seqs,
        offset,
        fields,
    )


def test_offsets_and_sizes(rng):
    sizes = [rng.randint(1, 5) for _ in range(7)]
    tokens = [rng.randint(1, 300) for _ in range(7)]
    batch = DistributedBatch([_meta(i, s, t) for i, (s, t) in enumerate(zip(sizes, tokens))])
    assert [s.offset for s in batch.shards] == [sum(sizes[:i]) for i in range(7)]
    assert batch.num_seqs == sum(sizes)
    assert batch.num_tokens == sum(tokens)
    assert [s.shard_id for s in batch.shards] == list(range(7))
    assert [s.num_tokens for s in batch.shards] == tokens
    assert DistributedBatch([]).num_seqs == DistributedBatch([]).num_tokens == 0


def test_split_keeps_shards_whole_covers_all_and_balances(rng):
    for _ in range(20):
        n = rng.randint(1, 12)
        tokens = [rng.randint(1, 400) for _ in range(n)]
        shards = [_meta(i, rng.randint(1, 4), t) for i, t in enumerate(tokens)]
        batch = DistributedBatch(shards)
        for k in range(1, n + 1):
            parts = batch.split(k)
            ids = sorted(s.shard_id for p in parts for s in p.shards)
            assert ids == list(range(n))
            for part in parts:
                assert part.shards, "empty part"
                assert [s.offset for s in part.shards] == [
                    sum(s.batch_size for s in part.shards[:i]) for i in range(len(part.shards))
                ]
                for s in part.shards:  # whole: same sizes and fields as the original
                    orig = shards[s.shard_id]
                    assert (s.batch_size, s.fields, s.node_id, s.node_addr) == (
                        orig.batch_size,
                        orig.fields,
                        orig.node_id,
                        orig.node_addr,
                    )
            loads = [p.num_tokens for p in parts]
            assert max(loads) - min(loads) <= max(tokens)
            assert sum(loads) == sum(tokens)


def test_split_returns_exactly_k_parts():
    batch = DistributedBatch([_meta(i, 2, 10) for i in range(4)])
    assert len(batch.split(2)) == 2


@pytest.mark.parametrize("k", [0, -1, 4])
def test_split_rejects_bad_k(k):
    batch = DistributedBatch([_meta(i, 2, 10) for i in range(3)])
    with pytest.raises(ValueError, match=r"num_parts = -?\d+ must be in \[1, 3\]"):
        batch.split(k)


# ---- assemble_packed_batch -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_assemble_equals_pack_trajectories(rng, stores, mode):
    groups = _random_groups(rng, 5)
    trajectories = [t for g in groups for t in g]
    advantages = group_advantages(
        torch.tensor([t.reward for t in trajectories]),
        group_ids=torch.tensor([t.group_id for t in trajectories]),
        mode=mode,
    )
    want = pack_trajectories(trajectories, advantages)
    direct = assemble_packed_batch([shard_tensors(g) for g in groups], mode)
    metas = [_put(stores[i % 2], f"rollout-{i % 2}", g)[0] for i, g in enumerate(groups)]
    fetched = fetch_packed_batch(DistributedBatch(metas), AUTHKEY, mode, timeout=10.0)
    for got in (direct, fetched):
        assert isinstance(got, PackedBatch)
        for name, value in vars(want).items():
            other = getattr(got, name)
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype, name
                assert torch.equal(other, value), name
            else:
                assert other == value, name
    assert set(TOKEN_FIELDS + SEQ_FIELDS) <= set(shard_tensors(groups[0]))


# ---- SharedWeightBuffer --------------------------------------------------------------


def _named(rng: random.Random, dtype_names: list[str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, name in enumerate(dtype_names):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        out.append((f"layer{i}.{name}", torch.randn(shape).to(getattr(torch, name))))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    "dtypes",
    [
        ["float32"],
        ["bfloat16"],
        ["float16"],
        ["float16", "float32", "bfloat16", "float32", "float16"],
    ],
)
def test_weight_buffer_round_trip_is_bit_exact(rng, tmp_path, dtypes):
    named = _named(rng, dtypes) + [("odd", torch.randn(3, 5, 7).to(getattr(torch, dtypes[0])))]
    writer = SharedWeightBuffer.create(named, directory=str(tmp_path))
    try:
        for entry in writer.spec.entries:
            assert entry.offset % ALIGNMENT == 0
        ends = [(e.offset, e.offset + e.nbytes) for e in writer.spec.entries]
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
        assert writer.spec.total_bytes % ALIGNMENT == 0 and writer.spec.total_bytes >= ends[-1][1]
        assert writer.write(named) == sum(t.numel() * t.element_size() for _, t in named)
        reader = SharedWeightBuffer.attach(writer.spec)
        got = list(reader.named_tensors())
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, want), (_, have) in zip(named, got):
            assert have.dtype == want.dtype and have.shape == want.shape
            assert torch.equal(_bits(have), _bits(want))
        # a second version written later is seen through the reader's mapping
        newer = [(n, t + 1) for n, t in named]
        writer.write(newer)
        for (_, want), (_, have) in zip(newer, reader.named_tensors()):
            assert torch.equal(_bits(have), _bits(want))
        reader.close()
        assert Path(writer.spec.path).exists()  # a reader does not delete the file
    finally:
        writer.close()
    assert not Path(writer.spec.path).exists()
    with pytest.raises(FileNotFoundError, match=writer.spec.path):
        SharedWeightBuffer.attach(writer.spec)


def test_weight_buffer_default_directory_is_removed_on_close():
    writer = SharedWeightBuffer.create([("w", torch.ones(5))])
    path = Path(writer.spec.path)
    assert path.exists() and path.stat().st_size == writer.spec.total_bytes
    writer.close()
    assert not path.exists()


def test_weight_buffer_errors_name_the_tensor(tmp_path):
    named = [("a.weight", torch.zeros(4, 3)), ("b.bias", torch.zeros(5, dtype=torch.float16))]
    with pytest.raises(ValueError, match="'a.weight' appears twice"):
        SharedWeightBuffer.create(named + [("a.weight", torch.zeros(1))], str(tmp_path))
    buf = SharedWeightBuffer.create(named, directory=str(tmp_path))
    try:
        with pytest.raises(ValueError, match="no entry for tensor 'c'"):
            buf.write(named + [("c", torch.zeros(1))])
        with pytest.raises(ValueError, match=r"'a.weight' is \(3, 4\)"):
            buf.write([("a.weight", torch.zeros(3, 4)), named[1]])
        with pytest.raises(ValueError, match=r"'b.bias' .*bfloat16.*float16"):
            buf.write([named[0], ("b.bias", torch.zeros(5, dtype=torch.bfloat16))])
        with pytest.raises(ValueError, match="1 tensors not written, first 'b.bias'"):
            buf.write(named[:1])
    finally:
        buf.close()
    with pytest.raises(FileNotFoundError):
        SharedWeightBuffer.attach(buf.spec)
    assert not os.listdir(tmp_path)
