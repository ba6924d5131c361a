"""Benchmark of the packed causal attention: the varlen kernels against per-sequence SDPA.

One packed batch (fixed seed) of ``--seqs`` sequences with lengths uniform in
[``--min-len``, ``--max-len``], H query heads, H_kv key/value heads, head dim D; every row
runs the attention function registered for training
(``areal_fast.models.packed_attention.packed_attention_forward``) with ``AREAL_FAST_ATTN``
set to its backend, except the baseline:

- ``sdpa_loop``: causal SDPA once per sequence with the boundaries read back from
  ``cu_seqlens`` on every call (``.tolist()``: a device→host synchronisation on CUDA) — what
  every layer paid when the attention was a per-sequence loop only;
- ``sdpa``: the per-sequence SDPA fallback, boundaries read once per forward (cached, so the
  timed calls after the first read nothing);
- ``varlen``: torch's ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.9);
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (CUDA, when it imports).

A backend that cannot run here is listed with the reason. Modes: ``fwd`` (under
``torch.no_grad``) and ``fwd_bwd`` (backward of a fixed random upstream gradient; the input
gradients are dropped between repeats). Each timed call ends with a device synchronisation,
so host-side launch overhead counts. Reported: median and p20/p80 wall time, model TFLOP/s
(causal attention: 2·H·D·ΣLᵢ² per forward, 2.5× that for the backward), the speed-up over
``sdpa_loop`` in the same run, the largest absolute difference of the forward output from
``sdpa_loop``'s and, on CUDA, the extra peak memory of one call.

Usage::

    python benches/bench_attention.py --device cuda --json OUT.json   # 64 seqs, bf16
    python benches/bench_attention.py --device cpu [--threads 1]      # small, seconds
    python benches/bench_attention.py --table OUT.json                # table of a run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as hx  # noqa: E402

BACKENDS = ("sdpa_loop", "sdpa", "varlen", "flash_attn")
MODES = ("fwd", "fwd_bwd")
DEFAULTS = {  # seqs, min_len, max_len, heads, kv_heads, head_dim, dtype, repeats, warmup
    "cuda": dict(seqs=64, min_len=64, max_len=2048, heads=12, kv_heads=2, head_dim=128,
                 dtype="bfloat16", repeats=20, warmup=3),
    "cpu": dict(seqs=8, min_len=16, max_len=128, heads=4, kv_heads=2, head_dim=32,
                dtype="float32", repeats=5, warmup=1),
}  # fmt: skip
SEED = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--table", default=None, help="print the table of an earlier --json run")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--modes", default=",".join(MODES))
    for name in ("seqs", "min_len", "max_len", "heads", "kv_heads", "head_dim", "repeats",
                 "warmup"):  # fmt: skip
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("backends", "modes"):
        items = [s.strip() for s in getattr(args, key).split(",") if s.strip()]
        allowed = BACKENDS if key == "backends" else MODES
        bad = [s for s in items if s not in allowed]
        if bad:
            p.error(f"--{key}: {bad} not in {allowed}")
        setattr(args, key, items)
    if not 1 <= args.min_len <= args.max_len:
        p.error(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


@contextmanager
def forced_backend(name: str):
    from areal_fast.models.attention_backends import ATTN_ENV

    old = os.environ.get(ATTN_ENV)
    os.environ[ATTN_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ATTN_ENV, None)
        else:
            os.environ[ATTN_ENV] = old


def make_batch(args, torch):
    """Packed q, k, v [1, H(_kv), T, D], cu_seqlens [B+1] int32 on the device, lengths."""
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.seqs,), generator=gen)
    cu = torch.zeros(args.seqs + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    dtype = getattr(torch, args.dtype)
    kv_shape = (1, args.kv_heads, total, args.head_dim)
    shapes = [(1, args.heads, total, args.head_dim), kv_shape, kv_shape]
    q, k, v = (torch.randn(s, generator=gen).to(args.device, dtype) for s in shapes)
    return q, k, v, cu.to(args.device), lengths.tolist()


def build_call(backend, cu, max_len):
    """A function of (q, k, v) computing their packed attention [1, T, H, D]."""
    import torch

    from areal_fast.models.packed_attention import packed_attention_forward, per_sequence_sdpa

    module = torch.nn.Module().eval()
    if backend == "sdpa_loop":
        return lambda q, k, v: per_sequence_sdpa(q, k, v, cu.tolist()).transpose(1, 2).contiguous()

    def call(q, k, v):
        out, _ = packed_attention_forward(
            module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=max_len, max_length_k=max_len,
        )  # fmt: skip
        return out

    return call


def skip_reason(backend, q) -> str | None:
    from areal_fast.models.attention_backends import unavailable_reason

    if backend in ("sdpa_loop", "sdpa"):
        return None
    return unavailable_reason(backend, q.device, q.dtype, q.shape[-1], 0.0)


def measure(fn, between, warmup: int, repeats: int, cuda: bool):
    """Output of a first call, wall seconds of ``repeats`` calls (each ending with a device
    synchronisation) after ``warmup`` more, and on CUDA the extra peak bytes of one call."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def once():
        result = fn()
        if between:
            between()
        return result

    out = once()
    for _ in range(warmup):
        once()
    sync()
    extra = None
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        extra = torch.cuda.max_memory_allocated() - base
        if between:
            between()

    def timed():
        fn()
        sync()

    return out, hx.time_calls(timed, repeats, between=between), extra


