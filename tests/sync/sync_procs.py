"""Process bodies for the multi-process weight-sync tests (imported by spawned children).

Rank 0 is the trainer (sender); ranks 1.. are engines. Every rank rebuilds the trainer's
tensors from the same seed, so an engine checks what it received locally, bit for bit, and
only a small report crosses back to the test.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Callable

import torch
from torch import nn

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mixed(nn.Module):
    """Parameters of every dtype the tests need: odd sizes, one larger than a bucket, an
    embedding with an optionally tied head."""

    def __init__(
        self, dtype_of: dict[str, torch.dtype], tied: bool, vocab: int = 97, hidden: int = 24
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype_of.get("embed", FP32))
        self.odd = nn.Parameter(torch.empty(7, 13, dtype=dtype_of.get("odd", FP32)))
        self.f16 = nn.Parameter(torch.empty(33, 5, dtype=dtype_of.get("f16", FP16)))
        self.b16 = nn.Parameter(torch.empty(257, dtype=dtype_of.get("b16", BF16)))
        self.big = nn.Parameter(torch.empty(3001, dtype=dtype_of.get("big", FP32)))
        self.norm = nn.Parameter(torch.empty(1, dtype=dtype_of.get("norm", FP32)))
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype_of.get("head", FP32))
        if tied:
            self.head.weight = self.embed.weight

    def fill(self, seed: int) -> "Mixed":
        """Random values (fp32 draws cast to each dtype), the same for a given seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * 3)
        return self


