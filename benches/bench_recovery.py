"""Recovery time on the demo model (SmolLM2-135M, CPU): kill workers of a running job.

Runs ``areal-fast train`` (or the Ray launcher) on examples/arith.yaml with a few small
steps and checkpoints, then:

* kills rollout worker ``rollout-0`` with SIGKILL after the first step and reads the
  controller's ``rollout_recovery_seconds`` (death noticed → new worker started, model
  loaded, current weights loaded: generation resumed);
* optionally (``--trainer``) kills the trainer after the first checkpoint and measures the
  wall time from the kill to the resumed run's next step in ``metrics.jsonl``.

    python benches/bench_recovery.py [--launcher local|ray] [--trainer] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benches"))
from _harness import base_metadata, write_json  # noqa: E402


def _args(root: Path, trial: str, launcher: str) -> list[str]:
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"fileroot={root}",
        f"trial_name={trial}",
        "total_steps=4",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=16",
        "eval.before=false",
        "eval.after=false",
        "checkpoint.every_steps=1",
        "rollout.max_head_offpolicyness=1",
    ]
    if launcher == "ray":
        args += ["scheduler.cpus_per_rollout_worker=0.5", "scheduler.cpus_per_trainer_rank=0.5"]
    return args


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _run(root: Path, trial: str, launcher: str, victim: str, need_checkpoint: bool) -> dict:
    run_dir = root / "grpo-arith" / trial
    module = "areal_fast.launch.ray" if launcher == "ray" else "areal_fast.cli"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *_args(root, trial, launcher)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while _steps(run_dir) < 1 or (
        need_checkpoint and not list((run_dir / "checkpoints").glob("step-*"))
    ):
        if proc.poll() is not None:
            raise SystemExit(proc.stdout.read()[-3000:])
        time.sleep(0.05)
    steps_before = _steps(run_dir)
    pid = json.loads((run_dir / "workers.json").read_text())[victim]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    next_step = None
    while proc.poll() is None:
        if next_step is None and _steps(run_dir) > steps_before:
            next_step = time.monotonic() - killed
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(out[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "victim": victim,
        "launcher": launcher,
        "rollout_recovery_seconds": summary["rollout_recovery_seconds"],
        "trainer_restarts": summary["trainer_restarts"],
        "resumed_from_version": summary.get("resumed_from_version"),
        "kill_to_next_step_seconds": next_step,
        "rollouts_trained": summary["rollouts_trained"],
        "rollouts_dropped": summary["rollouts_dropped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=("local", "ray"), default="local")
    parser.add_argument("--trainer", action="store_true", help="also kill the trainer")
    parser.add_argument("--json", default=str(REPO / "benches" / "results" / "recovery_cpu.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        results.append(_run(Path(tmp), "rollout", args.launcher, "rollout-0", False))
        print(json.dumps(results[-1]))
        if args.trainer:
            results.append(_run(Path(tmp), "trainer", args.launcher, "trainer", True))
            print(json.dumps(results[-1]))
    write_json(args.json, {**base_metadata(), "results": results})
    print("victim | launcher | death -> generation resumed (s) | kill -> next step (s)")
    for r in results:
        rec = r["rollout_recovery_seconds"]
        print(
            f"{r['victim']} | {r['launcher']} | {rec[0] if rec else '-'} | "
            f"{r['kill_to_next_step_seconds']}"
        )


if __name__ == "__main__":
    main()
