"""Controller scalability: the single controller's cost as the number of rollout workers grows.

Drives the real :class:`~areal_fast.controller.async_loop.AsyncController` with stand-in
rollout workers and a stand-in trainer that are not engines: they live in one (``--helpers``)
forked helper process, so their CPU is not charged to the controller. Every stand-in worker
has its own duplex ``multiprocessing.Pipe``; the controller's end is a
:class:`~areal_fast.wire.codec.MessageChannel` inside a :class:`WorkerHandle` subclass,
so the controller encodes, decodes and waits exactly as in a real run. Each handle's
``sentinel`` is its own ``dup`` of the helper's process sentinel, so ``wait_messages`` waits
on two descriptors per worker, as with one process per worker.

The stand-ins send the bytes of production messages: the helper builds each reply as the
plain msgpack map that :func:`~areal_fast.wire.codec.encode_message` writes
(checked byte for byte at start-up) and reads requests with plain ``msgpack.unpackb``, which
keeps the helper at a fraction of the controller's CPU.

- Rollout worker: ``WorkerReady`` first; ``SubmitGroups`` → one ``GroupDone`` per group after
  a generation delay (lognormal, median ``--delay-ms``, σ = 0.25, seeded per worker; 0 = at
  once), with a realistic ``ShardMetadata`` (8 ``TensorMetadata`` fields, group of 4,
  ~100-token prompt + lognormal completions of median 200 tokens, varied rewards);
  ``UpdateWeights`` → ``WeightsUpdated``; ``DropShards`` silently; ``CancelAll`` →
  ``Cancelled(n)``; ``Shutdown`` closes its end.
- Trainer: ``WorkerReady`` with two dummy ``WeightBufferSpec`` slots; ``TrainStep`` →
  ``StepDone(version + 1, group_ids = the batch's shard ids)`` after ``--train-ms``.

Settings per size W: B = max(16, W) groups per step (every worker has work), η = 2,
max_concurrent_rollouts = (η + 1) · B (the staleness bound is the only limit). Two loads:

- saturated (``--delay-ms``, default 1 and 0 ms): the stand-ins answer far faster than the
  controller can go, so groups/s is the controller's own limit;
- paced (``--paced-rate``, default 1000 groups/s): the delay is (η + 1) · B / rate, so the
  stand-ins' latency sets the pace and messages arrive a few at a time, as in real runs;
  this shows the controller's cost per loop turn rather than per message.

Wall time and ``time.process_time()`` of the controller process are taken around
``controller.run()`` (wind-down included); "waiting for a CPU" is the time the controller
was runnable but not running (``/proc/thread-self/schedstat``: other load on the machine);
the helper's CPU comes from ``getrusage(RUSAGE_CHILDREN)``. ``--profile W`` also runs W
workers under cProfile (CPU clock) and sums the controller's own time by category.

    python benches/bench_controller.py --profile 512   # 8 64 512 workers, ~1.5 min on 2 cores
    python benches/bench_controller.py --small --json /tmp/c.json    # CI, < 20 s
    pytest benches/bench_controller.py                  # pytest-benchmark, 8 and 64 workers
"""

from __future__ import annotations

import argparse
import cProfile
import heapq
import io
import math
import multiprocessing as mp
import os
import pstats
import random
import resource
import selectors
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack  # noqa: E402
from _harness import REPO_ROOT, base_metadata, eprint, fmt, markdown_table, write_json  # noqa: E402

