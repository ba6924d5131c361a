"""Benchmark of token log-probs through the LM head, and of the fused linear GRPO loss.

Implementations compared in one run (time and extra peak memory side by side; the cases,
inputs and ops are in ``_lm_head_ops.py``, the baselines in ``_lm_head_baselines.py``):

- ``ours``: ``areal_fast.linear_logprobs`` (default dispatch); ``ours[NAME]`` passes
  ``impl=NAME`` (auto | torch | native | triton) and is skipped where that keyword is absent;
- ``naive``: logits = hidden @ weightᵀ materialised as [T, V] fp32, ``log_softmax``, gather at
  the labels; autograd backward;
- ``torch_lce``: ``-torch.nn.functional.linear_cross_entropy(..., reduction="none")`` in the
  form the installed torch has (chunked with ``options=LinearCrossEntropyOptions()``; the
  reference implementation, which materialises the logits, where it has no ``options=``;
  skipped where it has none);
- ``matmul``: ``hidden @ weightᵀ`` alone (forward only), the rate the others are read against;
- loss rows (forward + backward of the scalar loss only): ``fused_loss``
  (``areal_fast.fused_linear_grpo_loss`` with a default ``LossConfig``), ``ours_loss``
  (``linear_logprobs`` then ``grpo_loss``), ``naive_loss`` (naive log-probs then
  ``grpo_loss``), ``compiled_loss`` (the same loss in plain torch, chunked, each chunk under
  ``torch.compile``) and, with every case in one process when importable, ``liger_grpo``
  (``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``, token-mean "dapo" loss, no KL).

Modes: ``fwd`` (under ``torch.no_grad``) and ``fwd_bwd`` (backward of a random per-token
upstream gradient for the log-prob rows; of the scalar loss for the loss rows, which run
fwd_bwd only, except ``fused_loss`` in one process, also timed ``fwd``: the loss value). Every
backward produces ``hidden.grad`` and ``weight.grad``; they are dropped between repeats.

CPU (``--device cpu``): each (impl, shape, mode) runs in a fresh child process. The child
builds the inputs (fixed seed), resets the peak resident set (``/proc/self/clear_refs``),
reads VmRSS as the baseline, runs the op once, reads VmHWM, and reports
extra = VmHWM − baseline; it then times ``--repeats`` further calls (measuring the extra peak
again around the first of them, "warm") and prints one JSON line. Children run with
``MALLOC_MMAP_THRESHOLD_`` fixed, so freed tensors leave the resident set. With ``--rounds R``
the whole list of cases runs R times in turn and each case reports the times of all its
rounds (memory from the first), so a load that drifts during the run reaches every case alike,
and the ratios to the references are also computed round by round (paired ratios: median and
range, beside the ratio of the medians).

One process (``--device cuda``, bf16, CUDA events, ``torch.cuda.max_memory_allocated``; or
``--device cpu --in-process``, float32, wall clock, resident-set peak): see
``_lm_head_inprocess.py``: warnings recorded per case, cases that fell back or materialised
the logits flagged, the compiled baselines warmed up apart (``--warmup-only``,
``--warmup-json``). Throughput is reported as model FLOP/s (2·T·H·V per forward, 6·T·H·V per
forward + backward, whatever an implementation recomputes) and as a fraction of the
``torch.mm`` rate of the same shape measured in the same run.

Usage::

    python benches/bench_logprobs.py --device cpu --json OUT.json [--shapes small|large]
        [--shape T,H,V] [--repeats N] [--rounds R] [--threads N] [--impls ours,naive,...]
        [--modes fwd,fwd_bwd] [--snapshot]
    python benches/bench_logprobs.py --device cuda --json OUT.json [--shapes small|large]
        [--warmup-json WARM.json]
    python benches/bench_logprobs.py --device cuda --warmup-only --json WARM.json
    python benches/bench_logprobs.py --device cpu --in-process --shape 512,64,2003
    python benches/bench_logprobs.py --table OUT.json   # table of an earlier/partial run
    pytest benches/bench_logprobs.py          # pytest-benchmark, small CPU shape
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as hx  # noqa: E402
from _lm_head_baselines import Skip  # noqa: E402
from _lm_head_inprocess import one_line, run_in_process, run_warmup  # noqa: E402
from _lm_head_ops import (  # noqa: E402
    COMPILED_IMPLS,
    DEFAULT_IMPLS,
    DTYPES,
    MODES,
    SEED,
    SHAPES,
    add_ratios,
    baseline_of,
    build_op,
    grad_checks,
    is_loss,
    make_inputs,
    modes_of,
    shape_entry,
    shape_name,
    valid_impl,
)

# CPU children: glibc serves allocations of at least this many bytes with mmap and returns
# them on free (a fixed threshold also stops glibc from raising it after large frees), so
# the resident set follows live tensors instead of keeping freed blocks in the heap.
MALLOC_MMAP_THRESHOLD = 65536


# ---------------------------------------------------------------------------
# CPU: one child process per (impl, shape, mode)
# ---------------------------------------------------------------------------


def run_child(args) -> dict:
    """Body of a child process; returns the result record (printed as one JSON line)."""
    shape = args.shape
    record = {
        "impl": args.impl,
        "mode": args.mode,
        "shape": list(shape),
        "dtype": args.dtype,
        "threads": args.threads,
        "loadavg_start": os.getloadavg()[0],
    }
    if os.environ.get(SOURCE_ENV):
        use_source(os.environ[SOURCE_ENV])
    import torch

    import areal_fast

    record["areal_fast_file"] = areal_fast.__file__
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        inputs = make_inputs(shape, args.dtype, "cpu", args.seed, is_loss(args.impl))
        fn, reset = build_op(args.impl, args.mode, inputs)
    except Skip as exc:
        record["skipped"] = str(exc)
        return record
    record["code"] = hx.code_fingerprint()
    record["inputs_mb"] = sum(t.numel() * t.element_size() for t in inputs.values()) / hx.MIB
    gc.collect()
    record["peak_reset"] = hx.reset_peak_rss()
    base = hx.rss_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        checks = fn()
        first_s = time.perf_counter() - start
    peak = hx.peak_rss_bytes()
    record["baseline_rss_mb"] = base / hx.MIB
    record["peak_rss_mb"] = peak / hx.MIB
    record["extra_peak_mb"] = (peak - base) / hx.MIB
    record["first_call_s"] = first_s
    record["checks"] = {**checks, **grad_checks(inputs)}
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    if messages:
        record["warnings"] = [m[:300] for m in messages[:3]]
    reset()
    # Timed calls; the first of them is measured again for memory ("warm": one-time costs
    # of the first call, such as lazily imported modules, are then already paid).
    times = []
    for i in range(args.repeats):
        if i == 0:
            gc.collect()
            hx.reset_peak_rss()
            base = hx.rss_bytes()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i == 0:
            record["extra_peak_mb_warm"] = (hx.peak_rss_bytes() - base) / hx.MIB
        reset()
    record.update(hx.summarize_times(times))
    record["times_s"] = times
    record["loadavg_end"] = os.getloadavg()[0]
    return record


SOURCE_ENV = "AREAL_FAST_BENCH_SOURCE"


def make_snapshot() -> tuple[str, str]:
    """Copy the committed areal_fast (git HEAD: areal_fast/ and kernels/, laid out as the
    wheel lays them out) and the importable compiled extension into a temporary directory;
    returns (directory, commit). Children then import that copy, so edits to the checkout
    during a long run do not reach them."""
    import importlib.util
    import io
    import shutil
    import tarfile
    import tempfile

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=hx.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD", "areal_fast", "kernels"],
        cwd=hx.REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout
    root = tempfile.mkdtemp(prefix="areal_fast_bench_")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    pkg = Path(root, "areal_fast")
    if Path(root, "kernels").is_dir() and not (pkg / "kernels").exists():
        shutil.move(str(Path(root, "kernels")), str(pkg / "kernels"))
    spec = importlib.util.find_spec("areal_fast._C")
    if spec is not None and spec.origin and Path(spec.origin).is_file():
        shutil.copy2(spec.origin, pkg / Path(spec.origin).name)
    return root, commit


def use_source(path: str) -> None:
    """Import areal_fast from ``path``: put it first on sys.path and drop import hooks (such
    as an editable install's redirecting finder) that would resolve areal_fast elsewhere."""
    import importlib.machinery as machinery

    standard = (machinery.BuiltinImporter, machinery.FrozenImporter, machinery.PathFinder)
    for finder in list(sys.meta_path):
        if finder in standard:
            continue
        try:
            spec = finder.find_spec("areal_fast", None)
        except Exception:
            spec = None
        if spec is not None:
            sys.meta_path.remove(finder)
    sys.path.insert(0, path)


def launch_child(impl, shape, mode, args) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--impl",
        impl,
        "--mode",
        mode,
        "--shape",
        ",".join(map(str, shape)),
        "--dtype",
        DTYPES["cpu"],
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MALLOC_MMAP_THRESHOLD))
    if args.source:
        env[SOURCE_ENV] = args.source
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.child_timeout,
            cwd=hx.REPO_ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {
            "impl": impl,
            "mode": mode,
            "shape": list(shape),
            "error": f"timed out after {args.child_timeout} s",
        }
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = (
            f"killed by signal {-proc.returncode} (out of memory?)"
            if proc.returncode < 0
            else f"exit code {proc.returncode}"
        )
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"impl": impl, "mode": mode, "shape": list(shape), "error": f"{why}: {tail}"}
    record = json.loads(lines[-1])
    record["child_wall_s"] = wall
    return record


