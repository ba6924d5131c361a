"""Training-step throughput of areal_fast's trainer engine on a randomly initialised Qwen2 model.

The model is built from a config file in the repository (default
``benches/configs/qwen2_1p5b.json``: the Qwen2-1.5B shape, hidden 1536, 28 layers, 12 heads,
2 KV heads, intermediate 8960, vocab 151936, tied LM head), random weights, nothing
downloaded. A synthetic packed batch (random tokens, ``--seqs`` sequences of lengths drawn in
[seq_len/2, seq_len], the first quarter of each a prompt, GRPO groups of 4 with random
rewards) goes through :class:`areal_fast.train.torch_engine.TorchTrainEngine.train_step`
(packed attention, chunked log-probs, GRPO loss, AdamW): ``--warmup`` untimed steps, then
``--steps`` timed ones. The behaviour log-probs are the model's own (one no-grad pass before
the first step), so every ratio starts at 1 and every trained token carries a gradient.

On CUDA the trainer trains as a CUDA job's does (``--precision mixed``, the default where
:mod:`areal_fast.train.precision` exists: float32 master weights, gradients and AdamW state, the
decoder computing in bfloat16), or with bfloat16 parameters and state (``--precision bf16``).

Reported: seconds per step, tokens/s (all packed tokens, forward + backward + optimizer step),
peak memory, and the model FLOP utilisation::

    flops/step = 6 · N · T + 6 · n_layers · n_heads · head_dim · Σ_s L_s²

N = parameters that enter matmuls (all but the input embedding; a tied LM head counted once),
T = packed tokens, L_s = sequence lengths (causal attention: half of the 12 · n_layers · d · L
per token that counts the full score matrix). MFU = flops/step / seconds/step over the bf16
dense peak (``--peak-tflops``, default 989.4 for an H200 SXM) and over the bf16 matmul rate
measured in the same run (an 8192³ ``torch.mm`` on random data).

Defaults on CUDA: 16 sequences of up to 2048 tokens (about 24 600 tokens per step) in
micro-batches of at most 16384 tokens; on the CPU 4 sequences of up to 64.

``--fsdp nccl`` runs the same step through :class:`areal_fast.train.fsdp.FSDPTrainEngine`
sharded over a one-rank NCCL group (CUDA); ``--fsdp gloo`` over a one-rank gloo group (the
CPU). The weights are drawn from ``--seed`` right before the model is built, so a plain and an
FSDP run of the same arguments start from the same weights and batch: their first gradient
norm (step 0, before any update) and recomputed behaviour log-probs, both computed through
FSDP in the second run, must agree. The record carries what that comparison needs:
``weights_checksum`` (float64 sum of every parameter at the start), ``grad_norms`` and
``behav_logprobs_sample`` (256 evenly spaced trained tokens' log-probs, float32, and their
positions). ``--device cpu --tiny`` builds the same layer structure at 1/16 of the width
(hidden, intermediate and vocabulary; heads and KV heads kept) in float32, for a check
without a GPU.

Usage::

    python benches/bench_train_step.py --device cuda --json OUT.json      # 1.5B shape
    python benches/bench_train_step.py --device cuda --fsdp nccl --json OUT.json
    python benches/bench_train_step.py --device cpu --tiny --steps 1 --warmup 0 [--fsdp gloo]
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as hx  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "qwen2_1p5b.json"
H200_BF16_DENSE_TFLOPS = 989.4  # NVIDIA H200 SXM datasheet, dense bf16
TINY_FACTOR = 16
GROUP_SIZE = 4
SEED = 0
LOGPROB_SAMPLE = 256  # trained tokens whose behaviour log-probs the record keeps


# ---------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------


def load_config(path: str | Path):
    """The transformers ``Qwen2Config`` of a JSON file (``model_type`` must be "qwen2").

    Raises
    ------
    ValueError
        The file is missing, not JSON, or not a Qwen2 config (the message names the file).
    """
    from transformers import Qwen2Config

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a JSON model config ({exc})") from None
    model_type = data.pop("model_type", None)
    if model_type != "qwen2":
        raise ValueError(f"{path}: model_type = {model_type!r}, expected 'qwen2'")
    return Qwen2Config(**data)


def tiny_config(config, factor: int = TINY_FACTOR):
    """The same layer structure at 1/``factor`` of the width.

    Layers, attention heads and KV heads are kept; hidden size (a multiple of 2·heads, so the
    head dimension stays even for the rotary embedding), intermediate size and vocabulary are
    divided by ``factor``.
    """
    from transformers import Qwen2Config

    data = config.to_dict()
    heads = config.num_attention_heads
    unit = 2 * heads
    data["hidden_size"] = max(unit, round(config.hidden_size / factor / unit) * unit)
    data["intermediate_size"] = max(8, config.intermediate_size // factor)
    data["vocab_size"] = max(64, config.vocab_size // factor)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if data.get(key) is not None and data[key] >= data["vocab_size"]:
            data[key] = data["vocab_size"] - 1
    for key in ("model_type", "transformers_version", "head_dim"):
        data.pop(key, None)
    return Qwen2Config(**data)


def with_layers(config, layers: int):
    """``config`` with ``layers`` decoder layers (per-layer settings rebuilt)."""
    from transformers import Qwen2Config

    data = config.to_dict()
    data["num_hidden_layers"] = layers
    for key in ("model_type", "transformers_version", "head_dim", "layer_types"):
        data.pop(key, None)
    return Qwen2Config(**data)


PRECISIONS = ("auto", "bf16", "mixed", "fp32")


def build_model(config, device: str, precision: str = "fp32"):
    """A randomly initialised causal LM of ``config``, created directly on ``device``.

    ``precision``: "fp32" (float32 parameters and compute), "bf16" (bfloat16 parameters,
    gradients, AdamW state and compute) or "mixed" (float32 master weights, the decoder
    computing in bfloat16 through :func:`areal_fast.train.precision.compute_in_dtype`, as the
    trainer of a CUDA job with ``model.dtype=bfloat16`` does).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if precision == "mixed":
        from areal_fast.train.precision import compute_in_dtype

        compute_in_dtype(model, torch.bfloat16)
    return model


