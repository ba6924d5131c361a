"""The LM-head benchmark with every case in one process: on CUDA (bf16, CUDA events,
``torch.cuda.max_memory_allocated``) or, with ``--in-process``, on the CPU (float32, wall
clock, the resident-set peak): the same orchestration at any size, so that a run on the CPU
exercises what a GPU run does.

Per case: build the op, ``warmup`` calls, one call measured for memory, then up to
``repeats`` timed calls (stopping after 3 once ``case_budget`` seconds are spent). Every
warning raised during the case is recorded. A case is marked ``fell_back`` when one of those
warnings says a slower path ran (:func:`_lm_head_baselines.fallback_reasons`), when Liger's
compiled call failed over to eager, or when areal_fast's op took another row path than
Triton on CUDA; it is marked ``materialised_logits`` when its extra peak memory, less the
gradient buffers, reaches the size of the [T, V] logits in the input dtype.

The compiled baselines (``compiled_loss``, ``liger_grpo``) compile on their first call.
:func:`run_warmup` makes that call in a process of its own (``--warmup-only``), which fills
the compilers' on-disk caches (inductor, Triton) and records whether the compile succeeded
and how long it took. :func:`run_in_process` given that record (``--warmup-json``) runs Liger
compiled only where its warm-up compiled (else ``compiled=False``, said so in the record) and
skips ``compiled_loss`` where its warm-up did not finish, instead of compiling cold inside
the timed run's budget.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from importlib import metadata
from pathlib import Path

import _harness as hx
from _lm_head_baselines import Skip, fallback_reasons
from _lm_head_ops import (
    COMPILED_IMPLS,
    DTYPES,
    SHAPES,
    OpOptions,
    add_ratios,
    build_op,
    grad_checks,
    make_inputs,
    modes_of,
    parse_impl,
    shape_entry,
    shape_name,
)


class Probe:
    """Clock and memory of one device: CUDA events and the caching allocator's peak, or the
    wall clock and the resident-set peak (VmHWM) of this process on the CPU."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.cuda = device == "cuda"

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def memory_start(self) -> int | None:
        """Reset the peak counter; the bytes in use now (the baseline)."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return self.torch.cuda.memory_allocated()
        hx.reset_peak_rss()
        return hx.rss_bytes()

    def extra_mb(self, base: int | None) -> float | None:
        """Peak since :meth:`memory_start` above its baseline, MiB."""
        self.sync()
        peak = self.torch.cuda.max_memory_allocated() if self.cuda else hx.peak_rss_bytes()
        return None if base is None or peak is None else (peak - base) / hx.MIB

    def seconds(self, fn) -> float:
        """Seconds of one call of ``fn`` (CUDA events around it on CUDA)."""
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def release(self) -> None:
        """Free what the last case left (and the CUDA allocator's cached blocks)."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def time_case(fn, reset, inputs, probe: Probe, *, warmup: int, repeats: int, budget_s: float):
    """(checks, extra peak MiB, first call s, timed seconds) of one case: ``warmup`` calls
    (the first one timed on its own: compilation, autotuning), one call measured for memory,
    then up to ``repeats`` timed calls (at least 3 before ``budget_s`` may stop them)."""
    first_s = None
    for i in range(warmup):
        seconds = probe.seconds(fn)
        first_s = seconds if i == 0 else first_s
        reset()
    base = probe.memory_start()
    checks = fn()
    extra = probe.extra_mb(base)
    checks.update(grad_checks(inputs))
    reset()
    times, spent = [], 0.0
    for i in range(repeats):
        times.append(probe.seconds(fn))
        reset()
        spent += times[-1]
        if i >= 2 and spent > budget_s:
            break
    return checks, extra, first_s, times


def mark_case(rec: dict, entry: dict, mode: str, messages: list[str], cuda: bool) -> None:
    """Record the warnings of a case and set ``fell_back`` / ``materialised_logits``."""
    if messages:
        rec["warnings"] = [m[:300] for m in messages]
    reasons = fallback_reasons(messages)
    info = rec.get("info", {})
    if info.get("fallback"):
        reasons.append(info["fallback"])
    if cuda and info.get("path") not in (None, "triton"):
        reasons.append(f"areal_fast ran its {info['path']} row path, not Triton")
    rec["fell_back"] = bool(reasons)
    if reasons:
        rec["fallback_reasons"] = reasons
    extra = rec.get("extra_peak_mb")
    if extra is not None:
        own = extra - (entry["grad_buffers_mb"] if mode == "fwd_bwd" else 0.0)
        rec["materialised_logits"] = own >= entry["logits_mb"]


def read_warmup(path) -> dict | None:
    """The warm-up run's JSON (``--warmup-json``); a missing or unreadable file reads as a
    warm-up that never finished."""
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {"impls": {}, "finished": False, "missing": str(path)}


def _warm_reason(rec: dict | None) -> str:
    if rec is None:
        return "its warm-up did not run or did not finish (killed at its budget?)"
    for key in ("error", "fallback", "skipped"):
        if rec.get(key):
            return f"warm-up: {rec[key]}"
    return "warm-up did not compile it"


def options_for(impl: str, args, warm: dict | None) -> tuple[OpOptions, str | None]:
    """Build options of ``impl`` given the warm-up record, and a note for the case.

    Raises
    ------
    Skip
        ``compiled_loss`` whose warm-up did not compile (it is not compiled cold here).
    """
    base = parse_impl(impl)[0]
    if warm is None or base not in COMPILED_IMPLS:
        return OpOptions(compile_backend=args.compile_backend), None
    rec = warm.get("impls", {}).get(base)
    ok = rec is not None and rec.get("compiled") is True and not rec.get("error")
    if base == "compiled_loss":
        if not ok:
            raise Skip(f"not timed: {_warm_reason(rec)}")
        return OpOptions(compile_backend=args.compile_backend), None
    if ok:
        return OpOptions(liger_compiled=True, compile_backend=args.compile_backend), None
    note = f"Liger ran compiled=False: {_warm_reason(rec)}"
    return OpOptions(liger_compiled=False, compile_backend=args.compile_backend), note


def run_case(impl, mode, inputs, entry, args, probe: Probe, warm) -> dict:
    """One (impl, mode) case; the result record (never raises: errors are recorded)."""
    rec = {"impl": impl, "mode": mode}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            options, note = options_for(impl, args, warm)
            if note:
                rec["note"] = note
            fn, reset = build_op(impl, mode, inputs, options)
            warmup = 2 if parse_impl(impl)[0] == "liger_grpo" else 1
            checks, extra, first_s, times = time_case(
                fn, reset, inputs, probe, warmup=warmup, repeats=args.repeats,
                budget_s=args.case_budget,
            )  # fmt: skip
            rec.update(hx.summarize_times(times), extra_peak_mb=extra, times_s=times)
            rec.update(first_call_s=first_s, checks=checks, info=dict(fn.info))
            if "compiled" in fn.info:
                rec["liger_compiled"] = fn.info["compiled"]
        except Skip as exc:
            rec["skipped"] = str(exc)
        except Exception as exc:  # e.g. out of memory: record it, go on
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            inputs["hidden"].grad = None
            inputs["weight"].grad = None
            probe.release()
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    mark_case(rec, entry, mode, messages, probe.cuda)
    rec["case_wall_s"] = time.perf_counter() - start
    return rec


def _metadata(args, torch) -> dict:
    meta = hx.base_metadata(torch.get_num_threads())
    cuda = args.device == "cuda"
    meta.update(device=args.device, dtype=DTYPES[args.device], orchestration="in_process")
    meta.update(compile_backend=args.compile_backend)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30)
        meta.update(cuda=torch.version.cuda, allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    for dist in ("triton", "liger-kernel"):
        try:
            meta[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            meta[dist.replace("-", "_")] = None
    return meta


def _check_device(args):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        hx.eprint(
            "bench_logprobs: error: --device cuda needs a CUDA device "
            f"(torch {torch.__version__} sees none)"
        )
        raise SystemExit(2)
    return torch


def _shape_entry(shape, device: str) -> dict:
    entry = shape_entry(shape, DTYPES[device], grad_bytes=2 if device == "cuda" else 4)
    T, _, V = shape
    entry["logits_mb"] = T * V * (2 if device == "cuda" else 4) / hx.MIB
    return entry


def run_in_process(args) -> dict:
    """Every (shape, mode, impl) case in this process; the results (``args.json`` is
    rewritten after every case, so a run cut short keeps what it measured)."""
    torch = _check_device(args)
    probe = Probe(args.device)
    warm = read_warmup(args.warmup_json)
    out = {"metadata": _metadata(args, torch), "results": [], "notes": []}
    if warm is not None:
        out["warmup"] = warm
    for shape in [args.shape] if args.shape else SHAPES[args.device][args.shapes]:
        entry = _shape_entry(shape, args.device)
        out["results"].append(entry)
        inputs = make_inputs(shape, DTYPES[args.device], args.device, args.seed, with_loss=True)
        for mode in args.modes:
            entry["modes"][mode] = cases = {}
            for impl in args.impls:
                if mode not in modes_of(impl, "cuda"):
                    continue
                hx.eprint(f"[{shape_name(shape)} {mode}] {impl} ...")
                cases[impl] = rec = run_case(impl, mode, inputs, entry, args, probe, warm)
                hx.eprint("    " + one_line(rec))
                if "skipped" in rec or "error" in rec:
                    why = rec.get("skipped", rec.get("error", ""))
                    out["notes"].append(f"{shape_name(shape)} {mode} {impl}: {why}")
                add_ratios(entry, shape, mode)
                hx.write_json(args.json, out)
        mm = entry["modes"].get("fwd", {}).get("matmul", {}).get("median_s")
        if mm:
            entry["mm_tflops"] = 2.0 * shape[0] * shape[1] * shape[2] / mm / 1e12
        del inputs
        probe.release()
    return out


def run_warmup(args) -> dict:
    """First (compiling) and second calls of each compiled baseline at the first shape, in
    this process; ``finished`` is set only at the end, so a warm-up killed at its budget
    reads as unfinished. ``args.json`` is rewritten after every implementation."""
    torch = _check_device(args)
    probe = Probe(args.device)
    shape = args.shape or SHAPES[args.device][args.shapes][0]
    out = {"metadata": _metadata(args, torch), "shape": list(shape), "impls": {}}
    out["finished"] = False
    inputs = make_inputs(shape, DTYPES[args.device], args.device, args.seed, with_loss=True)
    for impl in args.impls:
        rec = {}
        hx.eprint(f"[warm-up {shape_name(shape)}] {impl} ...")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn, reset = build_op(impl, "fwd_bwd", inputs, OpOptions(True, args.compile_backend))
                rec["first_call_s"] = probe.seconds(fn)
                reset()
                rec["second_call_s"] = probe.seconds(fn)
                reset()
                rec.update(fn.info)
                rec.setdefault("compiled", True)  # compiled_loss: compiled or raised
            except Skip as exc:
                rec["skipped"] = str(exc)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                inputs["hidden"].grad = inputs["weight"].grad = None
                probe.release()
        rec["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})
        out["impls"][impl] = rec
        hx.eprint(f"    {rec}")
        hx.write_json(args.json, out)
    out["finished"] = True
    hx.write_json(args.json, out)
    return out


def one_line(rec: dict) -> str:
    """A case's result in one line (progress output)."""
    if "skipped" in rec:
        return f"skipped: {rec['skipped']}"
    if "error" in rec:
        return f"FAILED: {rec['error']}"
    mem = rec.get("extra_peak_mb")
    flags = [f for f in ("fell_back", "materialised_logits") if rec.get(f)]
    return (
        f"median {rec['median_s']:.4f} s (p20 {rec['p20_s']:.4f}, p80 {rec['p80_s']:.4f}), "
        f"extra peak {hx.fmt(mem, '.1f')} MB, checks {rec.get('checks')}"
        + (f" [{', '.join(flags)}]" if flags else "")
    )
