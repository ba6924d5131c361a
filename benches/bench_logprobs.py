"""Benchmark of token log-probs through the LM head, and of the fused linear GRPO loss.

Implementations compared in one run (time and extra peak memory side by side):

- ``ours``: ``areal_fast.linear_logprobs`` (default dispatch); ``ours[NAME]`` passes
  ``impl=NAME`` (auto | torch | native | triton) and is skipped where that keyword is absent;
- ``naive``: logits = hidden @ weightᵀ materialised as [T, V] fp32, ``log_softmax``, gather at
  the labels; autograd backward;
- ``torch_lce``: ``-torch.nn.functional.linear_cross_entropy(..., reduction="none",
  options=LinearCrossEntropyOptions())``, torch's chunked path (``options=None`` would
  materialise the logits);
- ``matmul``: ``hidden @ weightᵀ`` alone (forward only), the rate the others are read against;
- loss rows (forward + backward of the scalar loss only): ``fused_loss``
  (``areal_fast.fused_linear_grpo_loss`` with a default ``LossConfig``), ``ours_loss``
  (``linear_logprobs`` then ``grpo_loss``), ``naive_loss`` (naive log-probs then
  ``grpo_loss``) and, on CUDA when importable, ``liger_grpo``
  (``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``, token-mean "dapo" loss, no KL).

Modes: ``fwd`` (under ``torch.no_grad``) and ``fwd_bwd`` (backward of a random per-token
upstream gradient for the log-prob rows; of the scalar loss for the loss rows, which run
fwd_bwd only, except ``fused_loss`` on CUDA, also timed ``fwd``: the loss value). Every
backward produces ``hidden.grad`` and ``weight.grad``; they are dropped between repeats.

CPU (``--device cpu``): each (impl, shape, mode) runs in a fresh child process. The child
builds the inputs (fixed seed), resets the peak resident set (``/proc/self/clear_refs``),
reads VmRSS as the baseline, runs the op once, reads VmHWM, and reports
extra = VmHWM − baseline; it then times ``--repeats`` further calls (measuring the extra peak
again around the first of them, "warm") and prints one JSON line. Children run with
``MALLOC_MMAP_THRESHOLD_`` fixed, so freed tensors leave the resident set. With ``--rounds R``
the whole list of cases runs R times in turn and each case reports the times of all its
rounds (memory from the first), so a load that drifts during the run reaches every case alike.

CUDA (``--device cuda``): one process; bf16 inputs; warm-up calls, then the extra peak from
``torch.cuda.max_memory_allocated`` over ``memory_allocated`` before one call, then timed calls
with CUDA events. Throughput is reported as model TFLOP/s (2·T·H·V per forward, 6·T·H·V per
forward + backward, whatever an implementation recomputes) and as a fraction of the bf16
``torch.mm`` rate of the same shape measured in the same run.

Usage::

    python benches/bench_logprobs.py --device cpu --json OUT.json [--shapes small|large]
        [--shape T,H,V] [--repeats N] [--rounds R] [--threads N] [--impls ours,naive,...]
        [--modes fwd,fwd_bwd] [--snapshot]
    python benches/bench_logprobs.py --device cuda --json OUT.json [--shapes small|large]
    python benches/bench_logprobs.py --table OUT.json   # table of an earlier/partial run
    pytest benches/bench_logprobs.py          # pytest-benchmark, small CPU shape
"""

from __future__ import annotations

import argparse
import gc
import inspect
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