def selected_shapes(args, device: str) -> list:
    """``--shape T,H,V`` alone if given, else the ``--shapes`` set of ``device``."""
    return [args.shape] if args.shape else SHAPES[device][args.shapes]


def run_cpu(args) -> dict:
    shapes = selected_shapes(args, "cpu")
    meta = hx.base_metadata(args.threads)
    args.source = None
    if args.snapshot:
        import shutil

        args.source, commit = make_snapshot()
        meta.update(areal_fast_commit=commit, snapshot=True)
        hx.eprint(f"children import the committed areal_fast {commit} from {args.source}")
        try:
            return _run_cpu_cases(args, shapes, meta)
        finally:
            shutil.rmtree(args.source, ignore_errors=True)
    return _run_cpu_cases(args, shapes, meta)


def _run_cpu_cases(args, shapes, meta) -> dict:
    meta.update(
        device="cpu",
        dtype=DTYPES["cpu"],
        repeats=args.repeats,
        rounds=args.rounds,
        memory="extra = VmHWM - VmRSS around the first call, fresh process per case",
        malloc_mmap_threshold=MALLOC_MMAP_THRESHOLD,
    )
    out = {"metadata": meta, "results": [], "notes": []}
    entries = [shape_entry(shape, DTYPES["cpu"], grad_bytes=4) for shape in shapes]
    out["results"] = entries
    for round_index in range(args.rounds):
        for shape, entry in zip(shapes, entries):
            for mode in args.modes:
                cases = entry["modes"].setdefault(mode, {})
                for impl in args.impls:
                    if mode not in modes_of(impl):
                        continue
                    if round_index and not cases.get(impl, {}).get("times_s"):
                        continue  # skipped or failed in an earlier round
                    label = f" (round {round_index + 1}/{args.rounds})" if args.rounds > 1 else ""
                    hx.eprint(f"[{shape_name(shape)} {mode}] {impl}{label} ...")
                    rec = launch_child(impl, shape, mode, args)
                    hx.eprint("    " + one_line(rec))
                    if round_index:
                        _merge_round(cases[impl], rec)
                    else:
                        cases[impl] = rec
                        rec["loadavg_rounds"] = [[rec.get("loadavg_start"), rec.get("loadavg_end")]]
                        if "times_s" in rec:
                            rec["round_times_s"] = [rec["times_s"]]
                    if "skipped" in rec or "error" in rec:
                        why = rec.get("skipped", rec.get("error", ""))
                        note = f"{shape_name(shape)} {mode} {impl}{label}: {why}"
                        out["notes"].append(note)
                    add_ratios(entry, shape, mode)
                    hx.write_json(args.json, out)
    for entry in out["results"]:
        for mode in entry["modes"]:
            add_ratios(entry, tuple(entry[k] for k in "THV"), mode)
    codes = sorted(
        {
            rec["code"]
            for e in out["results"]
            for c in e["modes"].values()
            for rec in c.values()
            if rec.get("code")
        }
    )
    meta["code_fingerprints"] = codes
    if len(codes) > 1:
        out["notes"].append(
            f"areal_fast changed during the run: {len(codes)} different code "
            f"fingerprints across the cases ({', '.join(codes)})"
        )
    return out


