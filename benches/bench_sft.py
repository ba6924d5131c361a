"""``areal-fast sft`` against TRL's ``SFTTrainer`` on the identical job.

The same model (the demo SmolLM2-135M-Instruct, float32, CPU), the same rows (the first
``--rows`` of ``examples/data/sft_arith/train.jsonl``, prompt + completion rendered as a user
and an assistant turn by the model's chat template, the loss on the completion only), the
same rows per step (``--batch``), steps, learning rate, AdamW, gradient clipping, seed,
threads and activation checkpointing (``--checkpointing``, on by default as in TRL's
``SFTConfig``); packing on in both (areal_fast: rows packed without padding into micro-batches of
at most ``--tokens-per-mb`` tokens; TRL: ``packing=True`` with its default best-fit-decreasing
strategy, padding-free, packed sequences of at most as many tokens, gradient accumulation over
as many as one step's rows fill). On a CPU without flash-attn TRL's packed sequences attend
across row boundaries (its documented padding-free caveat), so its attention does more work
than areal_fast's per-row (varlen) attention. Each run is a child process of its own, timed
step by step after ``--warmup`` untimed steps:

- **train tokens/s**: packed tokens (prompt + completion) of the timed steps over their wall
  time (areal_fast: ``metrics.jsonl``'s ``tokens`` and ``step_seconds``; TRL: the collated
  batches' tokens and a callback's step times);
- **peak RSS**: the child's resident high-water mark (``getrusage``), the model load included;
- **held-out accuracy** of each final model by ``areal-fast eval`` (greedy, the 200 held-out
  problems of ``examples/arith.yaml``), with ``--eval``.

    python benches/bench_sft.py --json benches/results/sft_vs_trl_cpu.json --eval
    python benches/bench_sft.py --batch 256 --rows 1298 --steps 6 \
        --json benches/results/sft_vs_trl_cpu_b256.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import REPO_ROOT, base_metadata, eprint, markdown_table, positive_int, write_json

from areal_fast.launch.allocator import ALLOCATORS, trainer_environment

ROWS_FILE = REPO_ROOT / "examples" / "data" / "sft_arith" / "train.jsonl"
SFT_CONFIG = REPO_ROOT / "examples" / "sft_arith.yaml"
EVAL_CONFIG = REPO_ROOT / "examples" / "arith.yaml"

# the TRL child: prints one JSON line {"tokens": [...], "seconds": [...], "peak_rss_kib": ...}
TRL_CHILD = r"""
import json, resource, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
from trl import SFTConfig, SFTTrainer

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
set_seed(args["seed"])
rows = [json.loads(line) for line in open(args["rows_file"])][: args["rows"]]
data = Dataset.from_list([
    {"prompt": [{"role": "user", "content": r["prompt"]}],
     "completion": [{"role": "assistant", "content": r["completion"]}]}
    for r in rows
])
tokenizer = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
seen = [0]  # tokens collated so far
tokens, seconds, marks = [], [], {}

class Times(TrainerCallback):  # per optimizer step (several packed sequences when accumulating)
    def on_train_begin(self, *_, **__):
        marks["time"], marks["tokens"] = time.perf_counter(), 0
    def on_step_end(self, *_, **__):
        now = time.perf_counter()
        seconds.append(now - marks["time"])
        tokens.append(seen[0] - marks["tokens"])
        marks["time"], marks["tokens"] = now, seen[0]

micro = min(args["tokens_per_step"], args["tokens_per_mb"])
config = SFTConfig(
    output_dir=args["out"], max_steps=args["steps"], per_device_train_batch_size=1,
    gradient_accumulation_steps=-(-args["tokens_per_step"] // micro),
    max_length=micro, packing=True, learning_rate=args["lr"],
    max_grad_norm=args["grad_clip"], lr_scheduler_type="constant", warmup_steps=0,
    weight_decay=0.0, seed=args["seed"], bf16=False, fp16=False, use_cpu=True,
    gradient_checkpointing=args["gradient_checkpointing"],
    logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
    completion_only_loss=True,
)
trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                     callbacks=[Times()])
collate = trainer.data_collator
def counting(batch):
    out = collate(batch)
    seen[0] += int(out["input_ids"].numel())
    return out
trainer.data_collator = counting
trainer.train()
trainer.save_model(args["out"] + "/model")
tokenizer.save_pretrained(args["out"] + "/model")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from areal_fast.launch.allocator import loaded_allocator
print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_rss_kib": peak,
                  "allocator": loaded_allocator()}))
