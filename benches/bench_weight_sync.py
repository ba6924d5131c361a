"""Weight-sync throughput: one trainer process to two engine processes on this machine.

For a 135M-shaped (SmolLM2-135M) and a 1.5B-shaped (Qwen2.5-1.5B) state dict of random bf16
values, three ways of moving every tensor from rank 0 to ranks 1 and 2 over the transport:

- ``single_buffer``: one pre-packed buffer of the same total size in one broadcast — the
  transport's limit (no packing, no per-tensor cost, nothing to unpack);
- ``bucketed``: :class:`~areal_fast.sync.sender.WeightSender` → :class:`WeightReceiver`, the
  real path: header, plan check, pack bucket k + 1 while bucket k is in flight, unpack into the
  engine's tensors, completion round;
- ``per_tensor``: one broadcast per tensor straight into the engine's tensor (what a naive
  sync does).

``--transport shm`` (engines map the trainer's buckets in /dev/shm) and ``--transport cuda-ipc``
(GPU: engines read the trainer's buckets in place on the same GPU, ``--engines 1``) time the
bucketed path only.

Engines' tensors are views of one flat buffer so the 1.5B case fits three processes in 24 GiB;
the single-buffer baseline broadcasts that flat buffer. Reported per model: ``seconds``
(median per mode), ``bucketed_vs_single_buffer`` (throughput ratio, goal ≥ 0.9) and
``bucketed_vs_per_tensor`` (speed-up).

    python benches/bench_weight_sync.py --transport gloo --json benches/results/weight_sync_gloo.json
    python benches/bench_weight_sync.py --transport gloo --models 135m --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_metadata, eprint, fmt, markdown_table, write_json  # noqa: E402

MODELS = {
    # name: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, qkv_bias, tied)
    "135m": (49152, 576, 1536, 30, 9, 3, 64, False, True),
    "1.5b": (151936, 1536, 8960, 28, 12, 2, 128, True, True),
}


def model_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes of a Llama/Qwen2-style decoder (tied head sent once)."""
    vocab, hidden, inter, layers, heads, kv, hd, bias, tied = MODELS[name]
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * hd, hidden)),
            (p + "self_attn.k_proj.weight", (kv * hd, hidden)),
            (p + "self_attn.v_proj.weight", (kv * hd, hidden)),
        ]
        if bias:
            shapes += [
                (p + "self_attn.q_proj.bias", (heads * hd,)),
                (p + "self_attn.k_proj.bias", (kv * hd,)),
                (p + "self_attn.v_proj.bias", (kv * hd,)),
            ]
        shapes += [
            (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def _flat_tensors(shapes, dtype, fill: bool, device="cpu"):
    """One flat buffer and the named views into it (random values when ``fill``)."""
    import torch

    total = sum(int(torch.Size(s).numel()) for _, s in shapes)
    flat = torch.empty(total, dtype=dtype, device=device)
    if fill:
        gen = torch.Generator().manual_seed(0)
        step = 1 << 24
        for start in range(0, total, step):  # chunked: no fp32 copy of the whole model
            n = min(step, total - start)
            flat[start : start + n] = torch.randn(n, generator=gen).to(dtype).to(device)
    views, offset = {}, 0
    for name, shape in shapes:
        n = int(torch.Size(shape).numel())
        views[name] = flat[offset : offset + n].view(shape)
        offset += n
    return flat, views


class _Params:
    """A module-like holder: ``named_parameters`` over plain tensors (for ModuleSource)."""

    def __init__(self, views):
        import torch

        self._params = {n: torch.nn.Parameter(v, requires_grad=False) for n, v in views.items()}

    def named_parameters(self, remove_duplicate=True):
        return iter(self._params.items())

    def named_buffers(self, remove_duplicate=True):
        return iter(())


def _rank_main(
    rank: int,
    world: int,
    port: int,
    model: str,
    transport_kind: str,
    bucket_mb: int,
    repeats: int,
    threads: int,
    out,
):
    import torch
    import torch.distributed as dist

    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource
    from areal_fast.sync.transports import (
        CudaIpcTransport,
        SharedMemoryTransport,
        TorchDistTransport,
        init_sync_group,
    )

    torch.set_num_threads(threads)
    device = "cuda" if transport_kind == "cuda-ipc" else "cpu"
    shapes = model_shapes(model)
    flat, views = _flat_tensors(shapes, torch.bfloat16, fill=rank == 0, device=device)
    if rank:
        flat.fill_(0.5)  # engines start from other values
    group = init_sync_group(rank, world, port, timeout=600)
    if transport_kind == "shm":
        transport = SharedMemoryTransport(group)
    elif transport_kind == "cuda-ipc":
        transport = CudaIpcTransport(group, torch.device("cuda", 0))
    else:
        transport = TorchDistTransport(group, "gloo")
    control = transport if transport_kind == "gloo" else transport.control
    timeout = 600.0

    def broadcast(t):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        control.group.broadcast([t], opts).wait()

    def timed(fn):
        transport.barrier(timeout)
        start = time.perf_counter()
        fn()
        transport.barrier(timeout)  # the last engine has its weights
        return time.perf_counter() - start

    source = ModuleSource(_Params(views)) if rank == 0 else None
    sender = (
        WeightSender(transport, bucket_bytes=bucket_mb << 20, timeout=timeout)
        if rank == 0
        else None
    )
    receiver = WeightReceiver(transport, timeout=timeout) if rank else None
    targets = dict(views)

    def bucketed():
        if rank == 0:
            sender.send(source, 1)
        else:
            session = receiver.start(accept=lambda plan: check_against(plan, targets))
            session.unpack_into([targets.get(s.name) for s in session.plan.specs])
            session.finish()

    modes = {"bucketed": bucketed}
    if transport_kind == "gloo":
        modes["single_buffer"] = lambda: broadcast(flat)
        modes["per_tensor"] = lambda: [broadcast(views[name]) for name, _ in shapes]
    times = {m: [] for m in modes}
    bucketed()  # warm-up: plans, buffers, first-touch of pages
    for _ in range(repeats):
        for mode, fn in modes.items():
            times[mode].append(timed(fn))
    if rank:
        expected, _ = _flat_tensors(shapes, torch.bfloat16, fill=True, device=device)
        assert torch.equal(flat.view(torch.int16), expected.view(torch.int16)), (
            f"engine rank {rank}: received weights differ from the trainer's"
        )
    if rank == 0:
        out.put(
            {"times": times, "bytes": flat.numel() * flat.element_size(), "tensors": len(shapes)}
        )
    transport.close()


def run_model(
    model: str, transport: str, bucket_mb: int, repeats: int, threads: int, engines: int = 2
) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, engines + 1, port, model, transport, bucket_mb, repeats, threads, out),
        )
        for r in range(engines + 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise SystemExit(f"bench_weight_sync: rank(s) {bad} failed for model {model}")
    result = out.get(timeout=10)
    med = {m: statistics.median(ts) for m, ts in result["times"].items()}
    row = {
        "model": model,
        "transport": transport,
        "bucket_mb": bucket_mb,
        "engines": engines,
        "gbytes": result["bytes"] / 1e9,
        "tensors": result["tensors"],
        "seconds": med,
        "all_seconds": result["times"],
        "gbytes_per_s": {m: result["bytes"] / 1e9 / s for m, s in med.items()},
    }
    if "single_buffer" in med:
        row["bucketed_vs_single_buffer"] = med["single_buffer"] / med["bucketed"]
        row["bucketed_vs_per_tensor"] = med["per_tensor"] / med["bucketed"]
    return row


def table(rows: list[dict]) -> str:
    headers = [
        "model",
        "GB (bf16)",
        "tensors",
        "single buffer s",
        "bucketed s",
        "per-tensor s",
        "bucketed GB/s",
        "bucketed / single (goal ≥ 0.9)",
        "speed-up vs per-tensor",
    ]
    body = [
        [
            r["model"],
            fmt(r["gbytes"], ".2f"),
            r["tensors"],
            fmt(r["seconds"].get("single_buffer"), ".3f"),
            fmt(r["seconds"]["bucketed"], ".3f"),
            fmt(r["seconds"].get("per_tensor"), ".3f"),
            fmt(r["gbytes_per_s"]["bucketed"], ".2f"),
            fmt(r.get("bucketed_vs_single_buffer"), ".3f"),
            fmt(r.get("bucketed_vs_per_tensor"), ".2f"),
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["gloo", "shm", "cuda-ipc"], default="gloo")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (ranks 1..)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/packing threads per process (3 processes share the cores)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for model in args.models:
        eprint(f"bench_weight_sync: {model} over {args.transport} ...")
        rows.append(
            run_model(
                model, args.transport, args.bucket_mb, args.repeats, args.threads, args.engines
            )
        )
    print(table(rows))
    write_json(
        args.json,
        {
            "meta": base_metadata(args.threads),
            "args": {k: str(v) for k, v in vars(args).items()},
            "models": {r["model"]: r for r in rows},
        },
        indent=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
