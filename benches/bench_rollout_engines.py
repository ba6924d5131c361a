"""Rollout engines side by side: the embedded HF engine (continuous and static batches), vLLM's
``AsyncLLM`` and ``vllm serve``.

Two workloads, the demo model (SmolLM2-135M-Instruct, float32) on this machine:

``--workload batch``: the same requests on every engine, in one process, one engine after
the other. ``--prompts`` GSM8K test questions (the first ones of
``../shared/data/gsm8k/test.jsonl`` beside the checkout, or ``--gsm8k``, chat-templated with the instruction of
``examples/gsm8k.yaml``) × ``--samples`` samples, every sample its own seed (``sample_seed``) and its own
budget, drawn from a lognormal (median 48, σ = 1, seed 0) capped at 256 and enforced as
``max_new_tokens``; temperature 0.7, top_p 1. The end-of-sequence token stops a sample (the
engines cannot all ignore it), so the mean generated length is reported per engine. Every
request is submitted at t = 0 through the request-level API (``submit``) and collected with
``get_outputs``; one 4-token warm-up request runs before t = 0. Per engine:

- generated tokens / s and the time until the whole batch is done;
- time to first token (TTFT) from t = 0, measured where each engine allows it: ``hf``
  (continuous batches, ``rollout.hf_batching: continuous``), the time the engine sampled the
  request's first token (``GenOutput.first_token_time``); ``hf_static`` (``hf_batching:
  static``), the end of the prefill forward of the ``model.generate`` batch the request ran in
  (a forward hook: the first token is computed then, though the caller receives it only when
  the whole batch ends); ``vllm``, the first streamed ``RequestOutput`` holding a token (the
  engine reads vLLM's stream; the bench only times it); ``vllm_server``, whose replies are not
  streamed, only the mean: the time the request entered the server plus the server's own
  mean TTFT (its ``vllm:time_to_first_token_seconds`` sum / count at ``/metrics``);
- the time until the first request came back to the caller, and how long requests waited
  before entering the engine (``hf_static``: until their ``generate`` batch started).

Ratios ("vs base") are against the first engine of ``--engines`` that ran.

``--workload agent``: the multi-turn agent example (``examples/agent_multiturn.yaml``) through
``areal-fast train`` once per engine, same seed and settings (``--agent-steps`` steps of
``--agent-batch`` prompts × 4 sessions, η = 2, no evaluation); agent sessions finished per
minute of training wall time, from the run's ``metrics.jsonl``.

    python benches/bench_rollout_engines.py --workload batch agent \\
        --json benches/results/rollout_engines_cpu.json
    pytest benches/bench_rollout_engines.py    # pytest-benchmark, tiny batch (needs vLLM)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import REPO_ROOT, base_metadata, eprint, fmt, markdown_table, write_json  # noqa: E402

ENGINES = ("hf_static", "hf", "vllm", "vllm_server")
GSM8K_DEFAULT = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
if not GSM8K_DEFAULT.is_dir():  # a worktree one level deeper
    GSM8K_DEFAULT = REPO_ROOT.parents[1] / "shared" / "data" / "gsm8k"
BUDGET = dict(median=48.0, sigma=1.0, cap=256, seed=0)
TEMPERATURE = 0.7
RUN_SEED = 1
INSTRUCTION = "Think step by step, then give the final answer as a number after '####'."


# ---------------------------------------------------------------------------
# The batch workload
# ---------------------------------------------------------------------------


def build_requests(tokenizer, prompts: int, samples: int, gsm8k: Path):
    """``prompts × samples`` GenRequests (rid = prompt · samples + sample) and their budgets."""
    import numpy as np

    from areal_fast.data.gsm8k import load_gsm8k
    from areal_fast.data.rewards import apply_chat_template, build_prompt_messages
    from areal_fast.rollout.engine import GenRequest, sample_seed

    problems = load_gsm8k(str(gsm8k), "test")[:prompts]
    if len(problems) < prompts:
        raise ValueError(f"{gsm8k}: {len(problems)} test rows, --prompts asks for {prompts}")
    rng = np.random.default_rng(BUDGET["seed"])
    n = prompts * samples
    budgets = np.minimum(
        np.maximum(rng.lognormal(math.log(BUDGET["median"]), BUDGET["sigma"], n).round(), 1),
        BUDGET["cap"],
    ).astype(int)
    requests = []
    for p, problem in enumerate(problems):
        ids = apply_chat_template(tokenizer, build_prompt_messages(problem.question, INSTRUCTION))
        group = sample_seed(RUN_SEED, p)
        for i in range(samples):
            rid = p * samples + i
            requests.append(
                GenRequest(
                    rid=rid,
                    input_ids=list(ids),
                    max_new_tokens=int(budgets[rid]),
                    temperature=TEMPERATURE,
                    top_p=1.0,
                    seed=sample_seed(group, i),
                )
            )
    return requests


class _Clock:
    """Per-request timestamps (seconds after t0), written from engine threads."""

    def __init__(self):
        self.t0 = None
        self.lock = threading.Lock()
        self.entered: dict[int, float] = {}
        self.first_token: dict[int, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 is not None else float("nan")

    def mark(self, table: dict, rid: int) -> None:
        if self.t0 is None:
            return
        with self.lock:
            table.setdefault(rid, self.now())


def _instrument_hf_static(engine, clock: _Clock) -> None:
    """Time each batch's start (entered) and the end of its prefill forward (first token)."""
    pending: list[list[int]] = []
    run = engine._run_requests

    def run_requests(batch):
        for r in batch:
            clock.mark(clock.entered, r.rid)
        pending.append([r.rid for r in batch])
        return run(batch)

    def after_forward(module, args, output):
        if pending:
            for rid in pending.pop():
                clock.mark(clock.first_token, rid)

    engine._run_requests = run_requests
    engine.model.register_forward_hook(after_forward)