def _merge_round(rec: dict, later: dict) -> None:
    """Add the timed calls of a later round's child to ``rec`` (memory stays the first
    round's); a failed later round is recorded (``None`` in ``round_times_s``) and leaves the
    times as they were."""
    if "times_s" not in later:
        rec.setdefault("round_errors", []).append(later.get("error", later.get("skipped")))
        rec.setdefault("round_times_s", []).append(None)
        return
    rec.setdefault("round_times_s", []).append(later["times_s"])
    rec["times_s"] = rec["times_s"] + later["times_s"]
    rec.update(hx.summarize_times(rec["times_s"]))
    rec["loadavg_rounds"].append([later.get("loadavg_start"), later.get("loadavg_end")])
    rec["loadavg_end"] = later.get("loadavg_end")
    rec["first_calls_s"] = rec.get("first_calls_s", [rec.get("first_call_s")]) + [
        later.get("first_call_s")
    ]


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def render_table(data: dict) -> str:
    """Markdown report of a run (either runner): a title line, one row per case, then the
    memory and ratio definitions, each case's checks and the notes."""
    meta = data["metadata"]
    cuda = meta.get("device") == "cuda"
    in_process = cuda or meta.get("orchestration") == "in_process"
    unit = "ms" if cuda else "s"
    hw = (
        f"{meta.get('gpu')}, CUDA {meta.get('cuda')}"
        if cuda
        else f"{meta.get('cpu')}, {meta.get('nproc')} CPUs, {meta.get('threads')} threads"
    )
    lines = [
        f"{meta['date'][:10]} | {hw} | torch {meta['torch']} | areal_fast "
        f"{meta.get('areal_fast_commit')} | {meta.get('dtype')}"
        + (" | every case in one process" if in_process and not cuda else ""),
        "",
    ]
    headers = ["shape", "mode", "impl", f"median {unit}", f"p20 {unit}", f"p80 {unit}"]
    headers += ["extra peak MB"] + ([] if in_process else ["warm MB"])
    headers += [f"model {'TFLOP/s' if cuda else 'GFLOP/s'}", "× mm rate"]
    headers += ["time / naive(_loss)", "paired / naive(_loss)", "peak / naive(_loss)"]
    headers += [] if in_process else ["warm peak / naive(_loss)"]
    headers += ["time / torch_lce (ours_loss)", "paired / torch_lce (ours_loss)", "flags"]
    rows = [
        _table_row(entry, mode, impl, rec, cuda, in_process)
        for entry in data["results"]
        for mode, cases in entry["modes"].items()
        for impl, rec in cases.items()
    ]
    lines.append(hx.markdown_table(headers, rows))
    lines.append("")
    lines.append(_table_legend(data, cuda, in_process))
    lines += _table_details(data)
    return "\n".join(lines)