from areal_fast.controller.async_loop import AsyncController, RunPlan  # noqa: E402
from areal_fast.rollout.config import RolloutConfig  # noqa: E402
from areal_fast.rollout.engine import SamplingParams  # noqa: E402
from areal_fast.sync.shared_memory import WeightBufferSpec, WeightEntry  # noqa: E402
from areal_fast.wire import messages as msg  # noqa: E402
from areal_fast.wire.codec import MessageChannel, encode_message  # noqa: E402
from areal_fast.wire.handles import ProcessHandle  # noqa: E402
from areal_fast.wire.shards import ShardMetadata, TensorMetadata  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benches" / "results" / "controller_scaling_cpu.json"
ETA = 2
GROUP_SIZE = 4
PROMPT_LEN = 100  # tokens, ± 10
COMPLETION_MEDIAN, COMPLETION_SIGMA, COMPLETION_CAP = 200.0, 0.5, 512
DELAY_SIGMA = 0.25
TOKEN_FIELDS = (
    ("input_ids", "int64"),
    ("labels", "int64"),
    ("loss_mask", "bool"),
    ("behav_logprobs", "float32"),
    ("versions", "int32"),
)
SEQ_FIELDS = (("seq_lens", "int64"), ("rewards", "float32"), ("group_ids", "int64"))


# ---------------------------------------------------------------------------
# Wire templates: plain maps whose msgpack bytes equal encode_message's
# ---------------------------------------------------------------------------