def _instrument_loop(engine, clock: _Clock) -> None:
    """Time when a request entered the engine (LoopEngine dispatch)."""
    generate = engine._engine_generate

    async def engine_generate(request, salt):
        clock.mark(clock.entered, request.rid)
        return await generate(request, salt)

    engine._engine_generate = engine_generate


def _instrument_vllm_stream(engine, clock: _Clock) -> None:
    """Time the first streamed output with a token of each request (AsyncLLM.generate)."""
    llm = engine._llm
    generate = llm.generate

    def timed(prompt, params, request_id, *args, **kwargs):
        rid = int(str(request_id).split("-", 1)[0])

        async def stream():
            async for out in generate(prompt, params, request_id, *args, **kwargs):
                if out.outputs and out.outputs[0].token_ids:
                    clock.mark(clock.first_token, rid)
                yield out

        return stream()

    llm.generate = timed


def _server_ttft(url: str) -> tuple[float, int]:
    """(sum, count) of the server's ``vllm:time_to_first_token_seconds`` histogram."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, int(count)


def make_engine(name: str, threads: int, max_running: int, batched_tokens=None):
    """The engine ``name`` (started) on the demo model, float32; ``batched_tokens``: vLLM's
    ``max_num_batched_tokens`` (None: vLLM's default)."""
    from areal_fast.models.loading import demo_model_dir, load_causal_lm, load_tokenizer
    from areal_fast.rollout.config import VLLMConfig

    path = str(demo_model_dir())
    vllm = VLLMConfig(dtype="float32", max_model_len=1024, kv_cache_gib=2, startup_timeout=900)
    if name in ("hf", "hf_static"):
        import torch

        from areal_fast.rollout.hf_engine import HFEngine

        torch.set_num_threads(threads)
        batching = "static" if name == "hf_static" else "continuous"
        engine = HFEngine(
            load_causal_lm(path, "float32"), load_tokenizer(path), max_running, batching
        )
    elif name == "vllm":
        from areal_fast.rollout.vllm_async import AsyncVLLMEngine

        engine = AsyncVLLMEngine(
            path, vllm, max_running=max_running, threads=threads,
            engine_kwargs={"max_num_batched_tokens": batched_tokens} if batched_tokens else None,
        )  # fmt: skip
    elif name == "vllm_server":
        from areal_fast.rollout.vllm_server import VLLMServerEngine

        engine = VLLMServerEngine(
            path, vllm, max_running=max_running, threads=threads,
            extra_args=["--max-num-batched-tokens", str(batched_tokens)] if batched_tokens else None,
        )  # fmt: skip
    else:
        raise ValueError(f"engine {name!r}: expected one of {', '.join(ENGINES)}")
    engine.start()
    return engine


def _quantile(values: list[float], q: float):
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_batch(
    name: str, requests, threads: int, max_running: int, batched_tokens=None, timeout=3600.0
):
    """Every request at t = 0 on engine ``name``; per-request times and the totals."""
    from areal_fast.rollout.engine import GenRequest

    start = time.perf_counter()
    engine = make_engine(name, threads, max_running, batched_tokens)
    startup = time.perf_counter() - start
    clock = _Clock()
    try:
        warm = GenRequest(-1, list(requests[0].input_ids), 4, TEMPERATURE, 1.0, seed=12345)
        engine.submit([warm])
        while not engine.get_outputs(timeout=60.0):
            pass
        if name == "hf_static":
            _instrument_hf_static(engine, clock)
        elif name != "hf":
            _instrument_loop(engine, clock)
        if name == "vllm":
            _instrument_vllm_stream(engine, clock)
        server0 = _server_ttft(engine.server_url) if name == "vllm_server" else None
        done: dict[int, float] = {}
        outputs = {}
        clock.t0, t0_monotonic = time.perf_counter(), time.monotonic()
        engine.submit(list(requests))
        deadline = clock.t0 + timeout
        while len(outputs) < len(requests):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name}: {len(outputs)} of {len(requests)} done in {timeout} s")
            for out in engine.get_outputs(timeout=1.0):
                done[out.rid] = clock.now()
                outputs[out.rid] = out
                if out.first_token_time is not None:  # hf: the engine's own record
                    clock.first_token[out.rid] = out.first_token_time - t0_monotonic
        wall = max(done.values())
        server1 = _server_ttft(engine.server_url) if name == "vllm_server" else None
    finally:
        engine.close()
    tokens = sum(len(o.output_ids) for o in outputs.values())
    rids = [r.rid for r in requests]
    entered = [clock.entered[r] for r in rids if r in clock.entered]
    result = {
        "engine": name,
        "requests": len(requests),
        "startup_s": startup,
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "mean_generated_len": tokens / len(requests),
        "budget_tokens": sum(r.max_new_tokens for r in requests),
        "stop_reasons": {
            k: sum(o.stop_reason == k for o in outputs.values())
            for k in ("stop", "length", "abort")
        },
        "first_done_s": min(done.values()),
        "done_mean_s": statistics.fmean(done.values()),
        "entered_mean_s": statistics.fmean(entered) if entered else None,
        "ttft_mean_s": None,
        "ttft_p50_s": None,
        "ttft_p95_s": None,
        "ttft_how": None,
    }
    if name in ("hf", "hf_static", "vllm"):
        ttft = [clock.first_token[r] for r in rids if r in clock.first_token]
        if len(ttft) != len(rids):
            raise RuntimeError(f"{name}: first-token time of {len(rids) - len(ttft)} requests lost")
        result.update(
            ttft_mean_s=statistics.fmean(ttft),
            ttft_p50_s=_quantile(ttft, 0.50),
            ttft_p95_s=_quantile(ttft, 0.95),
            ttft_how={
                "hf": "the engine's time of the first sampled token",
                "hf_static": "end of the batch's prefill forward",
            }.get(name, "first streamed output with a token"),
        )
    elif server0 is not None and server1[1] > server0[1]:
        n = server1[1] - server0[1]
        server_mean = (server1[0] - server0[0]) / n
        result.update(
            server_ttft_mean_s=server_mean,
            server_ttft_count=n,
            ttft_mean_s=result["entered_mean_s"] + server_mean,
            ttft_how="mean only: entered the server + the server's mean TTFT (/metrics)",
        )
    eprint(json.dumps(result))
    return result


