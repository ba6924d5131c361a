"""How the embedded engine batches: static ``model.generate`` batches, this project's continuous
decode loop (``DecodeBatch``) and transformers' own continuous batching, on the same requests.

The default job's generation (``examples/arith.yaml``): ``--prompts`` single-digit additions,
chat-templated with the job's instruction, × ``--samples`` samples of up to ``--max-new``
tokens at temperature 0.7, on the demo model (SmolLM2-135M-Instruct, float32), one torch
thread by default (what a rollout worker has on 2 cores). Each round runs every method once,
in turn, in one process; the table gives each method's median over ``--rounds`` rounds and its
ratio to ``static`` within the same rounds.

- ``static``: :class:`~areal_fast.rollout.hf_engine.HFEngine` with ``batching="static"``
  (left-padded ``model.generate`` batches of ``max_batch_size``), seeded sampling.
- ``continuous``: ``HFEngine`` with ``batching="continuous"`` (the default), seeded sampling.
- ``transformers_cb``: transformers' ``ContinuousBatchingManager`` (``generate_batch`` with a
  paged cache, attention ``paged|sdpa``), sampling from torch's generator: it has no
  per-request seeded draws, so its samples depend on the batch (what the engine's interface
  rules out); timed for speed only.

    python benches/bench_hf_batching.py --json benches/results/hf_batching_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_metadata, eprint, fmt, markdown_table, positive_int, write_json  # noqa: E402

METHODS = ("static", "continuous", "transformers_cb")
DEMO = "demo:SmolLM2-135M-Instruct"
INSTRUCTION = "Give only the final answer as a number."


def build_prompts(tokenizer, prompts: int) -> list[list[int]]:
    """``prompts`` chat-templated additions a + b (a, b single digits, in a fixed order)."""
    pairs = [(a, b) for a in range(1, 10) for b in range(10)]
    out = []
    for a, b in pairs[:prompts]:
        messages = [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_engine(engine, prompts, args) -> tuple[float, int]:
    """Seconds and generated tokens of one batch-API call of an HFEngine."""
    from areal_fast.rollout.engine import SamplingParams

    params = SamplingParams(n=args.samples, temperature=0.7, max_new_tokens=args.max_new)
    start = time.perf_counter()
    out = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    return time.perf_counter() - start, sum(len(t.completion_ids) for t in out)


def run_transformers_cb(model, tokenizer, prompts, args) -> tuple[float, int]:
    """Seconds and generated tokens of transformers' ``generate_batch`` on the same requests."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.max_new, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    inputs = [p for p in prompts for _ in range(args.samples)]
    start = time.perf_counter()
    out = model.generate_batch(inputs, generation_config=config)
    return time.perf_counter() - start, sum(len(o.generated_tokens) for o in out.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--samples", type=positive_int, default=4)
    parser.add_argument("--max-new", type=positive_int, default=32)
    parser.add_argument("--max-batch-size", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    import torch

    from areal_fast.models.loading import load_causal_lm, load_tokenizer
    from areal_fast.rollout.hf_engine import HFEngine

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(DEMO)
    prompts = build_prompts(tokenizer, args.prompts)
    runners = {}
    for method in args.methods:
        if method == "transformers_cb":
            model = load_causal_lm(DEMO, "float32", "paged|sdpa")
            runners[method] = lambda m=model: run_transformers_cb(m, tokenizer, prompts, args)
        else:
            engine = HFEngine(load_causal_lm(DEMO), tokenizer, args.max_batch_size, method)
            runners[method] = lambda e=engine: run_engine(e, prompts, args)
    for run in runners.values():  # warm-up, untimed
        run()
    rounds = {m: [] for m in runners}
    for r in range(args.rounds):
        for method, run in runners.items():
            seconds, tokens = run()
            rounds[method].append({"seconds": seconds, "tokens": tokens})
            eprint(f"round {r}: {method} {seconds:.2f} s, {tokens} tokens")
    result = {"meta": base_metadata(args.threads), "args": vars(args), "cases": []}
    for method, runs in rounds.items():
        median = statistics.median(x["seconds"] for x in runs)
        case = {"method": method, "rounds": runs, "median_s": median}
        case["tokens_per_s"] = statistics.median(x["tokens"] / x["seconds"] for x in runs)
        if "static" in rounds:
            case["speedup_vs_static"] = statistics.median(
                s["seconds"] / x["seconds"] for s, x in zip(rounds["static"], runs)
            )
        result["cases"].append(case)
    write_json(args.json, result)
    print(
        markdown_table(
            ["method", "median s", "gen tok/s", "vs static (paired)"],
            [
                [
                    c["method"],
                    fmt(c["median_s"], ".2f"),
                    fmt(c["tokens_per_s"], ".1f"),
                    fmt(c.get("speedup_vs_static"), ".2f", "×"),
                ]
                for c in result["cases"]
            ],
        )  # fmt: skip
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