def _table_row(entry, mode, impl, rec, cuda: bool, in_process: bool) -> list:
    row = [entry["name"], mode, impl]
    width = 14 if not in_process else 12
    if "skipped" in rec or "error" in rec:
        why = "skipped" if "skipped" in rec else "FAILED"
        return row + [why] + [""] * (width - 2) + [_flags(rec)]
    ref = baseline_of(impl)
    second = "torch_lce" if not is_loss(impl) else "ours_loss"
    scale = 1e3 if cuda else 1.0
    rate = rec.get("model_gflops_per_s")
    row += [hx.fmt(rec[k] * scale, ".4g") for k in ("median_s", "p20_s", "p80_s")]
    row.append(hx.fmt(rec.get("extra_peak_mb"), ".1f"))
    if not in_process:
        row.append(hx.fmt(rec.get("extra_peak_mb_warm"), ".1f"))
    row.append(hx.fmt(None if rate is None else (rate / 1e3 if cuda else rate), ".1f"))
    row.append(hx.fmt(rec.get("matmul_rate_fraction"), ".2f"))
    row.append(_ratio(rec, "time_ratio_vs_" + ref, ref, impl))
    row.append(_paired(rec, ref, impl))
    row.append(_ratio(rec, "peak_mem_ratio_vs_" + ref, ref, impl))
    if not in_process:
        row.append(_ratio(rec, "peak_mem_ratio_vs_" + ref + "_warm", ref, impl))
    row.append(_ratio(rec, "time_ratio_vs_" + second, second, impl))
    row.append(_paired(rec, second, impl))
    return row + [_flags(rec)]


def _flags(rec: dict) -> str:
    """What the reader must know about a case beside its numbers."""
    flags = []
    if rec.get("fell_back"):
        flags.append("FELL BACK")
    if rec.get("materialised_logits"):
        flags.append("materialised logits")
    if rec.get("liger_compiled") is False:
        flags.append("Liger compiled=False")
    if rec.get("info", {}).get("variant") == "reference":
        flags.append("torch reference path")
    return "; ".join(flags)