SHAPES = {  # (T, H, V)
    "cpu": {"small": [(512, 128, 5003)], "large": [(4096, 576, 49152), (2048, 2048, 151936)]},
    "cuda": {"small": [(2048, 512, 32000)], "large": [(16384, 4096, 151936)]},
}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
MODES = ("fwd", "fwd_bwd")
LOGPROB_IMPLS = ("ours", "naive", "torch_lce")
LOSS_IMPLS = ("fused_loss", "ours_loss", "naive_loss", "liger_grpo")
DEFAULT_IMPLS = {
    "cpu": ("matmul", "ours", "naive", "torch_lce", "fused_loss", "ours_loss", "naive_loss"),
    "cuda": (
        "matmul",
        "ours",
        "ours[torch]",
        "naive",
        "torch_lce",
        "fused_loss",
        "ours_loss",
        "naive_loss",
        "liger_grpo",
    ),
}
OURS_VARIANTS = ("auto", "torch", "native", "triton")
NUM_SEQS = 8  # sequences per packed batch (equal lengths; cu_seqlens int32)
OLD_LOGPROB_NOISE = 0.1  # old_logprobs = ours' logprobs + N(0, 0.1²): some ratios clip at 0.2
SEED = 0
# CPU children: glibc serves allocations of at least this many bytes with mmap and returns
# them on free (a fixed threshold also stops glibc from raising it after large frees), so
# the resident set follows live tensors instead of keeping freed blocks in the heap.
MALLOC_MMAP_THRESHOLD = 65536


def baseline_of(impl: str) -> str:
    return "naive_loss" if is_loss(impl) else "naive"


def is_loss(impl: str) -> bool:
    return parse_impl(impl)[0] in LOSS_IMPLS


def parse_impl(impl: str) -> tuple[str, str | None]:
    """'ours[triton]' -> ('ours', 'triton'); 'naive' -> ('naive', None)."""
    if impl.endswith("]") and "[" in impl:
        base, variant = impl[:-1].split("[", 1)
        return base, variant
    return impl, None


def valid_impl(impl: str, device: str) -> bool:
    base, variant = parse_impl(impl)
    if variant is not None:
        return base in ("ours", "fused_loss") and variant in OURS_VARIANTS
    if impl == "liger_grpo":
        return device == "cuda"
    return impl in ("matmul",) + LOGPROB_IMPLS + LOSS_IMPLS


def modes_of(impl: str, device: str = "cpu") -> tuple[str, ...]:
    if is_loss(impl):
        # on CUDA the fused loss is also timed forward only (no_grad: the loss value)
        if device == "cuda" and parse_impl(impl)[0] == "fused_loss":
            return MODES
        return ("fwd_bwd",)
    if impl == "matmul":
        return ("fwd",)
    return MODES


def model_flops(shape, mode: str) -> float:
    T, H, V = shape
    return (2.0 if mode == "fwd" else 6.0) * T * H * V


def shape_name(shape) -> str:
    return "T{}_H{}_V{}".format(*shape)


def shape_entry(shape, dtype: str, grad_bytes: int) -> dict:
    """Result record of one shape: its sizes, the MB of the gradient outputs
    (hidden.grad + weight.grad at ``grad_bytes`` per element) and of fp32 [T, V] logits."""
    T, H, V = shape
    return {
        "name": shape_name(shape),
        "T": T,
        "H": H,
        "V": V,
        "dtype": dtype,
        "grad_buffers_mb": (T * H + V * H) * grad_bytes / hx.MIB,
        "logits_fp32_mb": T * V * 4 / hx.MIB,
        "modes": {},
    }


# ---------------------------------------------------------------------------
# Inputs and operations (torch imported lazily: the parent process stays small)
# ---------------------------------------------------------------------------


class Skip(Exception):
    """An implementation that is not available here."""