"""

# the areal_fast child: runs the CLI in-process and prints its peak RSS as one JSON line
AF_CHILD = r"""
import json, resource, sys
from areal_fast.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def run_areal(args, out: Path) -> dict:
    """``areal-fast sft`` in a child: per-step tokens and seconds, peak RSS, the model path."""
    overrides = [
        f"total_steps={args.steps}",
        f"batch_size={args.batch}",
        f"seed={args.seed}",
        f"threads={args.threads}",
        f"actor.optim.lr={args.lr}",
        "actor.optim.lr_schedule=constant",
        "actor.optim.warmup_steps=0",
        f"actor.optim.grad_clip={args.grad_clip}",
        f"actor.max_tokens_per_mb={args.tokens_per_mb}",
        f"data.path={args.rows_path}",
        "eval.before=false",
        "eval.after=false",
        f"experiment_name={out.name}",
        f"fileroot={out.parent}",
    ]
    cmd = ["sft", "--config", str(SFT_CONFIG), *overrides, f"launcher.allocator={args.allocator}",
           f"actor.gradient_checkpointing={args.checkpointing == 'on'}"]  # fmt: skip
    # the environment `areal-fast sft` gives itself (it starts itself again with it)
    env = {**os.environ, **trainer_environment(args.allocator)}
    done = subprocess.run(
        [sys.executable, "-c", AF_CHILD, *cmd], capture_output=True, text=True, cwd=REPO_ROOT,
        env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"areal-fast sft failed:\n{done.stderr[-3000:]}")
    result = _last_json(done.stdout)
    run_dir = next(out.parent.glob(f"{out.name}/*/metrics.jsonl")).parent
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result["tokens"] = [r["tokens"] for r in records]
    result["seconds"] = [r["step_seconds"] for r in records]
    result["model"] = str(run_dir / "checkpoint")
    result["allocator"] = json.loads((run_dir / "summary.json").read_text())["allocator"]
    return result


def run_trl(args, out: Path, model: str, tokens_per_step: int) -> dict:
    """TRL's ``SFTTrainer`` in a child on the same rows and settings."""
    payload = dict(
        threads=args.threads, seed=args.seed, rows_file=str(args.rows_path), rows=args.rows,
        model=model, out=str(out), steps=args.steps, tokens_per_step=tokens_per_step,
        tokens_per_mb=args.tokens_per_mb,
        lr=args.lr, grad_clip=args.grad_clip, gradient_checkpointing=args.checkpointing == "on",
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", TRL_CHILD, json.dumps(payload)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"TRL SFTTrainer failed:\n{done.stderr[-3000:]}")
    result = _last_json(done.stdout)
    result["model"] = str(out / "model")
    return result


def held_out_accuracy(model: str, out: Path, threads: int) -> float:
    """Greedy held-out accuracy of ``model`` by ``areal-fast eval`` (examples/arith.yaml)."""
    cmd = [
        sys.executable, "-m", "areal_fast.cli", "eval", "--config", str(EVAL_CONFIG),
        f"model.path={model}", f"experiment_name={out.name}", f"fileroot={out.parent}",
        f"threads={threads}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SystemExit(f"areal-fast eval failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for path in out.rglob("eval.jsonl") for line in open(path)]
    if not rows:
        raise SystemExit(f"areal-fast eval wrote no eval.jsonl under {out}")
    return sum(bool(r["correct"]) for r in rows) / len(rows)


def summarize(name: str, run: dict, warmup: int) -> dict:
    """Timed-step throughput and peak memory of one run."""
    tokens, seconds = run["tokens"][warmup:], run["seconds"][warmup:]
    return {
        "impl": name,
        "steps_timed": len(seconds),
        "tokens_per_step": sum(tokens) / max(len(tokens), 1),
        "train_tokens_per_s": sum(tokens) / max(sum(seconds), 1e-9),
        "peak_rss_mb": run["peak_rss_kib"] / 1024,
        "allocator": run["allocator"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=16, help="rows per step")
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed first steps")
    parser.add_argument(
        "--tokens-per-mb",
        type=positive_int,
        default=4096,
        help="micro-batch tokens (areal_fast: actor.max_tokens_per_mb; TRL: max_length of a "
        "packed sequence, gradient accumulation over as many as a step's tokens need)",
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing in both (on: TRL SFTConfig's default, "
        "gradient_checkpointing=True; areal_fast: actor.gradient_checkpointing)",
    )
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="auto",
        help="areal_fast's launcher.allocator (TRL runs on the C library's malloc)",
    )
    parser.add_argument("--eval", action="store_true", help="held-out accuracy of both models")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        tmp = Path(tmp)
        args.rows_path = tmp / "rows.jsonl"  # the same rows for both
        lines = ROWS_FILE.read_text().splitlines()[: args.rows]
        args.rows_path.write_text("\n".join(lines) + "\n")
        eprint("areal-fast sft ...")
        ours = run_areal(args, tmp / "areal")
        per_step = round(sum(ours["tokens"]) / len(ours["tokens"]))
        eprint(f"TRL SFTTrainer ({per_step} tokens per packed step) ...")
        from areal_fast.models.loading import resolve_model_path

        trl = run_trl(args, tmp / "trl", str(resolve_model_path("demo:SmolLM2-135M-Instruct")),
                      per_step)  # fmt: skip
        rows = [summarize("areal_fast", ours, args.warmup), summarize("trl", trl, args.warmup)]
        if args.eval:
            for row, run in zip(rows, (ours, trl)):
                eprint(f"held-out accuracy of {row['impl']} ...")
                row["held_out_accuracy"] = held_out_accuracy(
                    run["model"], tmp / f"eval-{row['impl']}", args.threads
                )
    ratio = {
        "tokens_per_s": rows[0]["train_tokens_per_s"] / rows[1]["train_tokens_per_s"],
        "peak_rss": rows[0]["peak_rss_mb"] / rows[1]["peak_rss_mb"],
    }
    headers = list(rows[0])
    print(markdown_table(headers, [[r.get(h) for h in headers] for r in rows]))
    print(
        f"areal_fast / TRL: tokens/s {ratio['tokens_per_s']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x"
    )
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json(args.json, {**base_metadata(args.threads), "args": settings, "rows": rows,
                               "areal_fast_over_trl": ratio})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