def _table_legend(data: dict, cuda: bool, in_process: bool) -> str:
    if cuda:
        memory = (
            "extra peak MB: peak allocated by one call after warm-up "
            "(max_memory_allocated − memory_allocated)"
        )
    elif in_process:
        memory = "extra peak MB: VmHWM − VmRSS around one call after warm-up, in one process"
    else:
        memory = (
            "extra peak MB: VmHWM − VmRSS around the first call in a fresh process; warm MB: "
            "the same around the first timed call (one-time costs already paid)"
        )
    return (
        f"{memory}. Both include hidden.grad + weight.grad on fwd_bwd rows ("
        + ", ".join(f"{e['name']}: {e['grad_buffers_mb']:.0f} MB" for e in data["results"])
        + "). Model rate counts 2·T·H·V flops per forward, 6·T·H·V per forward + backward; "
        "× mm rate divides it by the rate of `matmul` (hidden @ weightᵀ) of the same shape. "
        "Ratios are this row / the reference (lower is better): `naive` and `torch_lce` for "
        "log-prob rows, `naive_loss` and `ours_loss` for loss rows; time is the ratio of the "
        "medians, paired the median [range] of the ratios computed round by round "
        "(`--rounds`, both cases of a round timed a few seconds apart). Flags: FELL BACK (a "
        "warning or the row path says a slower path ran), materialised logits (extra peak, "
        "less the gradients, reached the [T, V] logits), Liger compiled=False (its compiled "
        "path did not run), torch reference path (this torch's linear_cross_entropy has no "
        "chunked path)."
    )


def _table_details(data: dict) -> list[str]:
    checks, flagged = [], []
    for entry in data["results"]:
        for mode, cases in entry["modes"].items():
            for impl, rec in cases.items():
                label = f"{entry['name']} {mode} {impl}"
                if rec.get("checks") and impl != "matmul":
                    checks.append(
                        f"{label}: " + ", ".join(f"{k}={v:.6g}" for k, v in rec["checks"].items())
                    )
                why = rec.get("fallback_reasons", []) + ([rec["note"]] if rec.get("note") else [])
                if why:
                    flagged.append(f"{label}: " + " | ".join(why))
    lines = []
    for title, items in (
        ("Agreement (same inputs in every case):", checks),
        ("Fallbacks and notes per case:", flagged),
        ("Notes:", data.get("notes") or []),
    ):
        if items:
            lines += ["", title] + ["- " + item for item in items]
    return lines


def _paired(rec: dict, ref: str, impl: str) -> str:
    if impl == ref:
        return "1"
    paired = rec.get(f"paired_time_ratio_vs_{ref}")
    if not paired:
        return ""
    return f"{paired['median']:.3g} [{paired['min']:.3g}–{paired['max']:.3g}]"


def _ratio(rec, key, ref, impl) -> str:
    if impl == ref:
        return "1"
    value = rec.get(key)
    return "" if value is None else f"{value:.3g}"


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--json", help="write the results here (updated after every case)")
    add("--shapes", choices=("small", "large"), default="large")
    add("--shape", metavar="T,H,V", help="run only this shape (e.g. 2048,2048,151936)")
    add("--repeats", type=int, default=None, help="timed calls per case (3 on CPU, 10 on CUDA)")
    add("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (CPU)")
    add("--impls", default=None, help="comma-separated subset, e.g. ours,naive,ours[triton]")
    add(
        "--rounds",
        type=int,
        default=1,
        help="CPU children: run the whole list of cases "
        "this many times in turn; each case reports every round's calls and paired ratios",
    )
    add("--modes", default=",".join(MODES))
    add("--seed", type=int, default=SEED)
    add("--table", metavar="JSON", help="only print the table of an earlier (or partial) run")
    add(
        "--child-timeout",
        type=float,
        default=3600.0,
        help="seconds before a CPU child is abandoned",
    )
    add(
        "--snapshot",
        action="store_true",
        help="CPU children import a copy of the committed "
        "areal_fast (git HEAD plus the installed compiled extension) instead of the checkout",
    )
    add(
        "--case-budget",
        type=float,
        default=5.0,
        help="in one process: stop timing a case after this many seconds (>= 3 calls)",
    )
    add(
        "--in-process",
        action="store_true",
        help="CPU: every case in this process, as on "
        "CUDA (float32, wall clock, resident-set peak): the CUDA run's orchestration on the CPU",
    )
    add(
        "--warmup-only",
        action="store_true",
        help="first (compiling) calls of the compiled "
        f"baselines ({', '.join(COMPILED_IMPLS)}) at the first shape, recorded in --json",
    )
    add(
        "--warmup-json",
        metavar="JSON",
        help="a --warmup-only run's record: Liger runs "
        "compiled only if it compiled there, compiled_loss is skipped if it did not",
    )
    add(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of compiled_loss (eager: traced, no code generated)",
    )
    # child-process arguments (internal)
    add("--child", action="store_true", help=argparse.SUPPRESS)
    add("--impl", help=argparse.SUPPRESS)
    add("--mode", help=argparse.SUPPRESS)
    add("--dtype", default="float32", help=argparse.SUPPRESS)
    return parser  # fmt: skip


