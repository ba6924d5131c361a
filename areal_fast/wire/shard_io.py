"""The bytes of one shard: its tensors from a finished group, the spool file a rollout worker
keeps it in (safetensors), and the wire format a trainer fetches it in (a msgpack header, then
raw tensor bytes; no pickle)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgpack
import torch

from areal_fast.rl.batch import TOKEN_FIELDS, Trajectory, pack_trajectories


def shard_tensors(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """Pack one finished group into the shard fields (advantages are left to the trainer)."""
    packed = pack_trajectories(trajectories, torch.zeros(len(trajectories)))
    lengths = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    out = {name: getattr(packed, name) for name in TOKEN_FIELDS}
    out.update(seq_lens=lengths.to(torch.int64), rewards=packed.rewards, group_ids=packed.group_ids)
    return out


def write_shard_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one shard as a safetensors file, atomically (temp name, fsync, rename)."""
    from safetensors.torch import save

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(save({k: v.contiguous() for k, v in tensors.items()}))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_shard_file(path: str, node: str) -> dict[str, torch.Tensor]:
    """Read a spooled shard written by :func:`write_shard_file`. The file stays: a
    reproducible run's pending checkpoint may still link it; the worker that spooled it (or
    its replacement) deletes it with the trained groups, the end of the run the rest.

    Raises
    ------
    RuntimeError
        The file is missing or not a valid safetensors file (worker ``node`` named).
    """
    from safetensors.torch import load

    try:
        data = Path(path).read_bytes()
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - missing, truncated, corrupt
        raise RuntimeError(
            f"worker {node!r} is gone and its spooled shard {path} cannot be "
            f"read ({type(exc).__name__}: {exc})"
        ) from exc
    return tensors


def send_shards(conn, shards: dict) -> None:
    """Send ``{shard_id: {field: tensor}}`` (or ``{"error": str}``) over ``conn``: one msgpack
    header (per tensor: dtype name, shape, byte count), then each tensor's raw bytes as its
    own message, in header order. No pickle; the receiver allocates exactly what the header
    announces (:func:`recv_shards`)."""
    if "error" in shards:
        conn.send_bytes(msgpack.packb({"error": shards["error"]}))
        return
    header, payloads = {}, []
    for shard_id, tensors in shards.items():
        entry = {}
        for name, tensor in tensors.items():
            raw = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
            entry[name] = [str(tensor.dtype).split(".")[-1], list(tensor.shape), raw.numel()]
            payloads.append(raw)
        header[shard_id] = entry
    conn.send_bytes(msgpack.packb({"shards": header}))
    for raw in payloads:
        conn.send_bytes(raw.numpy().data)


WIRE_DTYPES = {
    name: getattr(torch, name)
    for name in ("int64", "int32", "float32", "float64", "bfloat16", "float16", "bool", "uint8")
}


def recv_shards(conn, node: str, timeout: float = 300.0) -> dict:
    """Receive what :func:`send_shards` sent: ``{shard_id: {field: tensor}}``.

    Raises
    ------
    RuntimeError
        The worker answered with an error, announced an unknown dtype, or sent a tensor
        whose size does not match its header (worker ``node`` named).
    """
    reply = msgpack.unpackb(conn.recv_bytes(), raw=False, strict_map_key=False)
    if "error" in reply:
        raise RuntimeError(f"worker {node!r}: {reply['error']}")
    out = {}
    for shard_id, entry in reply["shards"].items():
        tensors = {}
        for name, (dtype, shape, nbytes) in entry.items():
            if dtype not in WIRE_DTYPES:
                raise RuntimeError(
                    f"worker {node!r} sent shard {shard_id} field {name!r} with "
                    f"unsupported dtype {dtype!r}"
                )
            expected = math.prod(shape) * torch.empty(0, dtype=WIRE_DTYPES[dtype]).element_size()
            if nbytes != expected:
                raise RuntimeError(
                    f"worker {node!r} announced {nbytes} bytes for shard "
                    f"{shard_id} field {name!r} of shape {shape} {dtype} "
                    f"({expected} expected)"
                )
            if nbytes and not conn.poll(timeout):
                raise TimeoutError(
                    f"worker {node!r} stopped sending shard {shard_id} field "
                    f"{name!r} for more than {timeout:g} s"
                )
            buffer = bytearray(nbytes)
            got = conn.recv_bytes_into(buffer) if nbytes else 0
            if got != nbytes:
                raise RuntimeError(
                    f"worker {node!r} sent {got} bytes for shard {shard_id} "
                    f"field {name!r}, its header said {nbytes}"
                )
            flat = (
                torch.frombuffer(buffer, dtype=torch.uint8)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[name] = flat.view(WIRE_DTYPES[dtype]).reshape(shape)
        out[int(shard_id)] = tensors
    return out
