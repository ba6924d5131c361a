"""Asynchronous vs synchronous RL throughput of the real controller.

``--real`` trains the demo model on this machine's CPU through ``areal-fast train`` once per
η (same seed, same number of trained samples) and reports effective trained tokens/s and
held-out accuracy against wall-clock minutes.

``--simulated`` drives :class:`~areal_fast.controller.async_loop.AsyncController` (the code
of real runs) with stand-in engines and a stand-in trainer on a fixed workload, so numbers are
comparable across versions:

- 4 rollout workers, 32 concurrent sequences each, every sequence decoding at 1 token/ms;
- 32 prompts × 4 samples per step, 20 steps; completion lengths lognormal (median 512,
  σ = 0.8, capped at 4096), seeded;
- trainer time 14 µs per trained (completion) token.

All times may be scaled down uniformly with ``--time-scale`` (throughputs are reported in
unscaled tokens/s). Output fields: ``throughput_ratio_async_vs_sync`` (trained tokens/s at
η = 4 over η = 0, same number of trained samples), ``async_efficiency_vs_bound`` (η = 4 over
min(generation capacity, trainer capacity)) and ``controller_overhead_ms_per_trajectory``
(controller CPU time per finished trajectory with 10 000 rollouts in flight). With ``--modes
default reproducible`` every η also runs under ``rollout.reproducible`` (each worker generates
its groups of a version as one submission and takes the next version once all have
finished), and ``reproducible_vs_default`` gives the throughput ratio per η.

    python benches/bench_async.py --simulated --json benches/results/async_simulated.json
    python benches/bench_async.py --simulated --etas 2 4 --modes default reproducible \
        --json benches/results/async_simulated_reproducible.json
    python benches/bench_async.py --real --json benches/results/async_real_cpu.json
    pytest benches/bench_async.py    # pytest-benchmark, small simulated workload
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_metadata, eprint, fmt, markdown_table  # noqa: E402

from areal_fast.controller.async_loop import AsyncController, RunPlan  # noqa: E402
from areal_fast.launch.cluster import ClusterSpec, LocalCluster  # noqa: E402
from areal_fast.rollout.config import RolloutConfig  # noqa: E402
from areal_fast.rollout.engine import SamplingParams, sample_seed  # noqa: E402
from areal_fast.rollout.simulated import (  # noqa: E402
    SimulatedEngineConfig,
    SimulatedEngineFactory,
    sim_reward,
)
from areal_fast.train.simulated import SimulatedTrainerFactory  # noqa: E402
from areal_fast.wire.messages import GroupRequest  # noqa: E402
from areal_fast.workers.rollout_worker import RolloutWorkerSpec  # noqa: E402
from areal_fast.workers.trainer_worker import TrainerWorkerSpec  # noqa: E402

WORKLOAD = dict(
    workers=4,
    seqs_per_worker=32,
    token_ms=1.0,
    prompts=32,
    group_size=4,
    steps=20,
    median=512.0,
    sigma=0.8,
    cap=4096,
    train_us_per_token=14.0,
    prompt_len=16,
)


def _cluster(scale: float, max_running: int, w: dict, slots: int = 2) -> ClusterSpec:
    engine = SimulatedEngineConfig(
        token_seconds=w["token_ms"] * 1e-3 * scale,
        max_running=max_running,
        median_length=w["median"],
        sigma=w["sigma"],
        max_length=w["cap"],
    )
    return ClusterSpec(
        rollout=RolloutWorkerSpec(SimulatedEngineFactory(engine), sim_reward, threads=1),
        trainer=TrainerWorkerSpec(
            SimulatedTrainerFactory(w["train_us_per_token"] * 1e-6 * scale), threads=1, slots=slots
        ),
        num_rollout_workers=w["workers"],
    )


def _requests(seed: int, w: dict):
    params = SamplingParams(n=w["group_size"], temperature=1.0, max_new_tokens=w["cap"])

    def next_request(group_id: int) -> GroupRequest:
        return GroupRequest(group_id, [1] * w["prompt_len"], params, sample_seed(seed, group_id))

    return next_request


def run_case(
    eta: int,
    scale: float,
    seed: int,
    w: dict,
    max_concurrent: int,
    max_running: int,
    steps: int,
    reproducible: bool = False,
) -> dict:
    """One controller run; throughput in unscaled trained tokens per second. With
    ``reproducible`` the run follows ``rollout.reproducible`` (its fixed plan: no
    ``max_concurrent`` bound, each worker its groups of a version at once)."""
    records: list[dict] = []
    plan = RunPlan(total_steps=steps, batch_size=w["prompts"])
    rollout = RolloutConfig(
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=None if reproducible else max_concurrent,
        reproducible=reproducible,
    )
    with LocalCluster(_cluster(scale, max_running, w, rollout.weight_slots)) as cluster:
        controller = AsyncController(
            cluster.rollout_workers,
            cluster.trainer,
            cluster.weight_buffers,
            _requests(seed, w),
            plan,
            rollout,
            records.append,
        )
        cpu0, wall0 = time.process_time(), time.perf_counter()
        counts = controller.run()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    trained = sum(r["trained_tokens"] for r in records)
    elapsed = records[-1]["elapsed_seconds"]
    finished = counts.submitted - counts.dropped.get("in_flight_at_end", 0)
    trajectories = finished * w["group_size"]
    return {
        "eta": eta,
        "mode": "reproducible" if reproducible else "default",
        "steps": steps,
        "trained_samples": counts.trained * w["group_size"],
        "trained_tokens": trained,
        "elapsed_s_scaled": elapsed,
        "trained_tokens_per_s": trained / elapsed * scale,
        "controller_cpu_s": cpu,
        "wall_s": wall,
        "finished_trajectories": trajectories,
        "controller_cpu_ms_per_trajectory": 1e3 * cpu / max(trajectories, 1),
        "staleness_max": max(r.get("staleness_max", 0.0) for r in records),
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in records) / len(records),
        "interruptions": counts.interruptions,
        "counts": counts.as_dict(),
    }


def simulated(args) -> dict:
    w = dict(WORKLOAD, steps=args.steps)
    slots = w["workers"] * w["seqs_per_worker"]
    # 64 prompt groups (256 sequences) in flight for 128 decode slots: a group holds its
    # place until its slowest sample ends, so the engines need queued samples to stay full
    groups_in_flight = 2 * slots // w["group_size"]
    cases = [
        run_case(
            eta,
            args.time_scale,
            args.seed,
            w,
            groups_in_flight,
            w["seqs_per_worker"],
            w["steps"],
            mode == "reproducible",
        )
        for mode in args.modes
        for eta in args.etas
    ]
    eprint(json.dumps(cases, indent=1))
    gen_capacity = slots / (w["token_ms"] * 1e-3)
    train_capacity = 1.0 / (w["train_us_per_token"] * 1e-6)
    bound = min(gen_capacity, train_capacity)
    by_eta = {c["eta"]: c for c in cases if c["mode"] == "default"}
    fixed = {c["eta"]: c for c in cases if c["mode"] == "reproducible"}
    # controller overhead: 10 000 rollouts in flight. B = 1000 prompt groups per step and
    # η = 9 allow (9 + 0 + 1) · 1000 = 10 000 at once; the engines take all of them (no
    # queueing) and the trainer takes no time, so the controller is as busy as it can be.
    overhead_w = dict(w, prompts=1000, median=128.0, cap=512, train_us_per_token=0.0)
    overhead = run_case(
        9, args.time_scale, args.seed + 1, overhead_w, 10_000, 10_000, args.overhead_steps
    )
    result = {
        "workload": w,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "generation_capacity_tokens_per_s": gen_capacity,
        "trainer_capacity_tokens_per_s": train_capacity,
        "pipelined_bound_tokens_per_s": bound,
        "cases": cases,
        "overhead_case": overhead,
        "controller_overhead_ms_per_trajectory": overhead["controller_cpu_ms_per_trajectory"],
        "meta": base_metadata(),
    }
    if 0 in by_eta and 4 in by_eta:
        result["throughput_ratio_async_vs_sync"] = (
            by_eta[4]["trained_tokens_per_s"] / by_eta[0]["trained_tokens_per_s"]
        )
        result["async_efficiency_vs_bound"] = by_eta[4]["trained_tokens_per_s"] / bound
    result["reproducible_vs_default"] = {  # throughput ratio at each η run in both modes
        str(eta): fixed[eta]["trained_tokens_per_s"] / by_eta[eta]["trained_tokens_per_s"]
        for eta in fixed
        if eta in by_eta
    }
    return result


def table(result: dict) -> str:
    rows = [
        [
            c["eta"],
            c.get("mode", "default"),
            c["trained_samples"],
            fmt(c["trained_tokens_per_s"], ",.0f"),
            fmt(c["trained_tokens_per_s"] / result["pipelined_bound_tokens_per_s"], ".3f"),
            fmt(c["staleness_mean"], ".2f"),
            fmt(c["staleness_max"], ".0f"),
            c["interruptions"],
        ]
        for c in result["cases"]
    ]
    text = markdown_table(
        [
            "η",
            "mode",
            "trained samples",
            "trained tok/s",
            "of bound",
            "staleness mean",
            "staleness max",
            "interruptions",
        ],
        rows,
    )
    extra = [
        f"pipelined bound {result['pipelined_bound_tokens_per_s']:,.0f} tok/s; "
        f"controller overhead {result['controller_overhead_ms_per_trajectory']:.4f} ms "
        f"per trajectory (10 000 rollouts in flight)"
    ]
    if "throughput_ratio_async_vs_sync" in result:
        extra.append(
            f"throughput_ratio_async_vs_sync = "
            f"{result['throughput_ratio_async_vs_sync']:.2f}, async_efficiency_vs_bound"
            f" = {result['async_efficiency_vs_bound']:.3f}"
        )
    for eta, ratio in result.get("reproducible_vs_default", {}).items():
        extra.append(f"η = {eta}: reproducible / default throughput = {ratio:.3f}")
    return text + "\n\n" + "\n".join(extra)


REAL_OVERRIDES = ["total_steps=8", "batch_size=8", "data.eval_size=100"]


def real(args) -> dict:
    """One ``areal-fast train`` run per η on the demo model (CPU), in fresh processes."""
    from omegaconf import OmegaConf

    cases = []
    root = Path(args.run_root or tempfile.mkdtemp(prefix="areal_fast_bench_"))
    for eta in args.etas:
        trial = f"eta{eta}"
        cmd = [
            sys.executable,
            "-m",
            "areal_fast.cli",
            "train",
            "--config",
            str(Path(__file__).resolve().parent.parent / "examples" / "arith.yaml"),
            "--no-progress",
            f"fileroot={root}",
            f"trial_name={trial}",
            "overwrite=true",
            f"seed={args.seed + 1}",
            f"rollout.max_head_offpolicyness={eta}",
            *REAL_OVERRIDES,
            *args.override,
        ]
        eprint(" ".join(cmd))
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        run = root / "grpo-arith" / trial
        summary = json.loads((run / "summary.json").read_text())
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        train_s = steps[-1]["elapsed_seconds"]
        gain = summary["eval_after"] - summary["eval_before"]
        group_size = OmegaConf.load(run / "config.yaml").rollout.group_size
        cases.append(
            {
                "eta": eta,
                "trained_samples": summary["rollouts_trained"] * group_size,
                "trained_tokens": sum(r["trained_tokens"] for r in steps),
                "train_wall_s": train_s,
                "command_wall_s": wall,
                "trained_tokens_per_s": sum(r["trained_tokens"] for r in steps) / train_s,
                "eval_before": summary["eval_before"],
                "eval_after": summary["eval_after"],
                "accuracy_gain_per_train_minute": gain / (train_s / 60),
                "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in steps) / len(steps),
                "staleness_max": max(r.get("staleness_max", 0.0) for r in steps),
                "interruptions": summary["sample_interruptions"],
                "trainer_threads": summary["trainer_threads"],
                "rollout_threads": summary["rollout_threads"],
                "reward_mean_last": steps[-1]["reward_mean"],
                "counts": {
                    k: summary[k]
                    for k in ("rollouts_submitted", "rollouts_trained", "rollouts_dropped")
                },
            }
        )
    return {
        "mode": "real",
        "overrides": REAL_OVERRIDES + args.override,
        "cases": cases,
        "meta": base_metadata(),
    }


def real_table(result: dict) -> str:
    """Markdown table of a ``--real`` result."""
    rows = [
        [
            c["eta"],
            c["trained_samples"],
            fmt(c["train_wall_s"] / 60, ".2f"),
            fmt(c["trained_tokens_per_s"], ".1f"),
            fmt(c["eval_before"], ".3f"),
            fmt(c["eval_after"], ".3f"),
            fmt(c["accuracy_gain_per_train_minute"], "+.4f"),
            fmt(c["staleness_mean"], ".2f"),
            c["interruptions"],
        ]
        for c in result["cases"]
    ]
    return markdown_table(
        [
            "η",
            "trained samples",
            "train minutes",
            "trained tok/s",
            "held-out before",
            "after",
            "gain per minute",
            "staleness mean",
            "interruptions",
        ],
        rows,
    )


# ---------------------------------------------------------------------------
# pytest-benchmark (the simulated workload, time scaled down 20x, 6 steps)
# ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # script mode without pytest installed
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("eta", [0, 4])
    def test_simulated_controller(benchmark, eta):
        w = dict(WORKLOAD, steps=6)
        slots = w["workers"] * w["seqs_per_worker"]
        case = benchmark.pedantic(
            run_case,
            args=(eta, 0.05, 0, w, 2 * slots // w["group_size"], w["seqs_per_worker"], w["steps"]),
            rounds=1,
            iterations=1,
            warmup_rounds=0,
        )
        assert case["staleness_max"] <= eta
        assert case["trained_samples"] == w["steps"] * w["prompts"] * w["group_size"]
        benchmark.extra_info.update(trained_tokens_per_s=case["trained_tokens_per_s"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--simulated",
        action="store_true",
        help="stand-in engines and trainer on the fixed workload",
    )
    mode.add_argument(
        "--real",
        action="store_true",
        help="the demo model on this CPU through areal-fast train, once per η",
    )
    parser.add_argument("--run-root", help="--real: where the run directories go")
    parser.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="--real: extra key=value config overrides for every run",
    )
    parser.add_argument("--json", help="write the result here")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every simulated duration by this (≤ 1 runs faster)",
    )
    parser.add_argument("--steps", type=int, default=WORKLOAD["steps"])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["default", "reproducible"],
        default=["default"],
        help="--simulated: run every η in these modes (reproducible: rollout.reproducible)",
    )
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=12,
        help="steps of the 10 000-rollouts-in-flight overhead case (B = 1000)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.time_scale > 0:
        parser.error("--time-scale must be > 0")
    result = simulated(args) if args.simulated else real(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result) if args.simulated else real_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