def parse_args(argv=None):
    """Parsed and checked arguments; ``impls``, ``modes`` and ``shape`` as lists/tuples."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.device == "cpu" else 10
    for name in ("repeats", "threads", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.shape is not None:
        raw = args.shape
        try:
            args.shape = tuple(int(x) for x in raw.split(","))
        except ValueError:
            args.shape = ()
        if len(args.shape) != 3 or min(args.shape) < 1:
            parser.error(f"--shape takes three positive integers T,H,V, got {raw!r}")
    if args.table and not Path(args.table).is_file():
        parser.error(f"--table {args.table}: no such file")
    if args.child:
        if not (args.impl and args.mode in MODES and args.shape):
            parser.error("--child needs --impl, --mode and --shape")
        return args
    args.in_process = args.in_process or args.device == "cuda"
    layout = "cuda" if args.in_process else "cpu"
    impls = args.impls.split(",") if args.impls else list(DEFAULT_IMPLS[layout])
    if args.warmup_only:
        impls = [i for i in impls if i in COMPILED_IMPLS] if not args.impls else impls
        if not args.in_process or any(i not in COMPILED_IMPLS for i in impls):
            parser.error(f"--warmup-only runs in one process (--device cuda or --in-process) "
                         f"and takes --impls from {COMPILED_IMPLS}, got {impls}")  # fmt: skip
    bad = [i for i in impls if not valid_impl(i, layout)]
    if bad:
        where = "in one process" if args.in_process else "in CPU children"
        parser.error(f"unknown implementation(s) {where} (--device {args.device}): {bad}")
    args.impls = impls
    modes = list(dict.fromkeys(args.modes.split(",")))  # each mode once
    if any(m not in MODES for m in modes):
        parser.error(f"--modes takes a subset of {MODES}")
    args.modes = modes
    return args


def main(argv=None) -> int:
    """Run the benchmark (or print ``--table``); 0 on success."""
    args = parse_args(argv)
    if args.table:
        print(render_table(json.loads(Path(args.table).read_text())), flush=True)
        return 0
    if args.child:
        record = run_child(args)
        print(json.dumps(record), flush=True)
        return 0
    if args.warmup_only:
        run_warmup(args)
        return 0
    data = run_in_process(args) if args.in_process else run_cpu(args)
    hx.write_json(args.json, data)
    print(render_table(data), flush=True)
    return 0


# ---------------------------------------------------------------------------
# pytest-benchmark (small CPU shape, time only)
# ---------------------------------------------------------------------------

pytest = None
if __name__ != "__main__":
    try:
        import pytest
    except ImportError:  # imported without pytest installed
        pass

if pytest is not None:

    @pytest.mark.parametrize(
        "impl,mode",
        [
            (impl, mode)
            for impl in ("ours", "naive", "torch_lce", "fused_loss", "naive_loss")
            for mode in modes_of(impl)
        ],
    )
    def test_linear_logprobs(benchmark, impl, mode):
        shape = SHAPES["cpu"]["small"][0]
        inputs = make_inputs(shape, "float32", "cpu", SEED, is_loss(impl))
        try:
            fn, reset = build_op(impl, mode, inputs)
        except Skip as exc:
            pytest.skip(str(exc))

        def call():
            checks = fn()
            reset()
            return checks

        checks = benchmark.pedantic(call, rounds=5, iterations=1, warmup_rounds=1)
        assert all(math.isfinite(v) for v in checks.values())
        benchmark.extra_info.update(shape=shape_name(shape), **checks)


if __name__ == "__main__":
    sys.exit(main())