def run_ranks(target: Callable, world_size: int, args: tuple, timeout: float = 120.0) -> list:
    """Run ``target(rank, port, queue, *args)`` in ``world_size`` spawned processes; return
    each rank's report (``None`` for a rank that exited without one)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, rank, port, queue, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    reports: list = [None] * world_size
    deadline = time.monotonic() + timeout
    got = 0
    while got < world_size and time.monotonic() < deadline:
        try:
            rank, report = queue.get(timeout=0.5)
        except Exception:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        reports[rank] = report
        got += 1
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1))
        if p.is_alive():
            p.kill()
    return reports


def _entry(target, rank, port, queue, args):
    torch.set_num_threads(1)
    try:
        report = target(rank, port, *args)
    except BaseException as exc:  # reported, the test asserts on it
        report = {
            "error": f"{type(exc).__name__}: {exc}",
            "type": type(exc).__name__,
            "trace": traceback.format_exc(),
        }
    queue.put((rank, report))


def make_transport(kind: str, rank: int, world_size: int, port: int, directory: str):
    from areal_fast.sync.transports import (
        DiskTransport,
        SharedMemoryTransport,
        TorchDistTransport,
        init_sync_group,
    )

    if kind == "disk":
        return DiskTransport(directory, rank, world_size, run_id=f"run{port}")
    group = init_sync_group(rank, world_size, port, timeout=60)
    if kind == "gloo":
        return TorchDistTransport(group, "gloo")
    if kind == "gloo-nccl-path":  # the NCCL code path (polling waits) over a gloo group
        return TorchDistTransport(group, "nccl", device=torch.device("cpu"))
    if kind == "shm":
        return SharedMemoryTransport(group, directory=directory)
    if kind == "cuda-ipc":
        from areal_fast.sync.transports import CudaIpcTransport

        return CudaIpcTransport(group, torch.device("cuda", 0))
    raise ValueError(kind)


def exact_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe), dtypes and shapes included."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# ---------------------------------------------------------------------------- scenarios


def sync_mixed(
    rank: int,
    port: int,
    kind: str,
    directory: str,
    seed: int,
    trainer_dtypes: dict,
    engine_dtypes: dict,
    tied: tuple[bool, bool],
    wire: str | None,
    bucket_bytes: int,
    updates: int,
    solo_bytes: int = 4 << 20,
) -> dict:
    """Trainer sends ``updates`` versions of a :class:`Mixed` module; engines compare."""
    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    world = 2 if kind == "cuda-ipc" else 3
    device = "cuda" if kind == "cuda-ipc" else "cpu"
    transport = make_transport(kind, rank, world, port, directory)
    try:
        if rank == 0:
            sender = WeightSender(
                transport,
                bucket_bytes=bucket_bytes,
                timeout=30,
                wire_dtype=getattr(torch, wire) if wire else None,
                solo_bytes=solo_bytes,
            )
            stats = []
            for version in range(1, updates + 1):
                model = Mixed(trainer_dtypes, tied[0]).fill(seed + version).to(device)
                s = sender.send(ModuleSource(model), version)
                stats.append((s.num_buckets, s.num_bytes))
            return {"stats": stats}
        engine = Mixed(engine_dtypes, tied[1]).fill(seed + 1000 + rank).to(device)
        receiver = WeightReceiver(transport, timeout=30)
        report = {"versions": [], "mismatch": [], "tied_alias": None}
        for version in range(1, updates + 1):
            params = dict(engine.named_parameters())
            session = receiver.start(accept=lambda plan: check_against(plan, params))
            session.unpack_into([params.get(s.name) for s in session.plan.specs])
            session.finish()
            report["versions"].append(session.version)
            expected = Mixed(trainer_dtypes, tied[0]).fill(seed + version)
            for name, got in engine.named_parameters(remove_duplicate=False):
                want = dict(expected.named_parameters(remove_duplicate=False))[name]
                if not exact_equal(got.detach().cpu(), want.detach().to(got.dtype)):
                    report["mismatch"].append((version, name))
        report["tied_alias"] = engine.head.weight is engine.embed.weight
        return report
    finally:
        transport.close()


def sync_rejected(rank: int, port: int, kind: str, directory: str, seed: int, fault: str) -> dict:
    """Engine 2 has a parameter with another name/shape/dtype: the update is rejected on
    every rank and no engine changes."""
    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    transport = make_transport(kind, rank, 3, port, directory)
    try:
        if rank == 0:
            try:
                WeightSender(transport, bucket_bytes=1024, timeout=30).send(
                    ModuleSource(Mixed({}, False).fill(seed)), 1
                )
            except Exception as exc:
                return {"error": str(exc), "type": type(exc).__name__}
            return {"error": None}
        engine = Mixed({}, False).fill(seed + rank)
        if rank == 2 and fault == "name":
            engine.renamed = engine.odd
            del engine.odd
        elif rank == 2 and fault == "shape":
            engine.odd = nn.Parameter(torch.randn(13, 7))
        elif rank == 2 and fault == "dtype":
            engine.big = nn.Parameter(torch.arange(3001), requires_grad=False)
        before = {n: p.detach().clone() for n, p in engine.named_parameters()}
        params = dict(engine.named_parameters())
        try:
            WeightReceiver(transport, timeout=30).start(
                accept=lambda plan: check_against(plan, params)
            )
            error = None
        except Exception as exc:
            error = str(exc)
        unchanged = all(exact_equal(before[n], p.detach()) for n, p in engine.named_parameters())
        return {"error": error, "unchanged": unchanged}
    finally:
        transport.close()


def tiny_hf_engine(seed: int):
    """An :class:`HFEngine` around a 2-layer Llama (vocab 64), random weights from ``seed``."""
    from types import SimpleNamespace

    import transformers

    from areal_fast.rollout.hf_engine import HFEngine

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return HFEngine(model, SimpleNamespace(pad_token_id=0, eos_token_id=1)), model


def sync_peer_dies(rank: int, port: int, kind: str, directory: str, seed: int) -> dict:
    """The trainer dies after sending 2 of its buckets: engines fail within the timeout, refuse
    to generate, then accept a complete update from a new trainer on a new group."""
    from areal_fast.sync.receiver import WeightReceiver
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    transport = make_transport(kind, rank, 3, port, directory)
    if rank == 0:
        _, model = tiny_hf_engine(seed + 1)
        sender = WeightSender(transport, bucket_bytes=4096, timeout=20)
        real_start, real_direct = transport.start_send, transport.start_send_direct

        def dying_start(slot, nbytes, index):
            if index == 2:
                os._exit(3)  # no cleanup, like a killed process
            return real_start(slot, nbytes, index)

        def dying_direct(data, index):
            if index == 2:
                os._exit(3)
            return real_direct(data, index)

        transport.start_send, transport.start_send_direct = dying_start, dying_direct
        sender.send(ModuleSource(model), 1)
        return {"error": "trainer survived"}
    engine, model = tiny_hf_engine(seed + 100 + rank)
    prompt = [[5, 6, 7]]
    from areal_fast.rollout.engine import SamplingParams

    params = SamplingParams(n=1, temperature=0, max_new_tokens=3)
    engine.generate(prompt, params)
    started = time.monotonic()
    report: dict = {}
    try:
        engine.receive_weights(WeightReceiver(transport, timeout=10))
        report["error"] = None
    except Exception as exc:
        report["error"], report["type"] = str(exc), type(exc).__name__
    report["seconds"] = time.monotonic() - started
    try:
        engine.generate(prompt, params)
        report["served_after_failure"] = True
    except RuntimeError as exc:
        report["served_after_failure"] = False
        report["refusal"] = str(exc)
    report["version"] = engine.version
    return report


def sync_hf_engines(rank: int, port: int, kind: str, directory: str, seed: int) -> dict:
    """fp32 trainer → two bf16 HFEngines (tied embeddings): versions, values and aliasing."""
    from areal_fast.sync.receiver import WeightReceiver
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    transport = make_transport(kind, rank, 3, port, directory)
    try:
        if rank == 0:
            _, model = tiny_hf_engine(seed)
            stats = WeightSender(transport, bucket_bytes=8192, timeout=30).send(
                ModuleSource(model), 7
            )
            return {"buckets": stats.num_buckets}
        engine, model = tiny_hf_engine(seed + rank)
        model.to(torch.bfloat16)
        version = engine.receive_weights(WeightReceiver(transport, timeout=30))
        _, reference = tiny_hf_engine(seed)
        mismatch = [
            n
            for n, p in model.named_parameters()
            if not exact_equal(
                p.detach(), dict(reference.named_parameters())[n].detach().to(torch.bfloat16)
            )
        ]
        from areal_fast.rollout.engine import SamplingParams

        out = engine.generate([[3, 4, 5]], SamplingParams(n=1, temperature=0, max_new_tokens=4))
        return {
            "version": version,
            "mismatch": mismatch,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "output_versions": sorted(set(out[0].versions)),
        }
    finally:
        transport.close()


def sync_lora_adapter(rank: int, port: int, kind: str, directory: str, seed: int) -> dict:
    """A LoRA trainer's adapter (alpha = rank: B unscaled) sent in buckets to two HFEngines,
    which merge it: their weights equal base + B A, the plan holds adapter tensors only."""
    from areal_fast.sync.receiver import WeightReceiver
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource
    from areal_fast.train.lora import LoraConfig, apply_lora, lora_layers

    def adapted(model):
        apply_lora(model, LoraConfig(rank=4, alpha=4.0, target_modules=["q_proj", "up_proj"]))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, layer in lora_layers(model):
                for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        return model

    def adapter_name(name: str):  # ...q_proj.lora_A.default.weight -> ...q_proj.lora_A
        return name.rsplit(".", 2)[0] if ".lora_" in name else None

    transport = make_transport(kind, rank, 3, port, directory)
    try:
        if rank == 0:
            _, model = tiny_hf_engine(seed)
            source = ModuleSource(adapted(model), name_map=adapter_name)
            stats = WeightSender(transport, bucket_bytes=2048, timeout=30).send(source, 5)
            return {"buckets": stats.num_buckets, "names": [s.name for s in source.specs()]}
        engine, model = tiny_hf_engine(seed)  # the same base weights as the trainer's
        version = engine.receive_weights(WeightReceiver(transport, timeout=30))
        _, reference = tiny_hf_engine(seed)
        layers = dict(lora_layers(adapted(reference)))
        worst = 0.0
        for name, param in model.named_parameters():
            module = name.removesuffix(".weight")
            if module in layers:
                layer = layers[module]
                want = layer.base_layer.weight + layer.lora_B["default"].weight @ (
                    layer.lora_A["default"].weight
                )
            else:
                want = dict(reference.named_parameters())[name]
            worst = max(worst, float((param.detach() - want.detach()).abs().max()))
        return {"version": version, "worst": worst}
    finally:
        transport.close()


def sync_fsdp2(rank: int, port: int, directory: str, seed: int, reject: bool = False) -> dict:
    """Ranks 0, 1 train with FSDP2 (gloo); rank 2 is an engine. Sync group = {0, 2}.

    With ``reject`` the engine refuses the plan: both training ranks stop the update and
    their group still works (an all-reduce afterwards)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import FSDP2Source
    from areal_fast.sync.transports import TorchDistTransport, init_sync_group

    if rank < 2:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + 1))
        dist.init_process_group(
            "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
        )
        model = Mixed({"f16": FP32, "b16": FP32}, tied=True).fill(seed)
        fully_shard(model)
        source = FSDP2Source(model)
        transport = (
            TorchDistTransport(init_sync_group(0, 2, port, timeout=60)) if rank == 0 else None
        )
        try:
            stats = WeightSender(transport, bucket_bytes=2048, timeout=30).send(source, 3)
            report = {"bytes": stats.num_bytes}
        except Exception as exc:
            report = {"error": str(exc)}
        total = torch.ones(1)
        dist.all_reduce(total)  # the training group is still in step
        report.update(
            sharded=any(hasattr(p, "full_tensor") for p in model.parameters()),
            all_reduce=total.item(),
        )
        dist.destroy_process_group()
        return report
    engine = Mixed({"f16": FP32, "b16": FP32}, tied=True).fill(seed + 5)
    transport = TorchDistTransport(init_sync_group(1, 2, port, timeout=60))
    params = dict(engine.named_parameters())
    if reject:
        params["extra"] = torch.zeros(3)
        try:
            WeightReceiver(transport, timeout=30).start(
                accept=lambda plan: check_against(plan, params)
            )
        except Exception as exc:
            return {"error": str(exc)}
        return {"error": None}
    session = WeightReceiver(transport, timeout=30).start(
        accept=lambda plan: check_against(plan, params)
    )
    session.unpack_into([params.get(s.name) for s in session.plan.specs])
    session.finish()
    expected = Mixed({"f16": FP32, "b16": FP32}, tied=True).fill(seed)
    mismatch = [
        n
        for n, p in engine.named_parameters()
        if not exact_equal(p.detach(), dict(expected.named_parameters())[n].detach())
    ]
    return {"version": session.version, "mismatch": mismatch}


