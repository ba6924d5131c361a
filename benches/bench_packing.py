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

from _harness import native_disabled  # noqa: E402

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=NUM_SEQS, help="number of sequences")
    args = parser.parse_args(argv)

    native = _native.load_native()
    info = native.build_info() if native is not None else {}
    print(
        f"# partition_balanced, {args.n} sequences, lengths U[1, {MAX_LEN}], "
        f"median of {args.repeats}"
    )
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
    for workload, (budget, grouped) in WORKLOADS.items():
        seqlens, group_ids, budget = make_workload(workload, args.n)
        for method in METHODS:
            medians = {}
            for impl in IMPLS:
                if impl == "cpp" and native is None:
                    continue
                with implementation(impl):

                    def run():
                        return partition_balanced(
                            seqlens, budget, method=method, group_ids=group_ids
                        )

                    mbs = run()
                    repeats = args.repeats if impl == "cpp" else max(1, min(args.repeats, 3))
                    times = _time(run, repeats)
                medians[impl] = statistics.median(times)
                q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
                num_mbs, max_load, min_load = summarize(mbs, seqlens)
                speedup = (
                    f"{medians['python'] / medians['cpp']:.1f}x"
                    if impl == "python" and "cpp" in medians
                    else ""
                )
                label = f"{workload}{' (groups of 8)' if grouped else ''}"
                print(
                    f"| {label} | {budget} | {method} | {impl} | {medians[impl]:.4f} "
                    f"| {q[0]:.4f} | {q[3]:.4f} | {num_mbs} | {max_load} | {min_load} "
                    f"| {speedup} |"
                )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