def make_inputs(shape, dtype_name: str, device: str, seed: int, with_loss: bool) -> dict:
    """Fixed-seed inputs. hidden ~ N(0, 1), weight ~ N(0, 1/H) (logits of unit scale),
    labels uniform, upstream gradient ~ N(0, 1) per token; for the loss: NUM_SEQS sequences
    of equal length, advantages ~ N(0, 1) per sequence, every token in the loss mask,
    old_logprobs = ours' logprobs + N(0, OLD_LOGPROB_NOISE²)."""
    import torch

    import areal_fast as af

    T, H, V = shape
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    hidden = torch.randn(T, H, dtype=torch.float32, **kw).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, dtype=torch.float32, **kw) / math.sqrt(H)).to(dtype)
    weight.requires_grad_()
    labels = torch.randint(0, V, (T,), **kw)
    grad_out = torch.randn(T, dtype=torch.float32, **kw)
    inputs = dict(hidden=hidden, weight=weight, labels=labels, grad_out=grad_out)
    if with_loss:
        if T % NUM_SEQS:
            raise ValueError(f"T = {T} must be a multiple of {NUM_SEQS}")
        seqlen = T // NUM_SEQS
        inputs["cu_seqlens"] = torch.arange(0, T + 1, seqlen, dtype=torch.int32, device=device)
        inputs["advantages"] = torch.randn(NUM_SEQS, dtype=torch.float32, **kw)
        inputs["loss_mask"] = torch.ones(T, dtype=torch.bool, device=device)
        with torch.no_grad():
            ref = af.linear_logprobs(hidden, weight, labels)
        noise = torch.randn(T, dtype=torch.float32, **kw) * OLD_LOGPROB_NOISE
        inputs["old_logprobs"] = (ref.detach().float() + noise).contiguous()
        del ref
    return inputs


def _naive_logprobs(hidden, weight, labels):
    import torch

    logits = (hidden @ weight.t()).float()  # [T, V] fp32, materialised
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


def build_op(impl: str, mode: str, inputs: dict):
    """Returns (fn, reset): fn() runs the op once and returns a dict of checks (output sum /
    loss value); reset() drops gradients and outputs between calls. Raises Skip."""
    import torch

    import areal_fast as af

    h, w, y, g = inputs["hidden"], inputs["weight"], inputs["labels"], inputs["grad_out"]
    base, variant = parse_impl(impl)
    backward = mode == "fwd_bwd"

    def reset():
        h.grad = None
        w.grad = None

    if base == "ours":
        kwargs = {}
        if variant is not None:
            params = inspect.signature(af.linear_logprobs).parameters
            if "impl" not in params:
                raise Skip("areal_fast.linear_logprobs has no impl= keyword")
            kwargs["impl"] = variant

        def logprobs():
            return af.linear_logprobs(h, w, y, **kwargs)
    elif base == "naive":

        def logprobs():
            return _naive_logprobs(h, w, y)
    elif base == "torch_lce":
        F = torch.nn.functional
        if not (
            hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
        ):
            raise Skip(
                f"torch {torch.__version__} has no linear_cross_entropy / LinearCrossEntropyOptions"
            )
        options = torch.nn.LinearCrossEntropyOptions()

        def logprobs():
            return -F.linear_cross_entropy(h, w, y, reduction="none", options=options)
    elif base == "matmul":
        if backward:
            raise Skip("matmul is timed forward only")

        def fn():
            with torch.no_grad():
                out = h @ w.t()
            return {"out_sum": float(out[0].float().sum())}  # a cheap check: row 0

        return fn, reset
    elif base in LOSS_IMPLS:
        return _build_loss_op(base, variant, inputs, reset, mode)
    else:
        raise ValueError(f"unknown implementation {impl!r}")

    if not backward:

        def fn():
            with torch.no_grad():
                out = logprobs()
            return {"out_sum": float(out.double().sum())}
    else:

        def fn():
            out = logprobs()
            out.backward(g.to(out.dtype))
            return {"out_sum": float(out.detach().double().sum())}

    return fn, reset


