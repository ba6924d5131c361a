"""Shared helpers of the benchmark scripts: timing statistics, resident-memory probes, run
metadata and markdown tables.

Kept free of torch imports so that a parent process that only launches and collects child
runs stays small.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: a whole number ≥ 1 (a count of calls, sequences, steps); else an
    argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number ≥ 0 (seconds); else an argparse error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"a number >= 0, got {text!r}")
    return value


def time_calls(fn, repeats: int, *, between=None) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn()`` (``between()`` runs untimed after
    each call, e.g. to drop gradients)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if between is not None:
            between()
    return times


def summarize_times(times: list[float]) -> dict:
    """Median, 20th and 80th percentiles (seconds) and the number of samples."""
    if not times:
        return {"median_s": None, "p20_s": None, "p80_s": None, "n": 0}
    if len(times) > 1:
        q = statistics.quantiles(times, n=5, method="inclusive")
        p20, p80 = q[0], q[3]
    else:
        p20 = p80 = times[0]
    return {"median_s": statistics.median(times), "p20_s": p20, "p80_s": p80, "n": len(times)}


# ---------------------------------------------------------------------------
# Resident memory of this process (Linux /proc)
# ---------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def rss_bytes() -> int | None:
    """Current resident set size (VmRSS) in bytes, None where /proc is unavailable."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size (VmHWM) in bytes since start or the last reset."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current VmRSS (writes 5 to /proc/self/clear_refs, Linux >= 4.0).

    Returns whether the reset took effect; without it VmHWM keeps the peak since process
    start, which then bounds the measured extra from above.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = peak_rss_bytes(), rss_bytes()
    return hwm is not None and rss is not None and hwm <= rss + 64 * 1024


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """Short commit of the checkout, with ``-dirty`` when tracked files under areal_fast/ or
    csrc/ differ from it; outside a git checkout (a copy of the tree, as on the GPU machine)
    ``$AREAL_FAST_COMMIT`` when set, else None."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if commit.returncode != 0:
            return os.environ.get("AREAL_FAST_COMMIT") or None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "areal_fast", "csrc"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        suffix = "-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
        return commit.stdout.strip() + suffix
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("AREAL_FAST_COMMIT") or None


def code_fingerprint(package: str = "areal_fast") -> str | None:
    """Short sha1 over the package's Python files (and those of its ``kernels`` subpackage)
    and its compiled extension, as imported by this process: runs whose fingerprints differ
    did not run the same code."""
    import hashlib
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    files = set()
    for loc in spec.submodule_search_locations:
        files.update(Path(loc).rglob("*.py"))
    for sub in ("kernels", "_C"):
        try:
            sub_spec = importlib.util.find_spec(f"{package}.{sub}")
        except (ImportError, ValueError):
            sub_spec = None
        if sub_spec is None:
            continue
        if sub_spec.submodule_search_locations:
            for loc in sub_spec.submodule_search_locations:
                files.update(Path(loc).rglob("*.py"))
        elif sub_spec.origin and Path(sub_spec.origin).is_file():
            files.add(Path(sub_spec.origin))
    digest = hashlib.sha1()
    for path in sorted(files):
        try:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        except OSError:
            continue
    return digest.hexdigest()[:12]


def base_metadata(threads: int | None = None) -> dict:
    """Hardware, software versions, commit, date; torch is imported here."""
    import torch

    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "areal_fast_commit": git_commit(),
    }
    if threads is not None:
        meta["threads"] = threads
    try:
        import areal_fast

        meta["areal_fast_version"] = getattr(areal_fast, "__version__", None)
    except Exception as exc:  # the import failure is reported by the run itself
        meta["areal_fast_version"] = f"import failed: {exc}"
    return meta


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    """Format a number, or '–' for None."""
    if value is None:
        return "–"
    return f"{value:{spec}}{suffix}"


def write_json(path, data, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path`` (nothing if empty) atomically: parents created, a
    temporary file renamed into place, so a killed benchmark never leaves half a file."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)


@contextmanager
def native_disabled(disabled: bool):
    """Within the block, areal_fast's native extension is off (``disabled``) or allowed
    (through its environment switch); the previous setting is restored after."""
    from areal_fast import _native

    old = os.environ.get(_native.DISABLE_ENV)
    os.environ[_native.DISABLE_ENV] = "1" if disabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_native.DISABLE_ENV, None)
        else:
            os.environ[_native.DISABLE_ENV] = old


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)