def run(args) -> dict:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)

    q0, k0, v0, cu, lengths = make_batch(args, torch)
    max_len = max(lengths)
    flops_fwd = 2.0 * args.heads * args.head_dim * sum(n * n for n in lengths)
    upstream = torch.randn(
        (1, q0.shape[2], args.heads, args.head_dim), generator=torch.Generator().manual_seed(1)
    ).to(q0)
    meta = hx.base_metadata(threads=torch.get_num_threads())
    meta["device"] = torch.cuda.get_device_name() if cuda else hx.cpu_model()
    config = dict(
        seqs=args.seqs, lengths=f"U[{args.min_len}, {args.max_len}]", tokens=int(q0.shape[2]),
        max_seqlen=max_len, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, dtype=args.dtype, device=args.device,
        repeats=args.repeats, warmup=args.warmup, seed=args.seed,
    )  # fmt: skip
    rows, baseline_out, baseline_s = [], None, {}
    for backend in args.backends:
        reason = skip_reason(backend, q0)
        for mode in args.modes:
            row = dict(backend=backend, mode=mode)
            rows.append(row)
            if reason is not None:
                row["skipped"] = reason
                continue
            call = build_call(backend, cu, max_len)
            if mode == "fwd":
                q, k, v = q0, k0, v0

                def fn(call=call, q=q, k=k, v=v):
                    with torch.no_grad():
                        return call(q, k, v)

                between = None
            else:
                q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))

                def fn(call=call, q=q, k=k, v=v):
                    out = call(q, k, v)
                    out.backward(upstream)
                    return out

                def between(q=q, k=k, v=v):
                    q.grad = k.grad = v.grad = None

            try:
                with forced_backend("sdpa" if backend == "sdpa_loop" else backend):
                    out, times, extra = measure(fn, between, args.warmup, args.repeats, cuda)
            except Exception as exc:  # reported in the table, the other rows still run
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            if extra is not None:
                row["extra_mib"] = extra / hx.MIB
            row.update(hx.summarize_times(times))
            work = flops_fwd * (1.0 if mode == "fwd" else 3.5)
            row["tflops"] = work / row["median_s"] / 1e12
            if backend == "sdpa_loop":
                baseline_s[mode] = row["median_s"]
                if mode == "fwd":
                    baseline_out = out.detach().float()
            if baseline_out is not None and mode == "fwd":
                row["max_abs_diff"] = (out.detach().float() - baseline_out).abs().max().item()
            hx.eprint(f"{backend} {mode}: {row['median_s'] * 1e3:.3f} ms")
    for row in rows:
        base = baseline_s.get(row["mode"])
        if base and row.get("median_s"):
            row["speedup"] = base / row["median_s"]
    return {"meta": meta, "config": config, "rows": rows}


def render_table(data: dict) -> str:
    c = data["config"]
    title = (
        f"## Packed causal attention, {c['seqs']} sequences of {c['lengths']} tokens "
        f"({c['tokens']} in all, longest {c['max_seqlen']}), H={c['heads']}, "
        f"H_kv={c['kv_heads']}, D={c['head_dim']}, {c['dtype']} on {data['meta'].get('device')}"
        f" (torch {data['meta'].get('torch')}), median of {c['repeats']}"
    )
    headers = ["backend", "mode", "median ms", "p20 ms", "p80 ms", "TFLOP/s",
               "speed-up vs sdpa_loop", "max abs diff", "extra MiB", "note"]  # fmt: skip
    rows = []
    for r in data["rows"]:
        ms = [None if r.get(k) is None else r[k] * 1e3 for k in ("median_s", "p20_s", "p80_s")]
        rows.append([
            r["backend"], r["mode"], *(hx.fmt(x, ".3f") for x in ms),
            hx.fmt(r.get("tflops"), ".2f"), hx.fmt(r.get("speedup"), ".2f", "x"),
            hx.fmt(r.get("max_abs_diff"), ".2e"), hx.fmt(r.get("extra_mib"), ".0f"),
            r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error", ""),
        ])  # fmt: skip
    return title + "\n\n" + hx.markdown_table(headers, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        print(render_table(json.loads(Path(args.table).read_text())), flush=True)
        return 0
    data = run(args)
    hx.write_json(args.json, data)
    print(render_table(data), flush=True)
    failed = [r for r in data["rows"] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