def sync_partial_failure(rank: int, port: int, kind: str, directory: str, seed: int) -> dict:
    """Engine 1's unpack fails at bucket 2 of update 1; engine 2 installs it. The sender names
    engine 1; a second update on the same transport then reaches both engines intact."""
    import areal_fast.sync.receiver as receiver_module
    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    transport = make_transport(kind, rank, 3, port, directory)
    try:
        if rank == 0:
            sender = WeightSender(transport, bucket_bytes=1024, timeout=30)
            out = {}
            for version in (1, 2):
                try:
                    sender.send(ModuleSource(Mixed({}, False).fill(seed + version)), version)
                    out[version] = None
                except Exception as exc:
                    out[version] = str(exc)
            return out
        if rank == 1:
            real = receiver_module.unpack_bucket

            def failing(plan, k, bucket, targets, **kw):
                if k >= 2 and not failing.fired:  # first packed bucket after 1
                    failing.fired = True
                    raise RuntimeError("injected unpack failure")
                return real(plan, k, bucket, targets, **kw)

            failing.fired = False
            receiver_module.unpack_bucket = failing
        engine = Mixed({}, False).fill(seed + 100 + rank)
        receiver = WeightReceiver(transport, timeout=30)
        report = {}
        for version in (1, 2):
            params = dict(engine.named_parameters())
            session = receiver.start(accept=lambda plan: check_against(plan, params))
            try:
                session.unpack_into([params.get(s.name) for s in session.plan.specs])
                error = ""
            except RuntimeError as exc:
                error = str(exc)
            session.finish(error)
            expected = dict(Mixed({}, False).fill(seed + version).named_parameters())
            report[version] = {
                "error": error,
                "exact": all(
                    exact_equal(p.detach(), expected[n].detach())
                    for n, p in engine.named_parameters()
                ),
            }
        return report
    finally:
        transport.close()