def batch_workload(args) -> dict:
    from areal_fast.models.loading import demo_model_dir, load_tokenizer

    tokenizer = load_tokenizer(str(demo_model_dir()))
    requests = build_requests(tokenizer, args.prompts, args.samples, Path(args.gsm8k))
    budgets = [r.max_new_tokens for r in requests]
    cases = []
    for name in args.engines:
        try:
            cases.append(
                run_batch(name, requests, args.threads, args.max_running, args.vllm_batched_tokens)
            )
        except Exception as exc:  # reported in the table, the other engines still run
            eprint(f"{name}: {type(exc).__name__}: {exc}")
            cases.append({"engine": name, "error": f"{type(exc).__name__}: {exc}"})
    base = next((c for c in cases if "error" not in c), None)
    if base is not None:
        for c in cases:
            if "error" not in c:
                c["base"] = base["engine"]
                c["tokens_per_s_vs_base"] = c["tokens_per_s"] / base["tokens_per_s"]
                c["wall_vs_base"] = c["wall_s"] / base["wall_s"]
                if c["ttft_mean_s"] is not None and base["ttft_mean_s"]:
                    c["ttft_mean_vs_base"] = c["ttft_mean_s"] / base["ttft_mean_s"]
    return {
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "source": f"GSM8K test, first {args.prompts} rows, chat template",
            "instruction": INSTRUCTION,
            "prompt_tokens_mean": statistics.fmean(len(r.input_ids) for r in requests),
            "budget": dict(BUDGET),
            "budget_mean": statistics.fmean(budgets),
            "budget_p50": statistics.median(budgets),
            "budget_max": max(budgets),
            "temperature": TEMPERATURE,
            "max_running": args.max_running,
            "threads": args.threads,
            "vllm_max_num_batched_tokens": args.vllm_batched_tokens,
        },
        "cases": cases,
    }