def _build_loss_op(base: str, variant: str | None, inputs: dict, reset, mode: str = "fwd_bwd"):
    import torch

    import areal_fast as af

    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    old, adv = inputs["old_logprobs"], inputs["advantages"]
    mask, cu = inputs["loss_mask"], inputs["cu_seqlens"]
    config = af.LossConfig()

    if base == "fused_loss":
        fused = getattr(af, "fused_linear_grpo_loss", None)
        if fused is None:
            raise Skip("areal_fast.fused_linear_grpo_loss does not exist in this checkout")
        kwargs = {}
        if variant is not None:
            if "impl" not in inspect.signature(fused).parameters:
                raise Skip("areal_fast.fused_linear_grpo_loss has no impl= keyword")
            kwargs["impl"] = variant

        def loss_fn():
            return fused(h, w, y, old, adv, mask, cu, config, **kwargs)[0]
    elif base in ("ours_loss", "naive_loss"):

        def loss_fn():
            lp = af.linear_logprobs(h, w, y) if base == "ours_loss" else _naive_logprobs(h, w, y)
            return af.grpo_loss(lp, old, adv, mask, cu, config)[0]
    elif base == "liger_grpo":
        loss_fn = _liger_loss_fn(inputs, config)
    else:
        raise ValueError(base)
    if variant is not None and base != "fused_loss":
        raise ValueError(f"{base} takes no [impl] variant")

    if mode == "fwd":

        def fn():
            with torch.no_grad():
                loss = loss_fn()
            return {"loss": float(loss)}
    else:

        def fn():
            loss = loss_fn()
            loss.backward()
            return {"loss": float(loss.detach())}

    fn.info = getattr(loss_fn, "state", None)
    return fn, reset


def _liger_loss_fn(inputs: dict, config):
    """Liger-Kernel's chunked GRPO loss on the same batch, as [B, L] padding-free sequences
    (all sequences have equal length): token-mean ("dapo") loss, clip range as ``config``,
    no KL term, no reference model."""
    import torch

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:  # not installed, or its import failed
        raise Skip(f"liger_kernel not importable ({type(exc).__name__}: {exc})") from None
    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    T, H = h.shape
    B = inputs["advantages"].numel()
    L = T // B
    old = inputs["old_logprobs"].view(B, L)
    mask = inputs["loss_mask"].view(B, L).to(torch.int64)
    adv, labels = inputs["advantages"], y.view(B, L)
    common = dict(
        beta=0.0,
        use_ref_model=False,
        epsilon_low=config.eps_clip,
        epsilon_high=config.clip_high,
        loss_type="dapo",
        temperature=1.0,
    )
    state = {"module": LigerFusedLinearGRPOLoss(compiled=True, **common), "compiled": True}

    def loss_fn():
        try:
            out = state["module"](h.view(B, L, H), w, labels, mask, adv, old_per_token_logps=old)
        except Exception as exc:
            if not state["compiled"]:
                raise
            hx.eprint(
                f"  liger_grpo: torch.compile path failed ({type(exc).__name__}: "
                f"{str(exc)[:200]}); using compiled=False"
            )
            state["module"] = LigerFusedLinearGRPOLoss(compiled=False, **common)
            state["compiled"] = False
            out = state["module"](h.view(B, L, H), w, labels, mask, adv, old_per_token_logps=old)
        return out[0] if isinstance(out, tuple) else out

    loss_fn.state = state
    return loss_fn


def grad_checks(inputs: dict) -> dict:
    h, w = inputs["hidden"], inputs["weight"]
    out = {}
    if h.grad is not None:
        out["grad_hidden_norm"] = float(h.grad.double().norm())
    if w.grad is not None:
        out["grad_weight_norm"] = float(w.grad.double().norm())
    return out


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