# ------------------------------------------------------------------ layout buffers, in place

LAYOUT_SPECS = (
    ("a", (5, 123), BF16),
    ("b", (1003,), FP32),
    ("big", (3001,), FP32),  # split over buckets of 8192 and 4096 bytes
    ("c", (7, 13), FP16),
    ("empty", (0, 4), FP32),
    ("one", (1,), FP32),
    ("d", (257,), BF16),
    ("e", (33, 5), FP16),
)


def layout_values(seed: int) -> dict[str, torch.Tensor]:
    """Random bit patterns for every tensor of :data:`LAYOUT_SPECS` (the same for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in LAYOUT_SPECS:
        nbytes = math.prod(shape) * dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        out[name] = raw.view(dtype).view(shape)
    return out


def layout_tensors(kind: str, seed: int) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Tensors for :data:`LAYOUT_SPECS`, every byte random (padding too).

    ``kind``: ``"flat"`` — views of one buffer laid out by ``plan_layout``; ``"dense"`` — views
    of one buffer at other offsets (16-byte aligned, no 256-byte padding); ``"separate"`` —
    tensors of their own (buffer None)."""
    from areal_fast.sync.shared_memory import plan_layout

    gen = torch.Generator().manual_seed(seed)
    if kind == "separate":
        return None, {
            name: torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=gen)
            .to(torch.uint8)
            .view(dtype)
            .view(shape)
            for name, shape, dtype in LAYOUT_SPECS
        }
    if kind == "flat":
        entries, total = plan_layout((n, torch.empty(s, dtype=d)) for n, s, d in LAYOUT_SPECS)
        offsets = [e.offset for e in entries]
    elif kind == "dense":
        offsets, total = [], 0
        for _, shape, dtype in LAYOUT_SPECS:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // 16) * 16
    else:
        raise ValueError(kind)
    buffer = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
    views = {}
    for (name, shape, dtype), offset in zip(LAYOUT_SPECS, offsets):
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
    return buffer, views