def _unpack(data: bytes) -> dict:
    """A message as the plain map it travels as (no dataclasses built)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _as_map(message) -> dict:
    return _unpack(encode_message(message))


def _pack(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def _sample_group_done(
    name: str, group_id: int, prompt_len: int, lengths: list[int], rewards: list[float]
) -> msg.GroupDone:
    """The production dataclass of one finished group (used to check the templates)."""
    tokens = sum(prompt_len + n for n in lengths)
    fields = {k: TensorMetadata((tokens,), d) for k, d in TOKEN_FIELDS}
    fields.update({k: TensorMetadata((len(lengths),), d) for k, d in SEQ_FIELDS})
    shard = ShardMetadata(name, "127.0.0.1:40000", group_id, len(lengths), 0, fields)
    return msg.GroupDone(
        shard,
        group_id,
        rewards,
        lengths,
        ["length" if n >= COMPLETION_CAP else "stop" for n in lengths],
        0,
    )


def _fill_group_done(
    template: dict, group_id: int, prompt_len: int, lengths: list[int], rewards: list[float]
) -> dict:
    """``template`` (a GroupDone map) rewritten in place for one group."""
    tokens = sum(prompt_len + n for n in lengths)
    shard = template["shard"]
    shard["shard_id"] = template["group_id"] = group_id
    shard["batch_size"] = len(lengths)
    for name, _ in TOKEN_FIELDS:
        shard["fields"][name]["shape"] = [tokens]
    for name, _ in SEQ_FIELDS:
        shard["fields"][name]["shape"] = [len(lengths)]
    template["rewards"], template["completion_lengths"] = rewards, lengths
    template["stop_reasons"] = ["length" if n >= COMPLETION_CAP else "stop" for n in lengths]
    return template


def check_templates() -> None:
    """The helper's fast path sends exactly encode_message's bytes (asserted once)."""
    lengths, rewards = [201, 512, 17, 300], [1.0, 0.0, 0.0, 1.0]
    template = _as_map(_sample_group_done("rollout-0", 0, 1, [1], [0.5]))
    fast = _pack(_fill_group_done(template, 123456, 97, lengths, rewards))
    assert fast == encode_message(_sample_group_done("rollout-0", 123456, 97, lengths, rewards))
    step = _as_map(msg.StepDone(1, {"loss": 0.0}, [0], 0))
    step.update(version=7, stats={"loss": 0.25}, group_ids=[3, 4], trained_tokens=999)
    assert _pack(step) == encode_message(msg.StepDone(7, {"loss": 0.25}, [3, 4], 999))
    ack = _as_map(msg.WeightsUpdated(0, 0.0))
    ack["version"] = 5
    assert _pack(ack) == encode_message(msg.WeightsUpdated(5, 0.0))


def dummy_weight_buffers() -> tuple[WeightBufferSpec, WeightBufferSpec]:
    """Two weight slots that nobody maps (the controller only forwards them)."""
    entries = (
        WeightEntry("model.embed_tokens.weight", (49152, 576), "bfloat16", 0, 49152 * 576 * 2),
        WeightEntry("model.norm.weight", (576,), "bfloat16", 56623104, 1152),
    )
    return tuple(
        WeightBufferSpec(f"/dev/shm/bench-controller-slot{i}", 56624384, entries) for i in range(2)
    )


# ---------------------------------------------------------------------------
# The helper process: every stand-in worker and the stand-in trainer
# ---------------------------------------------------------------------------


class _StandIn:
    """State of one stand-in endpoint inside the helper."""

    def __init__(self, name: str, conn: MessageChannel, kind: str, seed: int):
        self.name, self.conn, self.kind = name, conn, kind
        self.rng = random.Random(seed)
        self.pending: set[int] = set()  # rollout: groups not yet reported
        self.done_map: dict | None = None
        self.ack_map = _as_map(msg.WeightsUpdated(0, 0.0))
        self.version = 0  # trainer: last version reported
        self.busy_until = 0.0  # trainer: end of the step in progress
        self.step_map: dict | None = None


def _group_reply(w: _StandIn, group_id: int, prompt_len: int) -> bytes:
    rng = w.rng
    lengths = [
        min(
            COMPLETION_CAP,
            max(1, int(rng.lognormvariate(math.log(COMPLETION_MEDIAN), COMPLETION_SIGMA))),
        )
        for _ in range(GROUP_SIZE)
    ]
    rewards = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(GROUP_SIZE - 2)]
    rng.shuffle(rewards)
    return _pack(_fill_group_done(w.done_map, group_id, prompt_len, lengths, rewards))


def _helper_main(
    own: list[tuple[str, object, str]], close: list, delay_s: float, train_s: float, seed: int
) -> None:
    """Serve the stand-ins in ``own`` (name, raw Connection, "rollout"|"trainer") until each
    got Shutdown or lost its controller; ``close`` are inherited descriptors to drop."""
    for conn in close:
        conn.close()
    selector = selectors.DefaultSelector()  # epoll: registered once, O(ready) per call
    heap: list[tuple[float, int, str, int, object]] = []  # (due, seq, kind, id, endpoint)
    seq = 0
    for i, (name, raw, kind) in enumerate(own):
        w = _StandIn(name, MessageChannel(raw), kind, seed * 1_000_003 + i)
        if kind == "rollout":
            w.done_map = _as_map(_sample_group_done(name, 0, 1, [1], [0.5]))
            w.conn.send(msg.WorkerReady(name, "127.0.0.1:40000"))
        else:
            w.step_map = _as_map(msg.StepDone(1, {"loss": 0.0}, [0], 0))
            w.conn.send(msg.WorkerReady(name, weight_buffers=dummy_weight_buffers()))
        selector.register(w.conn.fileno(), selectors.EVENT_READ, w)
    live = len(own)

    def schedule(due: float, kind: str, ident: int, w: _StandIn, payload=None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (due, seq, kind, ident, (w, payload)))

    def step_done(w: _StandIn, batch_ids: list[int], tokens: int) -> None:
        w.version += 1
        w.step_map.update(
            version=w.version,
            stats={"loss": 1.0 / w.version},
            group_ids=batch_ids,
            trained_tokens=tokens,
        )
        w.conn.conn.send_bytes(_pack(w.step_map))

    while live:
        timeout = None if not heap else max(0.0, heap[0][0] - time.monotonic())
        for key, _ in selector.select(timeout):
            w = key.data
            try:
                data = _unpack(w.conn.conn.recv_bytes())
            except (EOFError, OSError):
                data = {"__t": "Shutdown"}
            kind = data["__t"]
            if kind == "SubmitGroups":
                for group in data["groups"]:
                    gid, plen = group["group_id"], len(group["prompt_ids"])
                    if delay_s > 0:
                        w.pending.add(gid)
                        due = time.monotonic() + w.rng.lognormvariate(
                            math.log(delay_s), DELAY_SIGMA
                        )
                        schedule(due, "group", gid, w, plen)
                    else:
                        w.conn.conn.send_bytes(_group_reply(w, gid, plen))
            elif kind == "UpdateWeights":
                w.ack_map["version"] = data["version"]
                w.conn.conn.send_bytes(_pack(w.ack_map))
            elif kind == "DropShards":
                pass
            elif kind == "CancelAll":
                n, w.pending = len(w.pending), set()
                w.conn.send(msg.Cancelled(n))
            elif kind == "TrainStep":
                shards = data["batch"]["shards"]
                ids = [s["shard_id"] for s in shards]
                tokens = sum(s["fields"]["input_ids"]["shape"][0] for s in shards)
                if train_s > 0:
                    w.busy_until = max(time.monotonic(), w.busy_until) + train_s
                    schedule(w.busy_until, "step", 0, w, (ids, tokens))
                else:
                    step_done(w, ids, tokens)
            elif kind == "Shutdown":
                selector.unregister(w.conn.fileno())
                w.conn.close()
                live -= 1
            else:
                raise RuntimeError(f"stand-in {w.name!r} got an unexpected {kind}")
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, kind, ident, (w, payload) = heapq.heappop(heap)
            if w.conn.closed:
                continue
            if kind == "group" and ident in w.pending:
                w.pending.discard(ident)
                w.conn.conn.send_bytes(_group_reply(w, ident, payload))
            elif kind == "step":
                step_done(w, *payload)


class StandInHandle(ProcessHandle):
    """The controller's end of one stand-in: its own channel and its own sentinel (a dup of
    the shared helper process's), so waiting costs what it costs with one process per
    worker; pid, exit status and reaping are the helper's."""

    def __init__(self, name: str, conn: MessageChannel, helper: mp.Process):
        super().__init__(name, helper, conn)
        self._sentinel = os.dup(helper.sentinel)

    @property
    def sentinel(self):
        return self._sentinel

    def stop(self, timeout: float = 10.0) -> None:
        if not self.conn.closed:
            try:
                self.conn.send(msg.Shutdown())
            except (OSError, ValueError):
                pass
            self.conn.close()
        if self._sentinel is not None:
            os.close(self._sentinel)
            self._sentinel = None