def resolve_precision(precision: str, device: str) -> str:
    """ "auto": "mixed" on CUDA where areal_fast.train.precision exists (else "bf16"), "fp32"
    on the CPU; anything else as given."""
    import importlib.util

    if precision != "auto":
        return precision
    if not device.startswith("cuda"):
        return "fp32"
    return "mixed" if importlib.util.find_spec("areal_fast.train.precision") else "bf16"


def matmul_params(model) -> int:
    """Parameters that enter matmuls: all but the input embedding (a tied LM head, which is
    the embedding's tensor, counted once)."""
    total = sum(p.numel() for p in model.parameters())  # shared tensors once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return total if head is embed else total - embed.numel()


def step_flops(config, n_matmul: int, seq_lens: list[int]) -> float:
    """Model FLOPs of one forward + backward (the formula of the module docstring)."""
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    attn_width = config.num_attention_heads * head_dim
    tokens = sum(seq_lens)
    attention = 6.0 * config.num_hidden_layers * attn_width * sum(n * n for n in seq_lens)
    return 6.0 * n_matmul * tokens + attention


# ---------------------------------------------------------------------------
# Batch
# ---------------------------------------------------------------------------


def synthetic_batch(vocab: int, seqs: int, seq_len: int, seed: int):
    """A PackedBatch of random tokens: lengths in [seq_len/2, seq_len], a prompt of a quarter
    of each, groups of GROUP_SIZE with random 0/1 rewards and GRPO advantages; behaviour
    log-probs 0 (filled in by :func:`run`), versions 0."""
    import torch

    from areal_fast.rl.advantages import group_advantages
    from areal_fast.rl.batch import Trajectory, pack_trajectories

    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(seqs):
        length = int(torch.randint(max(2, seq_len // 2), seq_len + 1, (1,), generator=gen))
        prompt = max(1, length // 4)
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        completion = length - prompt
        trajs.append(
            Trajectory(
                ids[:prompt],
                ids[prompt:],
                [0.0] * completion,
                [0] * completion,
                "length",
                group_id=i // GROUP_SIZE,
                reward=float(torch.randint(0, 2, (1,), generator=gen)),
            )
        )
    rewards = torch.tensor([t.reward for t in trajs])
    group_ids = torch.tensor([t.group_id for t in trajs])
    return pack_trajectories(trajs, group_advantages(rewards, group_ids=group_ids))


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


def measure_matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """bf16 ``torch.mm`` rate of an n×n×n product on random data (CUDA events, median)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 / statistics.median(times) / 1e12


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(model, args):
    """The trainer engine: TorchTrainEngine, or FSDPTrainEngine over a one-rank group of
    ``args.fsdp`` (nccl or gloo; 120 s timeout on the rendezvous and every collective)."""
    from areal_fast.train.config import ActorConfig, OptimizerConfig

    actor = ActorConfig(max_tokens_per_mb=args.max_tokens_per_mb, optim=OptimizerConfig(lr=args.lr))
    if not args.fsdp:
        from areal_fast.train.torch_engine import TorchTrainEngine

        return TorchTrainEngine(model, actor, temperature=1.0)
    from areal_fast.train.fsdp import FSDPTrainEngine, init_trainer_group

    mesh = init_trainer_group(0, 1, f"tcp://127.0.0.1:{_free_port()}", args.fsdp, 120.0)
    return FSDPTrainEngine(model, actor, mesh=mesh, temperature=1.0)


def weights_checksum(model) -> float:
    """float64 sum of every parameter (a tied tensor once): equal for equal weights."""
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))


def logprob_sample(logprobs, loss_mask, n: int = LOGPROB_SAMPLE) -> dict:
    """``n`` evenly spaced trained tokens' log-probs ([T] float, [T] bool mask): positions
    and values, for comparing two runs on the same batch."""
    import torch

    trained = loss_mask.nonzero().squeeze(1)
    pick = trained[torch.linspace(0, trained.numel() - 1, min(n, trained.numel())).long()]
    return {"positions": pick.tolist(), "values": logprobs[pick].float().tolist()}


def zero_grad_params(model) -> list[str]:
    """Names of weight matrices (≥ 2 dims) whose gradient is missing or all zero."""
    names = []
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        grad = p.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        if grad is None or not bool(grad.abs().sum() > 0):
            names.append(name)
    return names


def _train(engine, batch, args) -> tuple[list, list, list]:
    """``--warmup`` untimed then ``--steps`` timed train steps: (warm-up seconds, timed
    seconds, every step's stats)."""
    import torch

    warmup_s, step_s, stats_seen = [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        _sync(args.device)
        t0 = time.perf_counter()
        stats = engine.train_step(batch)
        _sync(args.device)
        (warmup_s if i < args.warmup else step_s).append(time.perf_counter() - t0)
        stats_seen.append(stats)
        hx.eprint(
            f"step {i} ({'warm-up' if i < args.warmup else 'timed'}): "
            f"{(warmup_s + step_s)[-1]:.3f} s, loss {stats['loss']:.5f}, "
            f"grad_norm {stats['grad_norm']:.4g}, "
            f"micro-batches {stats.get('num_micro_batches', float('nan')):.0f}"
        )
    return warmup_s, step_s, stats_seen


CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def run(args) -> dict:
    """Build, warm up, time; the result record (see the module docstring)."""
    import torch

    config = load_config(args.config)
    if args.tiny:
        config = tiny_config(config)
    if args.layers is not None:
        config = with_layers(config, args.layers)
    precision = resolve_precision(args.precision, args.device)
    meta = hx.base_metadata(torch.get_num_threads())
    meta.update(device=args.device, precision=precision)
    if args.device.startswith("cuda"):
        meta.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    matmul_tflops = measure_matmul_tflops() if args.device.startswith("cuda") else None

    start = time.perf_counter()
    torch.manual_seed(args.seed)  # the same weights in a plain and an FSDP run
    model = build_model(config, args.device, precision)
    checksum = weights_checksum(model)
    engine = make_engine(model, args)
    build_s = time.perf_counter() - start
    n_matmul = matmul_params(model)

    batch = synthetic_batch(config.vocab_size, args.seqs, args.seq_len, args.seed)
    behav = engine.recompute_logprobs(batch)  # the model's own: every ratio starts at 1
    batch.behav_logprobs = (behav.float().cpu() * batch.loss_mask).contiguous()
    seq_lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    flops = step_flops(config, n_matmul, seq_lens)
    warmup_s, step_s, stats_seen = _train(engine, batch, args)
    median = statistics.median(step_s) if step_s else None
    zero = zero_grad_params(model)
    losses = [float(s["loss"]) for s in stats_seen]
    grad_norms = [float(s["grad_norm"]) for s in stats_seen]
    record = {
        "metadata": meta,
        "mode": f"fsdp_{args.fsdp}_1rank" if args.fsdp else "plain",
        "precision": precision,
        "engine": type(engine).__name__,
        "config_file": str(args.config),
        "tiny": bool(args.tiny),
        "config": {k: getattr(config, k) for k in CONFIG_KEYS},
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_matmul_params": n_matmul,
        "batch": {
            "seqs": batch.num_seqs,
            "tokens": batch.num_tokens,
            "trained_tokens": int(batch.loss_mask.sum()),
            "max_seqlen": batch.max_seqlen,
            "sum_sq_seqlens": sum(n * n for n in seq_lens),
            "max_tokens_per_mb": args.max_tokens_per_mb,
        },
        "flops_formula": "6*N*T + 6*n_layers*n_heads*head_dim*sum_s(L_s^2)",
        "flops_per_step": flops,
        "build_s": build_s,
        "warmup_step_s": warmup_s,
        "step_s": step_s,
        "median_step_s": median,
        "tokens_per_s": None if not median else batch.num_tokens / median,
        "model_tflops_per_s": None if not median else flops / median / 1e12,
        "peak_tflops": args.peak_tflops,
        "matmul_tflops_measured": matmul_tflops,
        "losses": losses,
        "grad_norms": grad_norms,
        "weights_checksum": checksum,
        "behav_logprobs_sample": logprob_sample(batch.behav_logprobs, batch.loss_mask),
        "num_micro_batches": stats_seen[-1].get("num_micro_batches") if stats_seen else None,
        "zero_grad_params": zero,
        "checks": {
            "finite_loss": all(math.isfinite(v) for v in losses),
            "finite_grad_norm": all(math.isfinite(v) for v in grad_norms),
            "nonzero_grads": bool(grad_norms) and min(grad_norms) > 0 and not zero,
        },
    }
    _finish(record, args, flops, median, matmul_tflops)
    return record


def _finish(record: dict, args, flops: float, median, matmul_tflops) -> None:
    """MFU and peak memory into ``record``; the process group of an FSDP run destroyed."""
    import torch

    if median:
        record["mfu_vs_peak"] = flops / median / (args.peak_tflops * 1e12)
        if matmul_tflops:
            record["mfu_vs_measured_matmul"] = flops / median / (matmul_tflops * 1e12)
    if args.device.startswith("cuda"):
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()


def render(record: dict) -> str:
    """A one-row markdown table of a result record."""
    headers = [
        "mode",
        "params",
        "tokens/step",
        "micro-batches",
        "median s/step",
        "tokens/s",
        "model TFLOP/s",
        "MFU vs peak",
        "MFU vs measured mm",
        "peak GiB",
        "losses",
    ]
    row = [
        f"{record['mode']}, {record['precision']}" + (" (tiny)" if record["tiny"] else ""),
        f"{record['n_params'] / 1e9:.3f} B",
        record["batch"]["tokens"],
        hx.fmt(record["num_micro_batches"], ".0f"),
        hx.fmt(record["median_step_s"], ".3f"),
        hx.fmt(record["tokens_per_s"], ".0f"),
        hx.fmt(record["model_tflops_per_s"], ".1f"),
        hx.fmt(record.get("mfu_vs_peak"), ".3f"),
        hx.fmt(record.get("mfu_vs_measured_matmul"), ".3f"),
        hx.fmt(record.get("peak_memory_gib"), ".1f"),
        ", ".join(f"{v:.4f}" for v in record["losses"]),
    ]
    mm = record.get("matmul_tflops_measured")
    note = (
        f"flops/step = {record['flops_formula']} = {record['flops_per_step']:.4g}; "
        f"N = {record['n_matmul_params']}; peak {record['peak_tflops']} TFLOP/s; measured "
        f"bf16 mm {hx.fmt(mm, '.1f')} TFLOP/s"
    )
    return hx.markdown_table(headers, [row]) + "\n\n" + note


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (float32)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--tiny", action="store_true", help="1/16 of the width, same layers")
    parser.add_argument(
        "--layers", type=int, default=None, help="this many decoder layers instead (quick checks)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="bf16: bfloat16 parameters and optimizer state; mixed: float32 master weights, "
        "bfloat16 compute (the CUDA job's trainer); auto: mixed on CUDA where available, "
        "else bf16; fp32 on the CPU",
    )
    parser.add_argument("--steps", type=int, default=2, help="timed train steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--seqs", type=int, default=None, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=None, help="longest sequence")
    parser.add_argument("--max-tokens-per-mb", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument(
        "--fsdp",
        choices=("nccl", "gloo"),
        default=None,
        help="FSDP2 over a one-rank group of this backend (nccl: CUDA; gloo: the CPU)",
    )
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if args.device != "cpu" and not on_cuda:
        parser.error(f"--device {args.device!r}: use cuda or cpu")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if not on_cuda and args.precision in ("bf16", "mixed"):
        parser.error(f"--precision {args.precision} needs --device cuda")
    if args.fsdp == "nccl" and not on_cuda:
        parser.error("--fsdp nccl needs --device cuda")
    if args.seqs is None:
        args.seqs = 16 if on_cuda else 4
    if args.seq_len is None:
        args.seq_len = 2048 if on_cuda else 64
    if args.max_tokens_per_mb is None:
        args.max_tokens_per_mb = 16384 if on_cuda else 4096
    return args


def main(argv=None) -> dict:
    """Run the benchmark; prints the table, writes ``--json``, returns the record."""
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            hx.eprint(f"bench_train_step: --device {args.device} but torch sees no CUDA device")
            raise SystemExit(2)
    record = run(args)
    hx.write_json(args.json, record)
    print(render(record), flush=True)
    return record


if __name__ == "__main__":
    main()
    sys.exit(0)