def add_ratios(entry: dict, shape, mode: str) -> None:
    """time / memory ratios of each implementation of ``entry[mode]`` against its baseline
    (naive or naive_loss) and torch_lce (log-prob rows) or ours_loss (loss rows); model
    GFLOP/s and the fraction of the forward matmul rate of the same shape."""
    cases = entry["modes"][mode]
    mm = entry["modes"].get("fwd", {}).get("matmul", {}).get("median_s")
    for impl, rec in cases.items():
        if rec.get("median_s") is None:
            continue
        rec["model_gflops_per_s"] = model_flops(shape, mode) / rec["median_s"] / 1e9
        if mm and mode == "fwd_bwd":
            rec["matmul_rate_fraction"] = 3 * mm / rec["median_s"]
        elif mm:
            rec["matmul_rate_fraction"] = mm / rec["median_s"]
        refs = [baseline_of(impl)]
        refs += ["torch_lce"] if not is_loss(impl) else ["ours_loss"]
        for ref in refs:
            other = cases.get(ref, {})
            if ref == impl or other.get("median_s") is None:
                continue
            rec[f"time_ratio_vs_{ref}"] = rec["median_s"] / other["median_s"]
            for key, suffix in (("extra_peak_mb", ""), ("extra_peak_mb_warm", "_warm")):
                if rec.get(key) is not None and other.get(key):
                    rec[f"peak_mem_ratio_vs_{ref}{suffix}"] = rec[key] / other[key]


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
                    hx.eprint("    " + _one_line(rec))
                    if round_index:
                        _merge_round(cases[impl], rec)
                    else:
                        cases[impl] = rec
                        rec["loadavg_rounds"] = [[rec.get("loadavg_start"), rec.get("loadavg_end")]]
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
    round's); a failed later round is recorded and leaves the times as they were."""
    if "times_s" not in later:
        rec.setdefault("round_errors", []).append(later.get("error", later.get("skipped")))
        return
    rec["times_s"] = rec["times_s"] + later["times_s"]
    rec.update(hx.summarize_times(rec["times_s"]))
    rec["loadavg_rounds"].append([later.get("loadavg_start"), later.get("loadavg_end")])
    rec["loadavg_end"] = later.get("loadavg_end")
    rec["first_calls_s"] = rec.get("first_calls_s", [rec.get("first_call_s")]) + [
        later.get("first_call_s")
    ]


def _one_line(rec: dict) -> str:
    if "skipped" in rec:
        return f"skipped: {rec['skipped']}"
    if "error" in rec:
        return f"FAILED: {rec['error']}"
    mem = rec.get("extra_peak_mb")
    return (
        f"median {rec['median_s']:.4f} s (p20 {rec['p20_s']:.4f}, p80 {rec['p80_s']:.4f}), "
        f"extra peak {mem:.1f} MB, checks {rec.get('checks')}"
    )


# ---------------------------------------------------------------------------
# CUDA: one process, CUDA events, max_memory_allocated
# ---------------------------------------------------------------------------


def _cuda_time(fn, reset, inputs, *, warmup: int, repeats: int, budget_s: float):
    import torch

    for _ in range(warmup):
        fn()
        reset()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    checks = fn()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / hx.MIB
    checks.update(grad_checks(inputs))
    reset()
    times, spent = [], 0.0
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        reset()
        spent += times[-1]
        if i >= 2 and spent > budget_s:
            break
    return checks, extra, times