class StandInCluster:
    """``workers`` stand-in rollout workers and one trainer over ``helpers`` processes."""

    def __init__(self, workers: int, helpers: int, delay_ms: float, train_ms: float, seed: int):
        ctx = mp.get_context("fork")  # the helper needs the pipes' descriptors, nothing else
        names = [f"rollout-{i}" for i in range(workers)] + ["trainer"]
        pipes = [ctx.Pipe(duplex=True) for _ in names]
        helpers = max(1, min(helpers, workers))
        share = [names[:-1][i::helpers] for i in range(helpers)]  # rollout workers dealt out
        share[0].append("trainer")
        index = {n: i for i, n in enumerate(names)}
        self.processes = []
        for h, part in enumerate(share):
            own = [
                (n, pipes[index[n]][1], "trainer" if n == "trainer" else "rollout") for n in part
            ]
            close = [p[0] for p in pipes] + [pipes[index[n]][1] for n in names if n not in part]
            proc = ctx.Process(
                target=_helper_main,
                name=f"stand-ins-{h}",
                daemon=True,
                args=(own, close, delay_ms * 1e-3, train_ms * 1e-3, seed * 7919 + h),
            )
            proc.start()
            self.processes.append((proc, set(part)))
        owner = {n: proc for proc, part in self.processes for n in part}
        for _, child in pipes:
            child.close()
        handles = [StandInHandle(n, MessageChannel(pipes[index[n]][0]), owner[n]) for n in names]
        self.rollout_workers, self.trainer = handles[:-1], handles[-1]
        self.weight_buffers: tuple = ()
        for handle in handles:
            if not handle.conn.poll(60.0):
                raise RuntimeError(f"stand-in {handle.name!r} sent no WorkerReady")
            ready = handle.conn.recv()
            assert isinstance(ready, msg.WorkerReady) and ready.name == handle.name, ready
            if handle is self.trainer:
                self.weight_buffers = tuple(ready.weight_buffers)

    def close(self) -> None:
        for handle in [*self.rollout_workers, self.trainer]:
            handle.stop()
        for proc, _ in self.processes:
            proc.join(30.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            proc.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------


def _next_request(seed: int):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1000, 49152) for _ in range(PROMPT_LEN + rng.randint(-10, 10))]
        for _ in range(64)
    ]
    params = SamplingParams(n=GROUP_SIZE, temperature=1.0, max_new_tokens=COMPLETION_CAP)

    def next_request(group_id: int) -> msg.GroupRequest:
        return msg.GroupRequest(
            group_id,
            prompts[group_id % len(prompts)],
            params,
            seed * 1_000_003 + group_id,
            answer="42",
            uid=f"q{group_id}",
        )

    return next_request


