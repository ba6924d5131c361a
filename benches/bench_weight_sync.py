"""Weight-sync throughput: one trainer process to two engine processes on this machine.

For a 135M-shaped (SmolLM2-135M) and a 1.5B-shaped (Qwen2.5-1.5B) state dict of random bf16
values, three ways of moving every tensor from rank 0 to ranks 1 and 2 over the transport:

- ``single_buffer``: one pre-packed buffer of the same total size in one broadcast — the
  transport's limit (no packing, no per-tensor cost, nothing to unpack);
- ``bucketed``: :class:`~areal_fast.sync.sender.WeightSender` → :class:`WeightReceiver`, the
  real path: header, plan check, bucket k + 1 prepared while bucket k is in flight, completion
  round;
- ``per_tensor``: one broadcast per tensor straight into the engine's tensor (what a naive
  sync does).

``--transport shm`` (engines map the trainer's buckets in /dev/shm) and ``--transport cuda-ipc``
(GPU: engines read the trainer's buckets in place on the same GPU, ``--engines 1``) time the
bucketed path only.

Every process's tensors are views of one buffer laid out by
:func:`~areal_fast.sync.shared_memory.plan_layout` (256-byte aligned, in order: the layout of
the trainer's shared-memory slot), so over gloo every bucket is a byte range of the trainer's
buffer, sent from there, and received straight into the engine's (``unpack_into(...,
layout_buffer=True)``), and the sender plans without solo buckets (``--solo-mb 0``: fewer
buckets, fewer broadcasts); the single-buffer baseline broadcasts that buffer. ``--separate``
allocates every tensor on its own instead, so buckets of several tensors are packed and
unpacked, with the sender's default solo buckets of 4 MiB (twice the memory: the baseline
then has a buffer of its own; the 1.5B case needs about 19 GB). Reported per model: ``seconds`` (median per mode),
``bucketed_vs_single_buffer`` (throughput ratio, goal ≥ 0.9), ``bucketed_vs_per_tensor``
(speed-up) and ``breakdown``: buckets, how many were sent without a pack copy (``direct``)
and received in place (``engine<r>_in_place``), the latency of one small broadcast
(``launch_s``, mean of 50), and the seconds to pack every bucket of the plan on the trainer
and to unpack every bucket on engine 1, each timed alone (the copies the path makes when
layouts differ).

    python benches/bench_weight_sync.py --transport gloo --json benches/results/weight_sync_gloo.json
    python benches/bench_weight_sync.py --transport gloo --separate --models 135m
    python benches/bench_weight_sync.py --transport gloo --models 135m --repeats 1   # quick

``--controller`` measures instead the weight-update latency inside the running loop (the
trainer's StepDone → every rollout worker serving the version): workers that map the
trainer's slots (``shm``) against workers that get every version over their gloo link
(``broadcast``, as on another node), 1 and 2 workers, per model (:mod:`_weight_sync_loop`):

    python benches/bench_weight_sync.py --controller --json benches/results/weight_sync_loop_cpu.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402
    base_metadata,
    eprint,
    fmt,
    markdown_table,
    non_negative_float,
    positive_int,
    write_json,
)

MODELS = {
    # name: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, qkv_bias, tied)
    "135m": (49152, 576, 1536, 30, 9, 3, 64, False, True),
    "1.5b": (151936, 1536, 8960, 28, 12, 2, 128, True, True),
    # 2 layers of width 64: the GPU check's CPU rehearsal (seconds, not a measurement)
    "toy": (1024, 64, 128, 2, 4, 2, 16, True, True),
}
DEFAULT_MODELS = ["135m", "1.5b"]


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


def _layout_tensors(shapes, dtype, fill: bool, device="cpu", separate: bool = False):
    """The named tensors: views of one buffer laid out by ``plan_layout`` (each tensor at a
    256-byte aligned offset, in order, as in the trainer's shared-memory slot), or with
    ``separate`` tensors of their own (buffer None). Random values when ``fill`` (the same
    for both layouts), else uninitialised; padding bytes are zero."""
    import torch

    from areal_fast.sync.shared_memory import plan_layout

    if separate:
        buffer = None
        views = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes}
    else:
        entries, total = plan_layout(
            (n, torch.empty(s, dtype=dtype, device="meta")) for n, s in shapes
        )
        buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        views = {
            e.name: buffer[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)
            for e in entries
        }
    if fill:
        gen = torch.Generator().manual_seed(0)
        step = 1 << 24
        for view in views.values():  # chunked: no fp32 copy of the whole model
            flat = view.view(-1)
            for start in range(0, flat.numel(), step):
                n = min(step, flat.numel() - start)
                flat[start : start + n] = torch.randn(n, generator=gen).to(dtype).to(device)
    return buffer, views


def _time_copies(plan, tensors, pack: bool, threads: int) -> float:
    """Seconds to pack (or unpack) every bucket of ``plan`` from (into) ``tensors`` through
    one reused 64 MiB-class buffer: what the copy path costs per update, without transport."""
    import torch

    from areal_fast.sync.buckets import pack_bucket, unpack_bucket

    device = next(t for t in tensors if t is not None).device
    buf = torch.zeros(max(plan.bucket_sizes), dtype=torch.uint8, device=device)
    start = time.perf_counter()
    for k in range(plan.num_buckets):
        if pack:
            pack_bucket(plan, k, tensors, buf, num_threads=threads)
        else:
            unpack_bucket(plan, k, buf, tensors, num_threads=threads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class _Params:
    """A module-like holder: ``named_parameters`` over plain tensors (for ModuleSource)."""

    def __init__(self, views):
        import torch

        self._params = {n: torch.nn.Parameter(v, requires_grad=False) for n, v in views.items()}

    def named_parameters(self, remove_duplicate=True):
        return iter(self._params.items())

    def named_buffers(self, remove_duplicate=True):
        return iter(())


def _rank_main(rank: int, world: int, port: int, model: str, opts: dict, out):
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

    transport_kind, threads, separate = opts["transport"], opts["threads"], opts["separate"]
    torch.set_num_threads(threads)
    device = "cuda" if transport_kind == "cuda-ipc" else "cpu"
    shapes = model_shapes(model)
    buffer, views = _layout_tensors(
        shapes, torch.bfloat16, fill=rank == 0, device=device, separate=separate
    )
    if rank:
        for view in views.values():
            view.fill_(0.5)  # engines start from other values
    nbytes = sum(v.numel() * v.element_size() for v in views.values())
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
        options = dist.BroadcastOptions()
        options.rootRank = 0
        control.group.broadcast([t], options).wait()

    def timed(fn):
        transport.barrier(timeout)
        start = time.perf_counter()
        fn()
        transport.barrier(timeout)  # the last engine has its weights
        return time.perf_counter() - start

    source = ModuleSource(_Params(views)) if rank == 0 else None
    sender = (
        WeightSender(
            transport,
            bucket_bytes=opts["bucket_mb"] << 20,
            timeout=timeout,
            solo_bytes=int(opts["solo_mb"] * (1 << 20)),
        )
        if rank == 0
        else None
    )
    receiver = WeightReceiver(transport, timeout=timeout) if rank else None
    targets = dict(views)
    counts: dict = {}
    last: dict = {}  # the plan of the last update

    def bucketed():
        if rank == 0:
            stats = sender.send(source, 1)
            counts.update(buckets=stats.num_buckets, direct=stats.direct_buckets)
        else:
            session = receiver.start(accept=lambda plan: check_against(plan, targets))
            session.unpack_into(
                [targets.get(s.name) for s in session.plan.specs], layout_buffer=not separate
            )
            session.finish()
            counts.update(in_place=session.in_place_buckets, unpacked=session.unpacked_buckets)
            last["plan"] = session.plan

    modes = {"bucketed": bucketed}
    if transport_kind == "gloo":
        # one pre-packed buffer of (at least) the same bytes: the layout buffer itself, or
        # one of the same size next to separate tensors
        single = buffer if buffer is not None else torch.zeros(nbytes, dtype=torch.uint8)
        modes["single_buffer"] = lambda: broadcast(single)
        modes["per_tensor"] = lambda: [broadcast(views[name]) for name, _ in shapes]
    times = {m: [] for m in modes}
    bucketed()  # warm-up: plans, buffers, first-touch of pages
    for _ in range(opts["repeats"]):
        for mode, fn in modes.items():
            times[mode].append(timed(fn))
    if rank:
        _, expected = _layout_tensors(shapes, torch.bfloat16, fill=True, device=device)
        for name, want in expected.items():
            assert torch.equal(views[name].view(torch.int16), want.view(torch.int16)), (
                f"engine rank {rank}: received {name} differs from the trainer's"
            )
        del expected
    breakdown = dict(counts)
    if transport_kind == "gloo":
        del single
        tiny = torch.zeros(256, dtype=torch.uint8)
        breakdown["launch_s"] = timed(lambda: [broadcast(tiny) for _ in range(50)]) / 50
        # the copies of the bucketed path when the layouts differ (every bucket packed on
        # the trainer, unpacked on each engine), timed alone, one process at a time
        plan = sender.plan_for(source) if rank == 0 else last["plan"]
        ordered = [views[s.name] for s in plan.specs]
        for who, pack in ((0, True), (1, False)):
            transport.barrier(timeout)
            if rank == who:
                key = "pack_all_s" if pack else "unpack_all_s"
                breakdown[key] = _time_copies(plan, ordered, pack, threads)
                breakdown["copied_bytes"] = plan.total_bytes
        transport.barrier(timeout)
    out.put(
        (rank, {"times": times, "bytes": nbytes, "tensors": len(shapes), "breakdown": breakdown})
    )
    transport.close()


def run_model(model: str, opts: dict) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = opts["engines"] + 1
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, model, opts, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports = {}
    while len(reports) < world:  # drain before joining: a child blocks until it is read
        try:
            rank, report = out.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                break
            continue
        reports[rank] = report
    for p in procs:
        p.join()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0 or r not in reports]
    if bad:
        raise SystemExit(f"bench_weight_sync: rank(s) {bad} failed for model {model}")
    result = reports[0]
    med = {m: statistics.median(ts) for m, ts in result["times"].items()}
    breakdown = dict(result["breakdown"])
    for rank in range(1, world):
        for key, value in reports[rank]["breakdown"].items():
            breakdown.setdefault(key if key.endswith("_s") else f"engine{rank}_{key}", value)
    row = {
        "model": model,
        "transport": opts["transport"],
        "layout": "separate tensors" if opts["separate"] else "one layout buffer",
        "bucket_mb": opts["bucket_mb"],
        "solo_mb": opts["solo_mb"],
        "engines": opts["engines"],
        "gbytes": result["bytes"] / 1e9,
        "tensors": result["tensors"],
        "seconds": med,
        "all_seconds": result["times"],
        "gbytes_per_s": {m: result["bytes"] / 1e9 / s for m, s in med.items()},
        "breakdown": breakdown,
    }
    if "single_buffer" in med:
        row["bucketed_vs_single_buffer"] = med["single_buffer"] / med["bucketed"]
        row["bucketed_vs_per_tensor"] = med["per_tensor"] / med["bucketed"]
    return row


def table(rows: list[dict]) -> str:
    headers = [
        "model",
        "tensors",
        "GB (bf16)",
        "buckets (in place)",
        "single buffer s",
        "bucketed s",
        "per-tensor s",
        "bucketed GB/s",
        "bucketed / single (goal ≥ 0.9)",
        "speed-up vs per-tensor",
    ]
    body = []
    for r in rows:
        b = r["breakdown"]
        body.append(
            [
                f"{r['model']} ({r['layout']})",
                r["tensors"],
                fmt(r["gbytes"], ".2f"),
                f"{b.get('buckets', '')} ({b.get('direct', '')} / {b.get('engine1_in_place', '')})",
                fmt(r["seconds"].get("single_buffer"), ".3f"),
                fmt(r["seconds"]["bucketed"], ".3f"),
                fmt(r["seconds"].get("per_tensor"), ".3f"),
                fmt(r["gbytes_per_s"]["bucketed"], ".2f"),
                fmt(r.get("bucketed_vs_single_buffer"), ".3f"),
                fmt(r.get("bucketed_vs_per_tensor"), ".2f"),
            ]
        )
    return markdown_table(headers, body)


def breakdown_table(rows: list[dict]) -> str:
    """Where a bucketed update's time goes: collectives and the copies of the packing path."""
    headers = [
        "model",
        "broadcast launch ms",
        "collectives / update",
        "pack every bucket s (GB/s)",
        "unpack every bucket s (GB/s)",
    ]
    body = []
    for r in rows:
        b = r["breakdown"]
        if "launch_s" not in b:
            continue
        gb = b["copied_bytes"] / 1e9
        body.append(
            [
                f"{r['model']} ({r['layout']})",
                fmt(b["launch_s"] * 1e3, ".2f"),
                b["buckets"] + 4,  # + header size, header, accept round, completion round
                f"{b['pack_all_s']:.3f} ({gb / b['pack_all_s']:.1f})",
                f"{b['unpack_all_s']:.3f} ({gb / b['unpack_all_s']:.1f})",
            ]
        )
    return markdown_table(headers, body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["gloo", "shm", "cuda-ipc"], default="gloo")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (ranks 1..)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument(
        "--solo-mb",
        type=float,
        default=None,
        help="WeightSender solo_bytes in MiB (tensors this large get buckets of their own); "
        "default 0 for one layout buffer (every bucket moves in place anyway, and fewer "
        "buckets mean fewer broadcasts), the sender's default 4 with --separate",
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="tensors allocated one by one instead of views of one layout buffer (needs "
        "twice the memory: the single-buffer baseline has its own buffer)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/packing threads per process (3 processes share the cores)",
    )
    parser.add_argument(
        "--controller",
        action="store_true",
        help="latency inside the running loop: shm vs network links, 1 and 2 workers",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=4, help="--controller: training steps"
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="--controller: rollout workers of the cases (shm and broadcast each)",
    )
    parser.add_argument(
        "--step-seconds",
        type=non_negative_float,
        default=3.0,
        help="--controller: seconds per train step",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.controller:
        return controller_main(args)
    rows = []
    for model in args.models:
        eprint(f"bench_weight_sync: {model} over {args.transport} ...")
        opts = {
            k: getattr(args, k)
            for k in ("transport", "engines", "bucket_mb", "solo_mb", "repeats", "threads")
        }
        opts["separate"] = args.separate
        if opts["solo_mb"] is None:
            opts["solo_mb"] = 4.0 if args.separate else 0.0
        rows.append(run_model(model, opts))
    print(table(rows))
    if any("launch_s" in r["breakdown"] for r in rows):
        print()
        print(breakdown_table(rows))
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


def controller_main(args) -> int:
    """``--controller``: every case of :mod:`_weight_sync_loop` for ``--models``."""
    from _weight_sync_loop import CASES, controller_bench

    cases = [(t, w) for t, w in CASES if w in args.workers]
    if not cases:
        raise SystemExit(f"--workers {args.workers}: no case (cases have 1 or 2 workers)")
    rows = controller_bench(args.models, model_shapes, args.steps, args.step_seconds, cases)
    by = {(r["model"], r["transport"], r["workers"]): r for r in rows}
    body = []
    for r in rows:
        shm = by[(r["model"], "shm", r["workers"])]["latency_median_s"]
        body.append(
            [
                r["model"],
                fmt(r["gbytes"], ".2f"),
                r["transport"],
                r["workers"],
                fmt(r["latency_median_s"], ".3f"),
                fmt(min(r["latency_seconds"]), ".3f"),
                fmt(max(r["latency_seconds"]), ".3f"),
                fmt(statistics.median(r["worker_update_seconds"]), ".3f"),
                fmt(r["latency_median_s"] / shm, ".2f"),
            ]
        )
    print(
        markdown_table(
            [
                "model",
                "GB (bf16)",
                "path",
                "workers",
                "latency median s",
                "min s",
                "max s",
                "worker update median s",
                "vs shm",
            ],
            body,
        )
    )
    write_json(
        args.json,
        {
            "meta": base_metadata(1),
            "args": {k: str(v) for k, v in vars(args).items()},
            "cases": rows,
        },
        indent=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