def covered_bytes(buffer: torch.Tensor, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [buffer bytes]: True where some view of ``views`` lies."""
    mask = torch.zeros(buffer.numel(), dtype=torch.bool)
    for view in views.values():
        start = view.data_ptr() - buffer.data_ptr()
        mask[start : start + view.numel() * view.element_size()] = True
    return mask


def sync_layout(
    rank: int,
    port: int,
    seed: int,
    sender_kind: str,
    engines: dict,
    bucket_bytes: int,
    solo_bytes: int,
    updates: int = 2,
) -> dict:
    """The trainer sends :data:`LAYOUT_SPECS` from ``sender_kind`` tensors over gloo; engine
    rank r receives into ``engines[r] = (kind, layout_buffer)`` tensors. Fresh values each
    update; engines compare bytes and check that padding stayed as it was where it had to."""
    from areal_fast.sync.receiver import WeightReceiver, check_against
    from areal_fast.sync.sender import WeightSender
    from areal_fast.sync.sources import ModuleSource

    transport = make_transport("gloo", rank, 1 + len(engines), port, "")
    try:
        if rank == 0:
            sender = WeightSender(
                transport, bucket_bytes=bucket_bytes, timeout=30, solo_bytes=solo_bytes
            )
            stats = []
            for version in range(1, updates + 1):
                _, tensors = layout_tensors(sender_kind, seed + 7 * version)
                for name, value in layout_values(seed + version).items():
                    tensors[name].copy_(value)
                s = sender.send(ModuleSource(_Holder(tensors)), version)
                stats.append({"buckets": s.num_buckets, "direct": s.direct_buckets})
            return {"stats": stats}
        kind, flag = engines[rank]
        buffer, tensors = layout_tensors(kind, seed + 1000 * rank)
        before = None if buffer is None else buffer.clone()
        receiver = WeightReceiver(transport, timeout=30)
        report: dict = {"mismatch": [], "in_place": [], "unpacked": [], "padding_kept": None}
        for version in range(1, updates + 1):
            params = dict(tensors)
            session = receiver.start(accept=lambda plan: check_against(plan, params))
            session.unpack_into(
                [params.get(s.name) for s in session.plan.specs], layout_buffer=flag
            )
            session.finish()
            report["in_place"].append(session.in_place_buckets)
            report["unpacked"].append(session.unpacked_buckets)
            for name, want in layout_values(seed + version).items():
                if not exact_equal(tensors[name], want):
                    report["mismatch"].append((version, name))
        if buffer is not None:
            padding = ~covered_bytes(buffer, tensors)
            report["padding_bytes"] = int(padding.sum())
            report["padding_kept"] = bool(torch.equal(buffer[padding], before[padding]))
        return report
    finally:
        transport.close()


class _Holder(nn.Module):
    """A module whose parameters are the given tensors, as they are (no copy)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