def batch_size_for(workers: int) -> int:
    return max(16, workers)


def default_steps(workers: int, groups: int, least: int = 12) -> int:
    """Steps so that about ``groups`` groups are trained (at least ``least`` steps)."""
    return max(least, math.ceil(groups / batch_size_for(workers)))


def _run_delay() -> float | None:
    """Seconds this thread has waited runnable for a CPU (Linux schedstat), or None."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def paced_delay_ms(workers: int, rate: float) -> float:
    """Generation delay at which the (η + 1) · B groups in flight finish ``rate`` groups/s."""
    return 1e3 * (ETA + 1) * batch_size_for(workers) / rate


def run_case(
    workers: int,
    delay_ms: float,
    steps: int,
    *,
    helpers: int = 1,
    train_ms: float = 0.0,
    seed: int = 0,
    profile: bool = False,
    load: str = "saturated",
) -> dict:
    """Run the controller for ``steps`` steps against ``workers`` stand-ins."""
    batch = batch_size_for(workers)
    plan = RunPlan(total_steps=steps, batch_size=batch)
    rollout = RolloutConfig(max_head_offpolicyness=ETA, max_concurrent_rollouts=(ETA + 1) * batch)
    step_cpu: list[float] = []
    records: list[dict] = []

    def on_step(record: dict) -> None:
        step_cpu.append(time.process_time())
        records.append(record)

    setup0 = time.perf_counter()
    helper_cpu0 = _children_cpu()
    # CPU-time clock: a blocking pipe write counts for what it costs, not for how long
    profiler = cProfile.Profile(time.process_time) if profile else None
    with StandInCluster(workers, helpers, delay_ms, train_ms, seed) as cluster:
        setup = time.perf_counter() - setup0
        controller = AsyncController(
            rollout_workers=cluster.rollout_workers,
            trainer=cluster.trainer,
            weight_buffers=cluster.weight_buffers,
            next_request=_next_request(seed),
            plan=plan,
            rollout=rollout,
            on_step=on_step,
        )
        load0, delay0 = os.getloadavg()[0], _run_delay()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        counts = controller.run()
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        delay1 = _run_delay()
    helper_cpu = _children_cpu() - helper_cpu0
    finished = counts.submitted - counts.dropped.get("in_flight_at_end", 0)
    per_step = [b - a for a, b in zip([cpu0] + step_cpu[:-1], step_cpu)]
    steady = per_step[ETA + 1 :] or per_step  # the first steps also fill the pipeline
    result = {
        "workers": workers,
        "load": load,
        "delay_ms": delay_ms,
        "train_ms": train_ms,
        "helpers": helpers,
        "batch_size": batch,
        "eta": ETA,
        "steps": len(records),
        "groups_trained": counts.trained,
        "groups_finished": finished,
        "groups_submitted": counts.submitted,
        "counts": counts.as_dict(),
        "wall_s": wall,
        "controller_cpu_s": cpu,
        "controller_busy": cpu / wall,
        "helper_cpu_s": helper_cpu,
        "helper_busy": helper_cpu / max(wall + setup, 1e-9),
        "setup_s": setup,
        # waiting runnable for a CPU (other load on the machine), not idle
        "controller_runqueue_wait_s": None if delay0 is None else delay1 - delay0,
        "loadavg_1min_before": load0,
        "groups_per_s": counts.trained / wall,
        "finished_groups_per_s": finished / wall,
        "steps_per_s": len(records) / wall,
        "controller_cpu_ms_per_step": 1e3 * cpu / max(len(records), 1),
        "controller_cpu_ms_per_step_median": 1e3 * statistics.median(steady),
        "controller_cpu_us_per_group": 1e6 * cpu / max(counts.trained, 1),
        "controller_cpu_us_per_finished_group": 1e6 * cpu / max(finished, 1),
    }
    if profiler is not None:
        result["profile"] = profile_summary(profiler, cpu)
    return result


# Where a function's own time goes, first matching rule wins: (category, filename or
# function-name fragments). Rough by nature: e.g. getattr counts as codec (its callers are
# the encoder's dataclass walks).
PROFILE_CATEGORIES = (
    (
        "waiting: connection.wait / selectors / poll",
        (
            "connection.py:wait",
            "connection.py:poll",
            "connection.py:_poll",
            "selectors.py",
            "select.poll",
            "fileno",
            "_fileobj_to_fd",
            "<string>:<lambda>",
            "sentinel",
            "handles.py:wait_messages",
            "handles.py:<dictcomp>",
        ),
    ),
    (
        "worker choice: min(workers, key=in_flight) per group",
        ("builtins.min", "async_loop.py:<lambda>"),
    ),
    ("pipe I/O: send/recv system calls", ("posix.write", "posix.read", "connection.py:")),
    (
        "codec: msgpack + dataclass encode/decode",
        (
            "codec.py",
            "msgpack",
            "dataclasses.py",
            "getattr",
            "<string>:__init__",
            "'keys' of 'dict'",
        ),
    ),
    (
        "controller bookkeeping: async_loop, ledger, staleness, metrics",
        (
            "async_loop.py",
            "ledger.py",
            "recovery.py",
            "drain.py",
            "fleet.py",
            "step_record.py",
            "shards.py",
            "staleness.py",
            "statistics.py",
            "handles.py",
        ),
    ),
)


def _category(filename: str, function: str) -> str:
    path = Path(filename)
    name = f"{path.parent.name}/{path.name}:{function}"
    for category, fragments in PROFILE_CATEGORIES:
        if any(fragment in name for fragment in fragments):
            return category
    return "other"


def profile_summary(profiler: cProfile.Profile, cpu: float, top: int = 25) -> dict:
    """Top functions by own and by cumulative time, and own time per category. The clock is
    process CPU time; cProfile's overhead per call inflates small, often-called functions
    (e.g. the 3 million key-lambda calls of min() at 512 workers)."""
    stats = pstats.Stats(profiler)
    total = stats.total_tt

    def rows(key: int) -> list[dict]:
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]
        return [
            {
                "function": f"{Path(f).name}:{line}({fn})",
                "calls": nc,
                "tottime_s": round(tt, 4),
                "cumtime_s": round(ct, 4),
                "tottime_pct": round(100 * tt / total, 1),
                "cumtime_pct": round(100 * ct / total, 1),
            }
            for (f, line, fn), (_, nc, tt, ct, _) in entries
        ]

    categories: dict[str, float] = {}
    for (f, _, fn), (_, _, tt, _, _) in stats.stats.items():
        key = _category(f, fn)
        categories[key] = categories.get(key, 0.0) + tt
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    eprint(text.getvalue())
    by_category = [
        {"category": k, "tottime_s": round(v, 4), "pct": round(100 * v / total, 1)}
        for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
    ]
    return {
        "profiled_total_s": total,
        "controller_cpu_s_with_profiler": cpu,
        "by_category": by_category,
        "by_tottime": rows(2),
        "by_cumtime": rows(3),
    }


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def table(cases: list[dict]) -> str:
    rows = [
        [
            c["workers"],
            c["load"],
            fmt(c["delay_ms"], ".4g"),
            c["batch_size"],
            c["steps"],
            fmt(c["groups_per_s"], ",.0f"),
            fmt(c["steps_per_s"], ".2f"),
            fmt(c["controller_cpu_ms_per_step"], ".2f"),
            fmt(c["controller_cpu_us_per_group"], ".1f"),
            fmt(c["controller_busy"], ".2f"),
            fmt(
                None
                if c["controller_runqueue_wait_s"] is None
                else c["controller_runqueue_wait_s"] / c["wall_s"],
                ".2f",
            ),
            fmt(c["helper_busy"], ".2f"),
            fmt(c["wall_s"], ".2f"),
        ]
        for c in cases
    ]
    return markdown_table(
        [
            "workers",
            "load",
            "delay ms",
            "B",
            "steps",
            "groups/s",
            "steps/s",
            "controller CPU ms/step",
            "controller CPU µs/group",
            "controller busy",
            "waiting for a CPU",
            "helper busy",
            "wall s",
        ],
        rows,
    )


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit if ``needed`` descriptors may not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = hard if hard == resource.RLIM_INFINITY else max(soft, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise SystemExit(f"need about {needed} open files, RLIMIT_NOFILE allows {soft}")
    return soft, hard


# ---------------------------------------------------------------------------
# pytest-benchmark (small sizes, no delay)
# ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # script mode without pytest installed
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("workers", [8, 64])
    def test_controller_scaling(benchmark, workers):
        check_templates()
        case = benchmark.pedantic(
            run_case,
            args=(workers, 0.0, default_steps(workers, 512)),
            rounds=1,
            iterations=1,
            warmup_rounds=0,
        )
        assert case["groups_trained"] == case["steps"] * case["batch_size"]
        benchmark.extra_info.update(
            groups_per_s=case["groups_per_s"],
            controller_cpu_us_per_group=case["controller_cpu_us_per_group"],
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument(
        "--delay-ms",
        type=float,
        nargs="+",
        default=[1.0, 0.0],
        help="median generation delay per group (one case each; 0 = reply at once)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per case (default: about --groups groups)",
    )
    parser.add_argument(
        "--groups", type=int, default=8192, help="trained groups per case when --steps is not given"
    )
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=1000.0,
        help="also run each size with the delay at which the stand-ins offer "
        "this many groups/s (0 = off)",
    )
    parser.add_argument(
        "--paced-groups",
        type=int,
        default=3072,
        help="trained groups per paced case (at least 12 steps)",
    )
    parser.add_argument("--train-ms", type=float, default=0.0, help="stand-in trainer step")
    parser.add_argument(
        "--helpers", type=int, default=1, help="helper processes hosting the stand-ins"
    )
    parser.add_argument(
        "--profile",
        type=int,
        nargs="*",
        default=[],
        metavar="WORKERS",
        help="also run these sizes (first delay) under cProfile",
    )
    parser.add_argument(
        "--small", action="store_true", help="CI: workers 8 64, fewer groups (< 20 s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", default=str(DEFAULT_JSON), help="write the result here ('' for none)"
    )
    args = parser.parse_args(argv)
    if args.small:
        args.workers, args.groups, args.paced_groups = [8, 64], 1024, 512
    if min(args.workers) < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--workers and --steps must be >= 1")
    soft, _ = raise_fd_limit(3 * max(args.workers + args.profile) + 256)
    check_templates()
    run_case(8, 0.0, 12, helpers=args.helpers, seed=args.seed + 1)  # warm-up, not reported

    cases = []
    for delay in args.delay_ms:
        for workers in args.workers:
            steps = args.steps or default_steps(workers, args.groups)
            case = run_case(
                workers, delay, steps, helpers=args.helpers, train_ms=args.train_ms, seed=args.seed
            )
            eprint(
                f"workers {workers:4d} delay {delay:g} ms: {case['groups_per_s']:,.0f} "
                f"groups/s, {case['controller_cpu_us_per_group']:.1f} µs CPU/group, "
                f"busy {case['controller_busy']:.2f}, helper {case['helper_busy']:.2f}"
            )
            cases.append(case)
    if args.paced_rate > 0:
        for workers in args.workers:
            delay = paced_delay_ms(workers, args.paced_rate)
            case = run_case(
                workers,
                delay,
                default_steps(workers, args.paced_groups),
                helpers=args.helpers,
                train_ms=args.train_ms,
                seed=args.seed,
                load=f"paced {args.paced_rate:g}/s",
            )
            eprint(
                f"workers {workers:4d} paced, delay {delay:.4g} ms: "
                f"{case['groups_per_s']:,.0f} groups/s, "
                f"{case['controller_cpu_us_per_group']:.1f} µs CPU/group, "
                f"busy {case['controller_busy']:.2f}"
            )
            cases.append(case)
    profiles = []
    for workers in args.profile:  # shorter runs: the profiler slows the controller 2-5x
        loads = [("saturated", args.delay_ms[0])]
        if args.paced_rate > 0:
            loads.append((f"paced {args.paced_rate:g}/s", paced_delay_ms(workers, args.paced_rate)))
        for load, delay in loads:
            steps = args.steps or default_steps(workers, args.groups // 4, least=6)
            profiles.append(
                run_case(
                    workers,
                    delay,
                    steps,
                    helpers=args.helpers,
                    train_ms=args.train_ms,
                    seed=args.seed,
                    profile=True,
                    load=load,
                )
            )
    result = {
        "benchmark": "controller_scaling",
        "command": " ".join(["python", "benches/bench_controller.py", *(argv or sys.argv[1:])]),
        "workload": {
            "eta": ETA,
            "batch_size": "max(16, workers)",
            "max_concurrent_rollouts": "(eta + 1) * batch_size",
            "group_size": GROUP_SIZE,
            "prompt_tokens": f"{PROMPT_LEN} ± 10",
            "completion_tokens": f"lognormal median {COMPLETION_MEDIAN:g}, "
            f"sigma {COMPLETION_SIGMA}, cap {COMPLETION_CAP}",
            "delay": f"lognormal median delay_ms, sigma {DELAY_SIGMA}",
            "paced_rate_groups_per_s": args.paced_rate,
            "paced_groups": args.paced_groups,
            "train_ms": args.train_ms,
            "helpers": args.helpers,
            "groups_per_case": None if args.steps else args.groups,
            "steps": args.steps,
            "seed": args.seed,
        },
        "rlimit_nofile_soft": soft,
        "cases": cases,
        "profiles": profiles,
        "meta": base_metadata(),
    }
    write_json(args.json, result)
    print(table(cases))
    for p in profiles:
        prof = p["profile"]
        print(
            f"\ncProfile of the controller, {p['workers']} workers, {p['load']} (delay "
            f"{p['delay_ms']:.4g} ms), {prof['profiled_total_s']:.2f} s profiled:"
        )
        print(
            markdown_table(
                ["own time in", "s", "%"],
                [[r["category"], r["tottime_s"], r["pct"]] for r in prof["by_category"]],
            )
        )
        print()
        print(
            markdown_table(
                ["function", "calls", "own s", "own %", "cum %"],
                [
                    [r["function"], r["calls"], r["tottime_s"], r["tottime_pct"], r["cumtime_pct"]]
                    for r in prof["by_tottime"][:12]
                ],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