def batch_table(result: dict) -> str:
    rows = []
    for c in result["cases"]:
        if "error" in c:
            rows.append([c["engine"], f"failed: {c['error'][:200]}"] + [""] * 9)
            continue
        rows.append(
            [
                c["engine"],
                fmt(c["tokens_per_s"], ".1f"),
                fmt(c.get("tokens_per_s_vs_base"), ".2f", "×"),
                fmt(c["wall_s"], ".1f"),
                fmt(c.get("wall_vs_base"), ".2f", "×"),
                fmt(c["ttft_mean_s"], ".2f"),
                fmt(c["ttft_p50_s"], ".2f"),
                fmt(c["ttft_p95_s"], ".2f"),
                fmt(c["first_done_s"], ".2f"),
                fmt(c["mean_generated_len"], ".1f"),
                f"{c['stop_reasons']['stop']}/{c['stop_reasons']['length']}",
            ]
        )
    return markdown_table(
        [
            "engine",
            "gen tok/s",
            "vs base",
            "batch done, s",
            "vs base",
            "TTFT mean, s",
            "TTFT p50, s",
            "TTFT p95, s",
            "first request back, s",
            "mean gen len",
            "EOS/budget stops",
        ],
        rows,
    )


# ---------------------------------------------------------------------------
# The agent workload (areal-fast train on examples/agent_multiturn.yaml)
# ---------------------------------------------------------------------------


def agent_overrides(args) -> list[str]:
    return [
        f"total_steps={args.agent_steps}",
        f"batch_size={args.agent_batch}",
        "eval.before=false",
        "eval.after=false",
        "model.dtype=float32",
        "rollout.vllm.dtype=float32",
        "rollout.vllm.max_model_len=1024",
        "launcher.startup_timeout=900",
    ]


def engine_overrides(engine: str) -> list[str]:
    """The ``rollout.*`` keys that pick ``engine`` (hf_static: the hf engine, static batches)."""
    if engine == "hf_static":
        return ["rollout.engine=hf", "rollout.hf_batching=static"]
    return [f"rollout.engine={engine}"]


