"""Benchmark of weight-sync bucket pack/unpack (``areal_fast.sync.buckets``) on a whole
model's state dict, against plain copies of one buffer of the same size.

State dict: Qwen2.5-1.5B shapes (vocab 151936, hidden 1536, intermediate 8960, 28 layers,
12 query heads and 2 KV heads of dim 128, q/k/v biases, tied LM head: 338 tensors, 1.54B
parameters), or with ``--small`` SmolLM2-135M shapes (vocab 49152, hidden 576,
intermediate 1536, 30 layers, 9/3 heads of dim 64, no biases, tied: 272 tensors, 135M
parameters). Buckets of ``--bucket-mib`` MiB (default 512).

Modes:

- ``cast``: float32 sources packed as bfloat16 (fp32 -> bf16 cast), unpacked into float32
  targets (bf16 -> fp32);
- ``copy``: bfloat16 sources, bfloat16 wire, bfloat16 targets (byte copies).

Each row times the whole model, all buckets one after the other through one bucket buffer
(pack: every bucket into the buffer; unpack: every bucket from it into the targets), and
reports GB/s of bytes written (pack: wire bytes of all buckets; unpack: target bytes).
Unpack writes into the source tensors themselves (a second copy of the model would not fit
small machines; the timing is the same). Implementations: ``native`` (the C++ threads on
the CPU, on 1 and ``--threads`` threads; the one-launch CUDA kernel on GPUs) and ``torch``
(the fallback, extension disabled: one ``copy_`` per chunk, on ``--threads`` torch threads).

References: a ``copy_`` of one uint8 buffer of the model's wire bytes into another, on CUDA
device to device (the ratio goal of pack/unpack is >= 0.8), on the CPU with torch on the
row's thread count (1 or ``--threads``; a memcpy rate). Reference calls alternate with the
row's calls, so both see the same machine load; ratio = row GB/s / reference GB/s.

Before timing, one pack + unpack pass of every bucket is checked against torch
(``src.to(bfloat16)`` bit for bit) on a sample of tensors.

Usage::

    python benches/bench_bucket_pack.py --device cpu --json OUT.json [--small]
        [--bucket-mib 512] [--repeats 3] [--threads N]
    python benches/bench_bucket_pack.py --device cuda --json OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as hx  # noqa: E402
import torch  # noqa: E402

from areal_fast import _native  # noqa: E402
from areal_fast.sync.buckets import TensorSpec, pack_bucket, plan_buckets, unpack_bucket  # noqa: E402

MIB = 1024 * 1024
SEED = 0


# ---------------------------------------------------------------------------
# State dicts
# ---------------------------------------------------------------------------


def model_shapes(
    vocab: int,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    qkv_bias: bool,
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama/Qwen2-style decoder's state dict with a tied LM head."""
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (hidden,)))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{name}.weight", (rows, hidden)))
            if qkv_bias:
                out.append((p + f"self_attn.{name}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (hidden, q)))
        out.append((p + "post_attention_layernorm.weight", (hidden,)))
        out.append((p + "mlp.gate_proj.weight", (inter, hidden)))
        out.append((p + "mlp.up_proj.weight", (inter, hidden)))
        out.append((p + "mlp.down_proj.weight", (hidden, inter)))
    out.append(("model.norm.weight", (hidden,)))
    return out  # lm_head.weight is tied to embed_tokens


MODELS = {
    "qwen2.5-1.5b": dict(
        vocab=151936,
        hidden=1536,
        inter=8960,
        layers=28,
        heads=12,
        kv_heads=2,
        head_dim=128,
        qkv_bias=True,
    ),
    "smollm2-135m": dict(
        vocab=49152,
        hidden=576,
        inter=1536,
        layers=30,
        heads=9,
        kv_heads=3,
        head_dim=64,
        qkv_bias=False,
    ),
}
MODES = {
    "cast": (torch.float32, "bfloat16", torch.float32),
    "copy": (torch.bfloat16, "bfloat16", torch.bfloat16),
}  # source, wire, target


def make_tensors(shapes, dtype, device) -> list[torch.Tensor]:
    """Separate random tensors (one generator pass over a flat buffer each, in place)."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    out = []
    for _, shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        t.uniform_(-1.0, 1.0, generator=gen)
        out.append(t)
    return out


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def _once(fn, device: str) -> float:
    """Seconds of one call of fn() (CUDA: events on the current stream)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_pair(fn, ref, repeats: int, device: str) -> tuple[list[float], list[float]]:
    """Alternate timed calls of fn() and of the reference ref() (one warm-up each), so that
    both see the same machine load; returns (fn times, ref times) in seconds."""
    fn()
    ref()
    if device == "cuda":
        torch.cuda.synchronize()
    times, ref_times = [], []
    for _ in range(repeats):
        ref_times.append(_once(ref, device))
        times.append(_once(fn, device))
    return times, ref_times


def row(
    mode: str,
    op: str,
    impl: str,
    threads,
    nbytes: int,
    times: list[float],
    ref_times: list[float],
    ref_name: str,
    ref_bytes: int,
) -> dict:
    stats = hx.summarize_times(times)
    ref_stats = hx.summarize_times(ref_times)
    gbps = nbytes / stats["median_s"] / 1e9
    ref_gbps = ref_bytes / ref_stats["median_s"] / 1e9
    return {
        "name": f"{mode}/{op}/{impl}",
        "mode": mode,
        "op": op,
        "impl": impl,
        "threads": threads,
        "bytes_written": nbytes,
        **stats,
        "times_s": times,
        "gbps": gbps,
        "ref": ref_name,
        "ref_median_s": ref_stats["median_s"],
        "ref_times_s": ref_times,
        "ref_gbps": ref_gbps,
        "ratio": gbps / ref_gbps,
    }


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


def verify(plan, sources, buf, target_dtype, device) -> int:
    """Pack + unpack every bucket; compare a sample of tensors with torch's cast. Returns
    the number of tensors checked."""
    order = sorted(range(len(sources)), key=lambda i: sources[i].numel())
    sample = {order[0], order[len(order) // 2], order[-1], len(sources) - 1}
    targets = [
        torch.empty_like(sources[i], dtype=target_dtype) if i in sample else None
        for i in range(len(sources))
    ]
    for k in range(plan.num_buckets):
        pack_bucket(plan, k, sources, buf)
        unpack_bucket(plan, k, buf, targets)
    for i in sample:
        want = sources[i].to(plan.specs[i].torch_dtype).to(target_dtype)
        if not torch.equal(targets[i], want):
            raise AssertionError(f"round trip of {plan.specs[i].name} differs from torch")
    if device == "cuda":
        torch.cuda.synchronize()
    return len(sample)


def run_mode(mode: str, shapes, args, impls, thread_counts, reference) -> list[dict]:
    """Verify, then time pack and unpack of the whole model per implementation and thread
    count."""
    src_dtype, wire, target_dtype = MODES[mode]
    device = args.device
    specs = [TensorSpec(name, shape, wire) for name, shape in shapes]
    plan = plan_buckets(specs, args.bucket_mib * MIB)
    hx.eprint(
        f"[{mode}] {len(specs)} tensors, {plan.num_buckets} buckets, "
        f"{plan.total_bytes / 1e9:.3f} GB on the wire; building sources ..."
    )
    sources = make_tensors(shapes, src_dtype, device)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
    with hx.native_disabled(False):
        checked = verify(plan, sources, buf, target_dtype, device)
    hx.eprint(f"[{mode}] verified {checked} tensors against torch")
    # Unpack writes back into the sources (cast mode: rounded values, same speed), so no
    # second copy of the model is needed.
    targets = sources if target_dtype == src_dtype else None
    if targets is None:
        raise AssertionError("every mode unpacks into its own source dtype")
    wire_bytes = sum(s.nbytes for s in specs)
    target_bytes = sum(t.numel() * t.element_size() for t in targets)
    rows = []

    def run_with(fn, impl, threads):
        # The torch fallback runs on torch's intra-op threads: give it the row's count.
        if impl == "torch" and threads is not None:
            torch.set_num_threads(threads)
            try:
                fn(threads)
            finally:
                torch.set_num_threads(args.threads)
        else:
            fn(threads)

    def pack_all(threads):
        for k in range(plan.num_buckets):
            pack_bucket(plan, k, sources, buf, num_threads=threads)  # noqa: F821 (del below)

    def unpack_all(threads):
        for k in range(plan.num_buckets):
            unpack_bucket(plan, k, buf, targets, num_threads=threads)  # noqa: F821 (del below)

    for impl in impls:
        # The torch fallback as it runs in production: on torch's --threads threads.
        counts = thread_counts if impl == "native" else thread_counts[-1:]
        with hx.native_disabled(impl == "torch"):
            for threads in counts:
                ref, ref_name = reference(threads)
                for op, fn, nbytes in (
                    ("pack", pack_all, wire_bytes),
                    ("unpack", unpack_all, target_bytes),
                ):
                    times, ref_times = timed_pair(
                        lambda: run_with(fn, impl, threads), ref, args.repeats, device
                    )
                    r = row(
                        mode,
                        op,
                        impl,
                        threads,
                        nbytes,
                        times,
                        ref_times,
                        ref_name,
                        reference.nbytes,
                    )
                    rows.append(r)
                    hx.eprint(
                        f"  {r['name']} threads={threads}: {r['gbps']:.2f} GB/s, "
                        f"{ref_name} {r['ref_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}"
                    )
    del sources, targets, buf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


class Reference:
    """copy_ between two uint8 buffers of ``nbytes`` (the model's wire bytes), the rate
    the rows are read against; ``reference(threads)`` returns (callable, name)."""

    def __init__(self, nbytes: int, device: str, default_threads: int):
        self.src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.device, self.default_threads = device, default_threads

    @property
    def nbytes(self) -> int:
        return self.src.numel()

    def __call__(self, threads):
        if self.device == "cuda":
            return (lambda: self.dst.copy_(self.src)), "copy_d2d"

        def copy():
            torch.set_num_threads(threads)
            try:
                self.dst.copy_(self.src)
            finally:
                torch.set_num_threads(self.default_threads)

        return copy, f"copy_{threads}t"


def render_table(data: dict) -> str:
    meta = data["metadata"]
    lines = [
        f"# bucket pack/unpack, {meta['model']} ({meta['num_tensors']} tensors, "
        f"{meta['wire_gb']:.3f} GB bf16 on the wire), buckets of {meta['bucket_mib']} MiB "
        f"({meta['num_buckets']} buckets), device {meta['device']}, median of "
        f"{meta['repeats']}",
        f"{meta['date']} | {meta.get('gpu') or meta['cpu']}, {meta['nproc']} CPUs | torch "
        f"{meta['torch']} | areal_fast {meta['areal_fast_commit']}",
        "",
    ]
    headers = [
        "mode",
        "op",
        "impl",
        "threads",
        "GB written",
        "median ms",
        "p20 ms",
        "p80 ms",
        "GB/s",
        "reference",
        "ref GB/s",
        "ratio",
    ]
    rows = []
    for r in data["results"]:
        rows.append(
            [
                r["mode"],
                r["op"],
                r["impl"],
                r["threads"] or "",
                hx.fmt(r["bytes_written"] / 1e9, ".3f"),
                hx.fmt(r["median_s"] * 1e3, ".1f"),
                hx.fmt(r["p20_s"] * 1e3, ".1f"),
                hx.fmt(r["p80_s"] * 1e3, ".1f"),
                hx.fmt(r["gbps"], ".2f"),
                r["ref"],
                hx.fmt(r["ref_gbps"], ".2f"),
                hx.fmt(r["ratio"], ".2f"),
            ]
        )
    lines.append(hx.markdown_table(headers, rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--small", action="store_true", help="SmolLM2-135M shapes")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per row (default 3 on the CPU, 20 on CUDA)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads of the multi-threaded rows",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--impls", default="native,torch")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier run")
    args = parser.parse_args(argv)
    if args.table:
        print(render_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    if args.repeats is None:
        args.repeats = 20 if args.device == "cuda" else 3
    impls = [i for i in args.impls.split(",") if i]
    native = _native.load_native()
    if "native" in impls and (native is None or not hasattr(native, "bucket_copy")):
        hx.eprint("areal_fast._C with bucket_copy is not importable: native rows skipped")
        impls.remove("native")
    model = "smollm2-135m" if args.small else "qwen2.5-1.5b"
    shapes = model_shapes(**MODELS[model])
    thread_counts = sorted({1, args.threads}) if args.device == "cpu" else [None]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    meta = hx.base_metadata(args.threads if args.device == "cpu" else None)
    specs = [TensorSpec(n, s, "bfloat16") for n, s in shapes]
    plan = plan_buckets(specs, args.bucket_mib * MIB)
    meta.update(
        device=args.device,
        model=model,
        num_tensors=len(shapes),
        num_params=sum(s.numel for s in specs),
        wire_gb=plan.total_bytes / 1e9,
        bucket_mib=args.bucket_mib,
        num_buckets=plan.num_buckets,
        repeats=args.repeats,
        native_build=native.build_info() if native is not None else None,
        code_fingerprint=hx.code_fingerprint(),
    )
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda_kernel"] = bool(native is not None and getattr(native, "has_cuda", False))
    data = {"metadata": meta, "results": []}
    start = time.perf_counter()
    wire_bytes = sum(s.nbytes for s in specs)
    reference = Reference(wire_bytes, args.device, args.threads)
    for mode in [m for m in args.modes.split(",") if m]:
        rows = run_mode(mode, shapes, args, impls, thread_counts, reference)
        data["results"].extend(rows)
        hx.write_json(args.json, data)
    meta["wall_s"] = time.perf_counter() - start
    hx.write_json(args.json, data)
    print(render_table(data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
