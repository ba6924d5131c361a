"""Tests of the compressed trajectory store (areal_fast.agent.store) on fresh random data."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import threading
import time
from collections import Counter

import pytest
import zstandard

from areal_fast.agent import store
from areal_fast.agent.store import (
    TrajectoryConfig,
    TrajectoryStoreError,
    TrajectoryWriter,
    read_trajectories,
)

WORDS = (
    "the model answers tool call reward step token policy value Ünïcödé 数学 🙂 "
    '"quoted" back\\slash tab\t newline\n'
).split(" ")


def fresh_rng():
    seed = int.from_bytes(os.urandom(8), "little")
    return random.Random(seed), seed


def random_record(rng: random.Random, i: int) -> dict:
    n = rng.randint(0, 300)
    return {
        "id": i,
        "tokens": [rng.randrange(49152) for _ in range(n)],
        "logprobs": [-rng.expovariate(1.0) * 10 ** rng.randint(-12, 2) for _ in range(n)],
        "messages": [
            {
                "role": rng.choice(["user", "assistant", "tool"]),
                "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40))),
            }
            for _ in range(rng.randint(1, 4))
        ],
        "reward": rng.choice(
            [None, True, 0, rng.random(), -1e-300, 5e-324, 1.7976931348623157e308]
        ),
        "meta": {"nested": {"deep": [rng.random(), {"x": rng.getrandbits(70)}]}, "empty": {}},
    }


def canon(record: dict) -> str:
    return json.dumps(record, sort_keys=True, ensure_ascii=False)


def put_concurrently(writer: TrajectoryWriter, records: list[dict], producers: int) -> None:
    shards = [records[p::producers] for p in range(producers)]
    errors = []

    def produce(shard):
        try:
            for record in shard:
                writer.put(record)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(s,)) for s in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("threads", [1, 4])
def test_round_trip_concurrent_producers(tmp_path, compression, threads):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(600)]
    cfg = TrajectoryConfig(
        cache_size=rng.choice([7, 64, 1000]),
        write_threads=threads,
        compression=compression,
        compression_level=rng.choice([-3, 1, 3, 9]),
    )
    with TrajectoryWriter(tmp_path, cfg, name="rank0") as writer:
        put_concurrently(writer, records, producers=4)
        writer.flush(timeout=60)
        stats = writer.stats
    suffix = ".jsonl.zst" if compression == "zstd" else ".jsonl"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files and all(f.startswith("rank0-") and f.endswith(suffix) for f in files), (
        seed,
        files,
    )
    assert len(files) <= threads, (seed, files)
    got = list(read_trajectories(tmp_path))
    assert Counter(map(canon, got)) == Counter(map(canon, records)), f"seed={seed}"
    # floats round trip exactly, not just as equal JSON text
    by_id = {r["id"]: r for r in got}
    for r in records:
        assert by_id[r["id"]] == r, f"seed={seed} id={r['id']}"
    assert stats.records_written == len(records), f"seed={seed}"
    assert stats.errors == 0 and writer.error is None
    raw = sum(
        len(json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode()) + 1 for r in records
    )
    assert stats.raw_bytes == raw, f"seed={seed}"
    assert stats.stored_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    if compression == "none":
        assert stats.stored_bytes == stats.raw_bytes


def test_zstd_files_are_standard_and_smaller(tmp_path):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(300)]
    cfg = TrajectoryConfig(cache_size=50, write_threads=2, compression_level=3)
    with TrajectoryWriter(tmp_path, cfg) as writer:
        for r in records:
            writer.put(r)
    stats = writer.stats
    assert stats.compression_ratio > 1.5, f"seed={seed} ratio={stats.compression_ratio}"
    assert stats.stored_bytes < stats.raw_bytes
    lines = []
    for path in sorted(tmp_path.glob("*.jsonl.zst")):
        with open(path, "rb") as f:  # multi-frame stream, read by plain zstandard
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            lines += reader.read().decode("utf-8").splitlines()
    assert Counter(lines) == Counter(
        json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in records
    ), f"seed={seed}"
    as_dict = stats.as_dict()
    assert as_dict["trajectory/records_written"] == 300
    assert as_dict["trajectory/compression_ratio"] == stats.compression_ratio


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd command line tool")
def test_zstd_command_line_reads_the_files(tmp_path):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(100)]
    with TrajectoryWriter(tmp_path, TrajectoryConfig(cache_size=8, write_threads=2)) as writer:
        for r in records:
            writer.put(r)
    out = subprocess.run(
        ["zstd", "-dc", *map(str, sorted(tmp_path.iterdir()))], capture_output=True, check=True
    ).stdout
    got = [json.loads(line) for line in out.decode("utf-8").splitlines()]
    assert Counter(map(canon, got)) == Counter(map(canon, records)), f"seed={seed}"


def test_no_stall_when_cache_holds_everything(tmp_path):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(200)]
    cfg = TrajectoryConfig(cache_size=len(records) + 1, write_threads=2)
    with TrajectoryWriter(tmp_path, cfg) as writer:
        for r in records:
            writer.put(r)
    assert writer.stats.stall_seconds == 0.0, f"seed={seed}"
    assert writer.stats.records_written == len(records)


def test_backpressure_with_slow_writer_loses_nothing(tmp_path, monkeypatch):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(40)]
    original = store._FileSink.append

    def slow_append(self, raw):
        time.sleep(0.005)
        return original(self, raw)

    monkeypatch.setattr(store._FileSink, "append", slow_append)
    cfg = TrajectoryConfig(cache_size=1, write_threads=1, compression="none")
    with TrajectoryWriter(tmp_path, cfg) as writer:
        for r in records:
            writer.put(r)
    # 40 puts into a 1-record cache drained at most one batch per 5 ms must have waited
    assert writer.stats.stall_seconds > 0, f"seed={seed}"
    assert [r["id"] for r in read_trajectories(tmp_path)] == list(range(40)), f"seed={seed}"


def test_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    target = tmp_path / "afile" / "sub"
    writer = TrajectoryWriter(target, TrajectoryConfig(write_threads=2))
    for i in range(5):
        writer.put({"i": i})
    with pytest.raises(TrajectoryStoreError) as info:
        writer.flush(timeout=30)
    message = str(info.value)
    assert str(target) in message and "5 records not written" in message, message
    assert "\n" not in message
    assert writer.stats.errors > 0
    assert str(target) in writer.error and "Not a directory" in writer.error
    with pytest.raises(TrajectoryStoreError, match="5 records not written"):
        writer.put({"i": 5})
    with pytest.raises(TrajectoryStoreError, match="5 records not written"):
        writer.close()
    with pytest.raises(TrajectoryStoreError):  # every close reports it
        writer.close()


def test_disk_full_names_file_and_count(tmp_path, monkeypatch):
    def full(self, raw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(store._FileSink, "append", full)
    writer = TrajectoryWriter(tmp_path, TrajectoryConfig(write_threads=1), name="w")
    writer.put({"a": 1})
    writer.put({"a": 2})
    with pytest.raises(TrajectoryStoreError) as info:
        writer.close(timeout=30)
    message = str(info.value)
    assert "w-0.jsonl.zst" in message and "No space left" in message, message
    assert "2 records not written" in message, message
    assert writer.stats.errors == 1 and writer.stats.records_written == 0
    with pytest.raises(TrajectoryStoreError, match="No space left"):
        writer.put({"a": 3})


def test_unserialisable_record_is_an_error_not_a_drop(tmp_path):
    writer = TrajectoryWriter(tmp_path, TrajectoryConfig(write_threads=1))
    writer.put({"bad": object()})
    with pytest.raises(TrajectoryStoreError, match="1 records not written"):
        writer.close()
    with TrajectoryWriter(tmp_path / "x", TrajectoryConfig()) as other:
        with pytest.raises(TypeError):
            other.put([1, 2])


def test_flush_timeout_raises_instead_of_hanging(tmp_path, monkeypatch):
    release = threading.Event()
    original = store._FileSink.append

    def blocked(self, raw):
        release.wait(30)
        return original(self, raw)

    monkeypatch.setattr(store._FileSink, "append", blocked)
    writer = TrajectoryWriter(tmp_path, TrajectoryConfig(write_threads=1))
    for i in range(3):
        writer.put({"i": i})
    start = time.monotonic()
    with pytest.raises(TrajectoryStoreError, match="3 records pending"):
        writer.flush(timeout=0.2)
    assert time.monotonic() - start < 20
    release.set()
    writer.close()
    assert sorted(r["i"] for r in read_trajectories(tmp_path)) == [0, 1, 2]


def test_same_name_twice_in_one_directory_is_refused(tmp_path):
    with TrajectoryWriter(tmp_path, TrajectoryConfig(), name="r"):
        with pytest.raises(TrajectoryStoreError, match="already open"):
            TrajectoryWriter(tmp_path, TrajectoryConfig(), name="r")
        with TrajectoryWriter(tmp_path, TrajectoryConfig(), name="r2"):
            pass
    with TrajectoryWriter(tmp_path, TrajectoryConfig(), name="r"):  # released by close
        pass


def test_reopen_appends_and_mixed_compression(tmp_path):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(30)]
    for chunk, compression in (
        (records[:10], "zstd"),
        (records[10:20], "zstd"),
        (records[20:], "none"),
    ):
        cfg = TrajectoryConfig(write_threads=1, compression=compression)
        with TrajectoryWriter(tmp_path, cfg) as writer:
            for r in chunk:
                writer.put(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-0.jsonl", "rollout-0.jsonl.zst"]
    got = list(read_trajectories(tmp_path))
    assert Counter(map(canon, got)) == Counter(map(canon, records)), f"seed={seed}"
    assert list(read_trajectories(tmp_path, pattern="*.jsonl")) == records[20:]


def _write(tmp_path, records, compression="zstd", batches=4):
    cfg = TrajectoryConfig(write_threads=1, compression=compression)
    with TrajectoryWriter(tmp_path, cfg) as writer:
        for chunk in range(batches):  # one frame per flushed batch
            for r in records[chunk::batches]:
                writer.put(r)
            writer.flush(timeout=30)
    return next(tmp_path.glob("rollout-0.*"))


def line_ends(data: bytes) -> set[int]:
    return {i + 1 for i, b in enumerate(data) if b == ord("\n")}


def frame_ends(data: bytes) -> set[int]:
    """Offsets just past each zstd frame of ``data``."""
    ends, offset = set(), 0
    while offset < len(data):
        obj = zstandard.ZstdDecompressor().decompressobj()
        obj.decompress(data[offset:])
        assert obj.eof
        offset = len(data) - len(obj.unused_data)
        ends.add(offset)
    return ends


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_truncated_file_raises_naming_file_and_record(tmp_path, compression):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(40)]
    path = _write(tmp_path, records, compression)
    data = path.read_bytes()
    # a cut exactly at a line (or frame) boundary leaves a valid shorter file: avoid those
    ends = frame_ends(data) if compression == "zstd" else line_ends(data)
    cut = rng.choice([c for c in range(1, len(data)) if c not in ends])
    path.write_bytes(data[:cut])
    with pytest.raises(TrajectoryStoreError) as info:
        list(read_trajectories(tmp_path))
    message = str(info.value)
    assert str(path) in message and "at record" in message, f"seed={seed} cut={cut}: {message}"
    path.write_bytes(data[:-1])  # even one byte short (the last checksum byte)
    with pytest.raises(TrajectoryStoreError, match="at record"):
        list(read_trajectories(tmp_path))


def test_corrupt_zstd_data_raises(tmp_path):
    rng, seed = fresh_rng()
    path = _write(tmp_path, [random_record(rng, i) for i in range(20)])
    data = bytearray(path.read_bytes())
    data[rng.randrange(20, len(data) - 4)] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TrajectoryStoreError, match="corrupt trajectory file .*rollout-0"):
        list(read_trajectories(tmp_path))


def test_read_missing_directory_and_empty_files(tmp_path):
    with pytest.raises(TrajectoryStoreError, match="does not exist"):
        list(read_trajectories(tmp_path / "missing"))
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl.zst").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("ignored")
    assert list(read_trajectories(tmp_path)) == []
    (tmp_path / "c.jsonl").write_text('{"ok":1}\n[1,2]\n')
    with pytest.raises(TrajectoryStoreError, match=r"c.jsonl at record 2: not a JSON object"):
        list(read_trajectories(tmp_path))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"cache_size": 0}, "trajectory.cache_size"),
        ({"write_threads": 0}, "trajectory.write_threads"),
        ({"write_threads": 2.5}, "trajectory.write_threads"),
        ({"compression": "gzip"}, "trajectory.compression"),
        ({"compression_level": 23}, "trajectory.compression_level"),
        ({"compression_level": -8}, "trajectory.compression_level"),
        ({"cache_size": True}, "trajectory.cache_size"),
        ({"enabled": "yes"}, "trajectory.enabled"),
    ],
)
def test_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError) as info:
        TrajectoryConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(key + " = ") and "\n" not in message, message


def test_write_threads_zero_message():
    with pytest.raises(ValueError, match=r"^trajectory.write_threads = 0 must be >= 1$"):
        TrajectoryConfig(write_threads=0)


def test_directory_falls_back_to_config(tmp_path):
    cfg = TrajectoryConfig(directory=str(tmp_path / "run"), compression="none")
    with TrajectoryWriter("", cfg) as writer:
        writer.put({"x": 1})
    assert list(read_trajectories(tmp_path / "run")) == [{"x": 1}]
    with pytest.raises(ValueError, match="trajectory.directory"):
        TrajectoryWriter("", TrajectoryConfig())


def test_failed_write_is_cut_off_the_file(tmp_path, monkeypatch):
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(10)]
    with TrajectoryWriter(tmp_path, TrajectoryConfig(write_threads=1)) as writer:
        for r in records:
            writer.put(r)
    real_open = open

    class HalfFull:  # writes half of a batch, then the disk is full
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, data):
            if len(data) > 1:
                return self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "open", lambda *a, **k: HalfFull(real_open(*a, **k)), raising=False)
    writer = TrajectoryWriter(tmp_path, TrajectoryConfig(write_threads=1))
    writer.put({"late": 1})
    with pytest.raises(TrajectoryStoreError, match="No space left.*1 records not written"):
        writer.close()
    monkeypatch.undo()
    got = list(read_trajectories(tmp_path))  # the partial frame is gone
    assert Counter(map(canon, got)) == Counter(map(canon, records)), f"seed={seed}"


def test_linger_packs_paced_records_into_one_frame(tmp_path):
    """Records put one at a time are written as one frame when the threads linger (and
    compress better than one frame each); flush writes what is queued without waiting."""
    rng, seed = fresh_rng()
    records = [random_record(rng, i) for i in range(10)]
    lingering = TrajectoryWriter(
        tmp_path / "a", TrajectoryConfig(write_threads=4, linger_seconds=30.0)
    )
    for r in records:
        lingering.put(r)
    start = time.monotonic()
    lingering.flush(timeout=10)
    assert time.monotonic() - start < 10  # flush did not wait out the 30 s linger
    lingering.close()
    eager = TrajectoryWriter(tmp_path / "b", TrajectoryConfig(write_threads=1, linger_seconds=0.0))
    for r in records:
        eager.put(r)
        eager.flush(timeout=10)
    eager.close()
    a, b = lingering.stats, eager.stats
    assert (a.frames, b.frames) == (1, 10), seed
    assert a.raw_bytes == b.raw_bytes and a.stored_bytes < b.stored_bytes, seed
    assert (
        list(read_trajectories(tmp_path / "a"))
        == records
        == list(read_trajectories(tmp_path / "b"))
    )


def test_linger_seconds_is_checked():
    with pytest.raises(ValueError, match=r"trajectory\.linger_seconds = -1"):
        TrajectoryConfig(linger_seconds=-1)