def run_cuda(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        hx.eprint(
            "bench_logprobs: error: --device cuda needs a CUDA device "
            f"(torch {torch.__version__} sees none)"
        )
        raise SystemExit(2)
    meta = hx.base_metadata()
    props = torch.cuda.get_device_properties(0)
    meta.update(
        device="cuda",
        gpu=props.name,
        gpu_memory_gib=props.total_memory / 2**30,
        cuda=torch.version.cuda,
        dtype=DTYPES["cuda"],
        allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        memory="extra = max_memory_allocated - memory_allocated around one call after warm-up",
    )
    for mod in ("triton", "liger_kernel"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            meta[mod] = None
    out = {"metadata": meta, "results": [], "notes": []}
    for shape in selected_shapes(args, "cuda"):
        T, H, V = shape
        entry = shape_entry(shape, DTYPES["cuda"], grad_bytes=2)
        out["results"].append(entry)
        inputs = make_inputs(shape, DTYPES["cuda"], "cuda", args.seed, with_loss=True)
        for mode in args.modes:
            cases = {}
            entry["modes"][mode] = cases
            for impl in args.impls:
                if mode not in modes_of(impl, "cuda"):
                    continue
                hx.eprint(f"[{shape_name(shape)} {mode}] {impl} ...")
                rec = {"impl": impl, "mode": mode}
                start = time.perf_counter()
                try:
                    fn, reset = build_op(impl, mode, inputs)
                    warmup = 2 if impl == "liger_grpo" else 1
                    checks, extra, times = _cuda_time(
                        fn,
                        reset,
                        inputs,
                        warmup=warmup,
                        repeats=args.repeats,
                        budget_s=args.case_budget,
                    )
                    rec.update(
                        hx.summarize_times(times), extra_peak_mb=extra, times_s=times, checks=checks
                    )
                    info = getattr(fn, "info", None)
                    if info is not None:
                        rec["liger_compiled"] = info["compiled"]
                except Skip as exc:
                    rec["skipped"] = str(exc)
                except Exception as exc:  # e.g. out of memory: record it, go on
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                finally:
                    inputs["hidden"].grad = None
                    inputs["weight"].grad = None
                    gc.collect()
                    torch.cuda.empty_cache()
                rec["case_wall_s"] = time.perf_counter() - start
                cases[impl] = rec
                hx.eprint("    " + _one_line(rec))
                if "skipped" in rec or "error" in rec:
                    out["notes"].append(
                        f"{shape_name(shape)} {mode} {impl}: "
                        + rec.get("skipped", rec.get("error", ""))
                    )
                add_ratios(entry, shape, mode)
                hx.write_json(args.json, out)
        mm = entry["modes"].get("fwd", {}).get("matmul", {}).get("median_s")
        if mm:
            entry["bf16_mm_tflops"] = 2.0 * T * H * V / mm / 1e12
        del inputs
        gc.collect()
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def render_table(data: dict) -> str:
    meta = data["metadata"]
    cuda = meta.get("device") == "cuda"
    lines = []
    hw = (
        f"{meta.get('gpu')}, CUDA {meta.get('cuda')}"
        if cuda
        else f"{meta.get('cpu')}, {meta.get('nproc')} CPUs, {meta.get('threads')} threads"
    )
    lines.append(
        f"{meta['date'][:10]} | {hw} | torch {meta['torch']} | areal_fast "
        f"{meta.get('areal_fast_commit')} | {meta.get('dtype')}"
    )
    lines.append("")
    unit, scale = ("ms", 1e3) if cuda else ("s", 1.0)
    rate = "TFLOP/s" if cuda else "GFLOP/s"
    headers = [
        "shape",
        "mode",
        "impl",
        f"median {unit}",
        f"p20 {unit}",
        f"p80 {unit}",
        "extra peak MB",
        "warm MB",
        f"model {rate}",
        "× mm rate",
        "time / naive(_loss)",
        "peak / naive(_loss)",
        "warm peak / naive(_loss)",
        "time / torch_lce (ours_loss)",
    ]
    drop = {7, 12} if cuda else set()  # no warm measurement on CUDA (taken after warm-up)
    rows = []
    for entry in data["results"]:
        for mode, cases in entry["modes"].items():
            for impl, rec in cases.items():
                row = [entry["name"], mode, impl]
                if "skipped" in rec or "error" in rec:
                    row += ["skipped" if "skipped" in rec else "FAILED"] + [""] * 10
                    rows.append([c for i, c in enumerate(row) if i not in drop])
                    continue
                ref = baseline_of(impl)
                second = "torch_lce" if not is_loss(impl) else "ours_loss"
                gf = rec.get("model_gflops_per_s")
                row += [
                    hx.fmt(rec["median_s"] * scale, ".4g"),
                    hx.fmt(rec["p20_s"] * scale, ".4g"),
                    hx.fmt(rec["p80_s"] * scale, ".4g"),
                    hx.fmt(rec.get("extra_peak_mb"), ".1f"),
                    hx.fmt(rec.get("extra_peak_mb_warm"), ".1f"),
                    hx.fmt(None if gf is None else (gf / 1e3 if cuda else gf), ".1f"),
                    hx.fmt(rec.get("matmul_rate_fraction"), ".2f"),
                    _ratio(rec, "time_ratio_vs_" + ref, ref, impl),
                    _ratio(rec, "peak_mem_ratio_vs_" + ref, ref, impl),
                    _ratio(rec, "peak_mem_ratio_vs_" + ref + "_warm", ref, impl),
                    _ratio(rec, "time_ratio_vs_" + second, second, impl),
                ]
                rows.append([c for i, c in enumerate(row) if i not in drop])
    headers = [c for i, c in enumerate(headers) if i not in drop]
    lines.append(hx.markdown_table(headers, rows))
    lines.append("")
    memory = (
        "extra peak MB: peak allocated by one call after warm-up "
        "(max_memory_allocated − memory_allocated)"
        if cuda
        else "extra peak MB: VmHWM − VmRSS around the first call in a fresh process; warm MB: "
        "the same around the first timed call (one-time costs already paid)"
    )
    lines.append(
        f"{memory}. Both include hidden.grad + weight.grad on fwd_bwd rows ("
        + ", ".join(f"{e['name']}: {e['grad_buffers_mb']:.0f} MB" for e in data["results"])
        + "). Model rate counts 2·T·H·V flops "
        "per forward, 6·T·H·V per forward + backward; × mm rate divides it by the "
        "rate of `matmul` (hidden @ weightᵀ) of the same shape. Ratios are this row / "
        "the reference (lower is better): `naive` and `torch_lce` for log-prob rows, "
        "`naive_loss` and `ours_loss` for loss rows."
    )
    checks = []
    for entry in data["results"]:
        for mode, cases in entry["modes"].items():
            for impl, rec in cases.items():
                if rec.get("checks") and impl != "matmul":
                    c = rec["checks"]
                    checks.append(
                        f"{entry['name']} {mode} {impl}: "
                        + ", ".join(f"{k}={v:.6g}" for k, v in c.items())
                    )
    if checks:
        lines.append("")
        lines.append("Agreement (same inputs in every case):")
        lines += ["- " + c for c in checks]
    if data.get("notes"):
        lines.append("")
        lines.append("Notes:")
        lines += ["- " + n for n in data["notes"]]
    return "\n".join(lines)


def _ratio(rec, key, ref, impl) -> str:
    if impl == ref:
        return "1"
    value = rec.get(key)
    return "" if value is None else f"{value:.3g}"


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="write the results here (updated after every case)")
    parser.add_argument("--shapes", choices=("small", "large"), default="large")
    parser.add_argument(
        "--shape",
        metavar="T,H,V",
        help="run only this shape (e.g. 2048,2048,151936) instead of the --shapes set",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per case (default: 3 on CPU, 10 on CUDA)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads of each CPU child",
    )
    parser.add_argument(
        "--impls", default=None, help="comma-separated subset, e.g. ours,naive,ours[triton]"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="CPU: run the whole list of cases this many times in turn; each case reports "
        "the timed calls of all rounds",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--table",
        metavar="JSON",
        help="only print the markdown table of an earlier (or partial) run",
    )
    parser.add_argument(
        "--child-timeout",
        type=float,
        default=3600.0,
        help="seconds before a CPU child is abandoned",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="CPU: children import a copy of the committed areal_fast (git HEAD "
        "plus the installed compiled extension) instead of the checkout",
    )
    parser.add_argument(
        "--case-budget",
        type=float,
        default=5.0,
        help="CUDA: stop timing a case after this many seconds (>= 3 calls)",
    )
    # child-process arguments (internal)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.repeats is None:
        args.repeats = 3 if args.device == "cpu" else 10
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.shape is not None:
        raw = args.shape
        try:
            args.shape = tuple(int(x) for x in raw.split(","))
        except ValueError:
            args.shape = ()
        if len(args.shape) != 3 or min(args.shape) < 1:
            parser.error(f"--shape takes three positive integers T,H,V, got {raw!r}")
    if args.child:
        if not (args.impl and args.mode in MODES and args.shape):
            parser.error("--child needs --impl, --mode and --shape")
        return args
    impls = args.impls.split(",") if args.impls else list(DEFAULT_IMPLS[args.device])
    bad = [i for i in impls if not valid_impl(i, args.device)]
    if bad:
        parser.error(f"unknown implementation(s) for --device {args.device}: {bad}")
    args.impls = impls
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"--modes takes a subset of {MODES}")
    args.modes = modes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        print(render_table(json.loads(Path(args.table).read_text())), flush=True)
        return 0
    if args.child:
        record = run_child(args)
        print(json.dumps(record), flush=True)
        return 0
    data = run_cpu(args) if args.device == "cpu" else run_cuda(args)
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
