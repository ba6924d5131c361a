"""Does storing trajectories stall the rollout loop? Writer on vs off, on real sessions.

A rollout worker's loop does the same work for every finished agent group: hand each session
to the trajectory store (``put``), export the finished sessions as trajectories and pack them
into the shard that the trainer fetches (``AgentWorkload.finish`` plus ``shard_tensors``).
This benchmark replays recorded sessions (a run's ``trajectories/`` directory, e.g. from
``examples/agent_multiturn.yaml``) through exactly that path, one group every ``--pace-ms``
(a busy worker's rate), with the store off and on (zstd level 3, 4 writer threads, the
default cache), in alternating rounds. It reports the loop's time per group (median, p99,
max) in both modes, their difference, the time ``put`` spent waiting for a full cache, and
the compression ratio of what was written.

    python benches/bench_agent_store_stall.py --input runs/.../trajectories [--json OUT]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import write_json  # noqa: E402

from areal_fast.agent.session import Session  # noqa: E402
from areal_fast.agent.store import TrajectoryConfig, TrajectoryWriter, read_trajectories  # noqa: E402
from areal_fast.wire.shard_io import shard_tensors  # noqa: E402


def groups_of(sessions: list[Session], size: int) -> list[list[Session]]:
    """Consecutive groups of ``size`` sessions."""
    return [sessions[i : i + size] for i in range(0, len(sessions) - size + 1, size)]


def loop_once(group: list[Session], writer) -> float:
    """Seconds the worker's loop spends on one finished group (the path of
    AgentWorkload.finish + shard_tensors)."""
    start = time.perf_counter()
    trajectories = []
    for session in group:
        if writer is not None:
            writer.put(session.to_dict())
        if session.status == "done":
            trajectories += session.export("concat", 1.0)
    if trajectories:
        shard_tensors(trajectories)
    return time.perf_counter() - start


def run(groups, writer, pace_s: float) -> list[float]:
    """Per-group loop seconds, one group every ``pace_s``."""
    times = []
    next_at = time.perf_counter()
    for group in groups:
        times.append(loop_once(group, writer))
        next_at += pace_s
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return times


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "max_ms": 1e3 * ordered[-1],
        "total_s": sum(ordered),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a run's trajectories/ directory")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--pace-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=4, help="replay the sessions this often")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sessions = [Session.from_dict(r) for r in read_trajectories(args.input)] * args.repeat
    groups = groups_of(sessions, args.group_size)
    if not groups:
        raise SystemExit(f"{args.input} holds fewer than {args.group_size} sessions")
    off, on, stall, raw, stored = [], [], 0.0, 0, 0
    for _ in range(args.rounds):
        off += run(groups, None, args.pace_ms / 1e3)
        with tempfile.TemporaryDirectory() as tmp:
            writer = TrajectoryWriter(Path(tmp), TrajectoryConfig(), name="bench")
            on += run(groups, writer, args.pace_ms / 1e3)
            writer.close()
            stall += writer.stats.stall_seconds
            raw += writer.stats.raw_bytes
            stored += writer.stats.stored_bytes
    result = {
        "sessions": len(sessions) // args.repeat,
        "groups_per_round": len(groups),
        "rounds": args.rounds,
        "pace_ms": args.pace_ms,
        "off": summary(off),
        "on": summary(on),
        "put_stall_seconds": stall,
        "compression_ratio": raw / stored,
        "raw_bytes_per_session": raw / (args.rounds * len(sessions)),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    extra = result["on"]["median_ms"] - result["off"]["median_ms"]
    print("| store | median ms/group | p99 ms | max ms |\n|---|---|---|---|")
    for mode in ("off", "on"):
        r = result[mode]
        print(f"| {mode} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} |")
    print(
        f"\nstore on adds {extra:.3f} ms per group (median); put waited {stall:.4f} s in "
        f"all; compression {result['compression_ratio']:.2f}x"
    )
    write_json(args.json, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
