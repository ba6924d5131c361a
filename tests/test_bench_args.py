"""Benchmark scripts refuse bad numbers with argparse's one-line error (exit 2), before any
work: a count of 0 or a negative time once ended in a traceback after minutes of set-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("bench_packing.py", ["--repeats", "0"], "--repeats: a whole number >= 1, got '0'"),
        ("bench_packing.py", ["--n", "-5"], "--n: a whole number >= 1, got '-5'"),
        ("bench_weight_sync.py", ["--controller", "--steps", "0"], "--steps: a whole number"),
        ("bench_weight_sync.py", ["--repeats", "x"], "--repeats: a whole number >= 1, got 'x'"),
        ("bench_weight_sync.py", ["--step-seconds", "-1"], "--step-seconds: a number >= 0"),
        ("bench_logprobs.py", ["--table", "missing.json"], "--table missing.json: no such file"),
        ("bench_sft.py", ["--steps", "0"], "--steps: a whole number >= 1, got '0'"),
        ("bench_slurm_submit.py", ["--model", "m", "--repeats", "0"], "--repeats: a whole"),
        ("bench_sft.py", ["--steps", "2", "--warmup", "2"], "--warmup 2 leaves no timed step"),
    ],
)
def test_bad_numbers_are_one_line_errors(tmp_path, script, args, says):
    proc = subprocess.run(
        [sys.executable, str(BENCHES / script), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last and says in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
