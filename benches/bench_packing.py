"""Benchmark of micro-batch packing: native C++ (areal_fast._C) vs the pure-Python twin.

Two workloads of 100k sequences with lengths uniform in [1, 4096]:

- ``flat``: no groups, budget 16384 tokens per micro-batch;
- ``grouped``: GRPO groups of 8 consecutive sequences kept together, budget 65536
  (a group holds up to 8 * 4096 = 32768 tokens).

Both methods (``kk``, ``ffd``) go through the public ``partition_balanced``; the Python
rows set ``AREAL_FAST_DISABLE_NATIVE=1``.

Usage::

    pytest benches/bench_packing.py              # pytest-benchmark
    python benches/bench_packing.py [--repeats 5] [--n 100000]   # markdown table
    python benches/bench_packing.py --check ...   # exit 1 unless native beats Python
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import native_disabled, positive_int  # noqa: E402

from areal_fast import _native  # noqa: E402
from areal_fast.ops.packing import partition_balanced  # noqa: E402

NUM_SEQS = 100_000
MAX_LEN = 4096
GROUP_SIZE = 8
WORKLOADS = {"flat": (16384, False), "grouped": (65536, True)}
METHODS = ("kk", "ffd")
IMPLS = ("cpp", "python")


def make_workload(name: str, num_seqs: int = NUM_SEQS, seed: int = 0):
    """Returns (seqlens [N] int64, group_ids [N] int64 or None, budget)."""
    budget, grouped = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    seqlens = rng.integers(1, MAX_LEN + 1, size=num_seqs, dtype=np.int64)
    group_ids = np.arange(num_seqs, dtype=np.int64) // GROUP_SIZE if grouped else None
    return seqlens, group_ids, budget


@contextmanager
def implementation(impl: str):
    """Select the native or the Python implementation for the duration of the block."""
    with native_disabled(impl == "python"):
        if impl == "cpp" and _native.load_native() is None:
            raise RuntimeError("areal_fast._C is not importable; build the extension first")
        yield


def summarize(mbs, seqlens) -> tuple[int, int, int]:
    loads = [int(seqlens[mb].sum()) for mb in mbs]
    return len(mbs), max(loads), min(loads)


# ---------------------------------------------------------------------------
# pytest-benchmark
# ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # script mode without pytest installed
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("method", METHODS)
    @pytest.mark.parametrize("workload", list(WORKLOADS))
    def test_partition_balanced(benchmark, workload, method, impl):
        if impl == "cpp":
            pytest.importorskip("areal_fast._C")
        seqlens, group_ids, budget = make_workload(workload)
        with implementation(impl):
            mbs = benchmark.pedantic(
                partition_balanced,
                args=(seqlens, budget),
                kwargs=dict(method=method, group_ids=group_ids),
                rounds=3 if impl == "python" else 10,
                iterations=1,
                warmup_rounds=0,
            )
        num_mbs, max_load, min_load = summarize(mbs, seqlens)
        assert max_load <= budget
        benchmark.extra_info.update(num_mbs=num_mbs, max_load=max_load, min_load=min_load)


# ---------------------------------------------------------------------------
# Script mode
# ---------------------------------------------------------------------------


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _table_header(n: int, repeats: int, native) -> None:
    info = native.build_info() if native is not None else {}
    print(f"# partition_balanced, {n} sequences, lengths U[1, {MAX_LEN}], median of {repeats}")
    print(
        f"{datetime.date.today()} | {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs | Python {platform.python_version()} | numpy {np.__version__} "
        f"| _C {info.get('version', 'missing')} ({info.get('compiler', '-')})\n"
    )
    print(
        "| workload | budget | method | impl | median s | p20 s | p80 s | #micro-batches "
        "| max load | min load | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")


def _measure(workload: str, method: str, impl: str, n: int, repeats: int):
    """(median seconds, [p20, p80], micro-batches) of one packing case."""
    seqlens, group_ids, budget = make_workload(workload, n)
    with implementation(impl):

        def run():
            return partition_balanced(seqlens, budget, method=method, group_ids=group_ids)

        mbs = run()
        times = _time(run, repeats if impl == "cpp" else max(1, min(repeats, 3)))
    q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
    return statistics.median(times), (q[0], q[3]), summarize(mbs, seqlens)


def main(argv=None) -> int:
    """Print the markdown table; with ``--check``, return 1 unless native beats Python."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--n", type=positive_int, default=NUM_SEQS, help="number of sequences")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the extension is missing or the native packer is not faster than "
        "the Python one in every row",
    )
    args = parser.parse_args(argv)
    native = _native.load_native()
    if args.check and native is None:
        print("--check: areal_fast._C is not importable: the native packer was not measured")
        return 1
    _table_header(args.n, args.repeats, native)
    slower = []
    for workload in args.workloads:
        budget, grouped = WORKLOADS[workload]
        label = f"{workload}{' (groups of 8)' if grouped else ''}"
        for method in args.methods:
            medians = {}
            for impl in IMPLS if native is not None else ("python",):
                medians[impl], (p20, p80), (num_mbs, max_load, min_load) = _measure(
                    workload, method, impl, args.n, args.repeats
                )
                speedup = ""
                if impl == "python" and "cpp" in medians:
                    speedup = f"{medians['python'] / medians['cpp']:.1f}x"
                    if medians["cpp"] >= medians["python"]:
                        slower.append(f"{label} {method}")
                print(
                    f"| {label} | {budget} | {method} | {impl} | {medians[impl]:.4f} "
                    f"| {p20:.4f} | {p80:.4f} | {num_mbs} | {max_load} | {min_load} "
                    f"| {speedup} |"
                )
                sys.stdout.flush()
    if args.check and slower:
        print(f"--check: the native packer is not faster than Python in: {', '.join(slower)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