def run_agent(engine: str, args, root: Path) -> dict:
    trial = f"agent_{engine}"
    cmd = [
        sys.executable, "-m", "areal_fast.cli", "train",
        "--config", str(REPO_ROOT / "examples" / "agent_multiturn.yaml"),
        "--no-progress", f"fileroot={root}", f"trial_name={trial}", "overwrite=true",
        *agent_overrides(args), *engine_overrides(engine),
    ]  # fmt: skip
    eprint(" ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.agent_timeout)
    command_wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return {"engine": engine, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    run = root / "agent-multiturn" / trial
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    last = steps[-1]
    sessions = last.get("agent/sessions", 0)
    elapsed = last["elapsed_seconds"]
    return {
        "engine": engine,
        "steps": len(steps),
        "sessions_finished": sessions,
        "sessions_dropped": last.get("agent/sessions_dropped", 0),
        "model_calls": last.get("agent/model_calls", 0),
        "train_wall_s": elapsed,
        "command_wall_s": command_wall,
        "sessions_per_min": sessions / (elapsed / 60),
        "step_seconds": [s["step_seconds"] for s in steps],
        "reward_mean": [s["reward_mean"] for s in steps],
        "gen_tokens_per_s_cumulative": last.get("gen_tokens_per_s_cumulative"),
        "rollouts_trained": summary.get("rollouts_trained"),
        "rollout_threads": summary.get("rollout_threads"),
        "trainer_threads": summary.get("trainer_threads"),
    }


def agent_workload(args) -> dict:
    root = Path(args.run_root or tempfile.mkdtemp(prefix="areal_fast_bench_agent_"))
    cases = [run_agent(e, args, root) for e in args.agent_engines]
    eprint(json.dumps(cases))
    base = next((c for c in cases if "error" not in c), None)
    for c in cases:
        if base is not None and "error" not in c:
            c["base"] = base["engine"]
            c["sessions_per_min_vs_base"] = c["sessions_per_min"] / base["sessions_per_min"]
    return {
        "config": "examples/agent_multiturn.yaml",
        "overrides": agent_overrides(args),
        "cases": cases,
    }


def agent_table(result: dict) -> str:
    rows = []
    for c in result["cases"]:
        if "error" in c:
            rows.append([c["engine"], f"failed: {c['error'][:200]}"] + [""] * 5)
            continue
        rows.append(
            [
                c["engine"],
                c["steps"],
                c["sessions_finished"],
                fmt(c["train_wall_s"], ".0f"),
                fmt(c["sessions_per_min"], ".1f"),
                fmt(c.get("sessions_per_min_vs_base"), ".2f", "×"),
                fmt(c["model_calls"] / max(c["sessions_finished"], 1), ".2f"),
            ]
        )
    return markdown_table(
        [
            "engine",
            "steps",
            "sessions finished",
            "train wall, s",
            "sessions / min",
            "vs base",
            "model calls / session",
        ],
        rows,
    )


# ---------------------------------------------------------------------------
# pytest-benchmark (4 prompts × 2 samples on each engine; vllm skipped without vLLM)
# ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # script mode without pytest installed
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("engine", ["hf_static", "hf", "vllm"])
    def test_tiny_batch(benchmark, engine):
        if engine == "vllm":
            pytest.importorskip("vllm")
        if not GSM8K_DEFAULT.is_dir():
            pytest.skip(f"GSM8K data not found at {GSM8K_DEFAULT}")
        from areal_fast.models.loading import demo_model_dir, load_tokenizer

        requests = build_requests(load_tokenizer(str(demo_model_dir())), 4, 2, GSM8K_DEFAULT)
        for r in requests:
            r.max_new_tokens = min(r.max_new_tokens, 16)
        case = benchmark.pedantic(
            run_batch,
            args=(engine, requests, os.cpu_count() or 1, 8),
            rounds=1,
            iterations=1,
            warmup_rounds=0,
        )
        assert case["stop_reasons"]["abort"] == 0
        assert 0 < case["generated_tokens"] <= sum(r.max_new_tokens for r in requests)
        assert 0 < case["ttft_mean_s"] <= case["wall_s"]
        benchmark.extra_info.update(tokens_per_s=case["tokens_per_s"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", nargs="+", choices=("batch", "agent"), default=["batch", "agent"]
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-running", type=int, default=64, help="hf max_batch_size, "
                        "vllm / vllm_server max_running")  # fmt: skip
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (hf) and vLLM CPU threads; default: all cores")  # fmt: skip
    parser.add_argument(
        "--vllm-batched-tokens",
        type=int,
        help="vLLM max_num_batched_tokens (default: the engines' own; on a CPU they turn "
        "chunked prefill off, see areal_fast.rollout.vllm_async.cpu_scheduling)",
    )
    parser.add_argument("--gsm8k", default=str(GSM8K_DEFAULT), help="folder with test.jsonl")
    parser.add_argument(
        "--agent-engines", nargs="+", choices=ENGINES, default=["hf_static", "hf", "vllm"]
    )
    parser.add_argument("--agent-steps", type=int, default=2)
    parser.add_argument("--agent-batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--agent-timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--run-root", help="agent: where the run directories go")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    for key in ("prompts", "samples", "max_running", "threads", "agent_steps", "agent_batch"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    result = {"meta": base_metadata(args.threads)}
    try:
        import vllm

        result["meta"]["vllm"] = vllm.__version__
    except ImportError:
        result["meta"]["vllm"] = None
    if "batch" in args.workload:
        result["batch"] = batch_workload(args)
        write_json(args.json, result)
        print(batch_table(result["batch"]), flush=True)
    if "agent" in args.workload:
        result["agent"] = agent_workload(args)
        write_json(args.json, result)
        print(agent_table(result["agent"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
