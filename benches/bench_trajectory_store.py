"""Trajectory store: compression ratio, write throughput and the producer's stall per put.

For each compression (none, zstd levels 1, 3, 9) and each number of writer threads (1, 4),
a :class:`~areal_fast.agent.store.TrajectoryWriter` (default cache of 1000 records) stores
the same records twice:

- **burst**: one producer calls ``put`` in a loop as fast as it can. Throughput (records/s
  and MB/s of raw JSON) runs from the first ``put`` to the end of ``close``, so it includes
  draining the cache; once the cache is full the producer waits for the writers and that
  wait is the stall.
- **paced**: one producer puts one record every ``--pace-ms`` (2 ms by default, about the
  rate at which a busy rollout worker finishes trajectories); the writers keep up, so the
  stall should be 0 and a put should cost microseconds.

Per case: compression ratio (raw JSON bytes / stored bytes), total stall seconds and the
median / max duration of one ``put`` call.

Records come from ``--input`` (JSON lines of real records or a run's ``trajectories/``
directory, cycled up to ``--records``) or
are synthesised like agent sessions: 2-4 chat messages of English-like text, 300-800 token
ids drawn Zipf-like from a 49,152 vocabulary, float32-valued negative log-probs (their
float64 repr is long, like real ones), per-token policy versions and a reward.

    python benches/bench_trajectory_store.py [--records 2000] [--json OUT]
    pytest benches/bench_trajectory_store.py     # pytest-benchmark: one put
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_metadata, eprint, fmt, markdown_table, write_json  # noqa: E402

from areal_fast.agent.store import TrajectoryConfig, TrajectoryWriter  # noqa: E402

VOCAB = 49152
COMPRESSIONS = (("none", 0), ("zstd", 1), ("zstd", 3), ("zstd", 9))
THREADS = (1, 4)
WORDS = (
    "the a of to and in is that for it as with was on be by this are or from at an "
    "which have not but can all will one their there has been if more when so what "
    "answer question step first then we find number total each value equal solve "
    "compute sum product divide remainder therefore result check final tool call "
    "search python output error retry reasoning model policy reward"
).split()


def synth_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` agent-session-like records (see the module doc), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    rank_to_id = rng.permutation(VOCAB)  # frequent tokens are not just the small ids
    records = []
    for i in range(n):
        n_prompt, n_completion = int(rng.integers(60, 200)), int(rng.integers(240, 600))
        ranks = np.minimum(rng.zipf(1.15, n_prompt + n_completion), VOCAB) - 1
        ids = rank_to_id[ranks].tolist()
        logprobs = (-rng.exponential(0.6, n_completion)).astype(np.float32).tolist()
        roles = ("system", "user", "assistant", "tool")[: int(rng.integers(2, 5))]
        messages = [
            {"role": r, "content": " ".join(rng.choice(WORDS, int(rng.integers(10, 120))))}
            for r in roles
        ]
        records.append(
            {
                "session_id": f"s{i:08d}",
                "messages": messages,
                "input_ids": ids[:n_prompt],
                "output_ids": ids[n_prompt:],
                "output_logprobs": logprobs,
                "output_versions": [int(v) for v in np.sort(rng.integers(40, 43, n_completion))],
                "reward": float(rng.choice([0.0, 1.0])),
                "finish_reason": "stop",
            }
        )
    return records


def load_records(path: str, n: int) -> list[dict]:
    """The first ``n`` records of a JSON lines file or a trajectory-store directory (a run's
    ``trajectories/``), cycled when it holds fewer."""
    if Path(path).is_dir():
        from areal_fast.agent.store import read_trajectories

        base = list(read_trajectories(path))
    else:
        with open(path, encoding="utf-8") as f:
            base = [json.loads(line) for line in f if line.strip()]
    if not base:
        raise SystemExit(f"{path} holds no records")
    return list(itertools.islice(itertools.cycle(base), n))


def run_case(
    records: list[dict], compression: str, level: int, threads: int, pace_s: float | None
) -> dict:
    """Store ``records`` once; timings in seconds, sizes in bytes."""
    cfg = TrajectoryConfig(
        write_threads=threads, compression=compression, compression_level=level or 3
    )
    put_times = []
    with tempfile.TemporaryDirectory() as directory:
        writer = TrajectoryWriter(directory, cfg, name="bench")
        start = time.perf_counter()
        next_at = start
        for record in records:
            if pace_s is not None:
                next_at += pace_s
                while (delay := next_at - time.perf_counter()) > 0:
                    time.sleep(delay)
            t0 = time.perf_counter()
            writer.put(record)
            put_times.append(time.perf_counter() - t0)
        writer.close()
        elapsed = time.perf_counter() - start
        stats = writer.stats
    return {
        "compression": compression if compression == "none" else f"zstd-{level}",
        "threads": threads,
        "producer": "burst" if pace_s is None else "paced",
        "records": len(records),
        "seconds": elapsed,
        "records_per_s": len(records) / elapsed,
        "raw_mb_per_s": stats.raw_bytes / elapsed / 1e6,
        "raw_bytes": stats.raw_bytes,
        "stored_bytes": stats.stored_bytes,
        "compression_ratio": stats.compression_ratio,
        "stall_s": stats.stall_seconds,
        "put_median_us": statistics.median(put_times) * 1e6,
        "put_max_ms": max(put_times) * 1e3,
        "write_thread_s": stats.write_seconds,
    }


def table(results: list[dict]) -> str:
    headers = [
        "compression",
        "threads",
        "producer",
        "ratio",
        "records/s",
        "raw MB/s",
        "stall s",
        "put median µs",
        "put max ms",
    ]
    rows = [
        [
            r["compression"],
            r["threads"],
            r["producer"],
            fmt(r["compression_ratio"], ".2f"),
            fmt(r["records_per_s"], ".0f"),
            fmt(r["raw_mb_per_s"], ".1f"),
            fmt(r["stall_s"], ".3f"),
            fmt(r["put_median_us"], ".1f"),
            fmt(r["put_max_ms"], ".2f"),
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2000, help="records per burst case")
    parser.add_argument(
        "--paced-records",
        type=int,
        default=1000,
        help="records per paced case (takes records × pace)",
    )
    parser.add_argument("--pace-ms", type=float, default=2.0)
    parser.add_argument("--input", help="JSON lines file of real records")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    records = load_records(args.input, args.records) if args.input else synth_records(args.records)
    results = []
    for (compression, level), threads in itertools.product(COMPRESSIONS, THREADS):
        for pace_s, subset in (
            (None, records),
            (args.pace_ms / 1e3, records[: args.paced_records]),
        ):
            results.append(run_case(subset, compression, level, threads, pace_s))
            r = results[-1]
            eprint(
                f"{r['compression']:>7} x{threads} {r['producer']:>5}: "
                f"ratio {r['compression_ratio']:.2f}, {r['records_per_s']:.0f} rec/s, "
                f"stall {r['stall_s']:.3f} s"
            )
    raw = results[0]["raw_bytes"] / results[0]["records"]
    print(
        f"{len(records)} records ({'from ' + args.input if args.input else 'synthetic'}), "
        f"{raw / 1024:.1f} KiB of JSON each, cache_size 1000\n"
    )
    print(table(results))
    if args.json:
        import zstandard

        meta = base_metadata()
        meta.update(zstandard=zstandard.__version__, args=vars(args), raw_bytes_per_record=raw)
        write_json(args.json, {"meta": meta, "results": results}, indent=2)
    return 0


def test_put(benchmark, tmp_path):
    """pytest-benchmark: one put into a writer whose cache never fills."""
    records = synth_records(50)
    cfg = TrajectoryConfig(cache_size=10**7, write_threads=1)
    with TrajectoryWriter(tmp_path, cfg) as writer:
        cycle = itertools.cycle(records)
        benchmark(lambda: writer.put(next(cycle)))


if __name__ == "__main__":
    sys.exit(main())
