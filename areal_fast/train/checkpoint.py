"""Trainer-state checkpoints: weights, optimizer, LR schedule, version and RNG states.

A train-state directory holds

- ``model.safetensors``: the full (unsharded) model state dict, tied aliases once (e.g. no
  ``lm_head.weight`` under ``tie_word_embeddings``); with ``actor.lora`` the adapter
  tensors alone (``...lora_A.default.weight``, ``...lora_B.default.weight``: the frozen base
  weights are the model's own files);
- ``optimizer.pt``: the full optimizer state dict keyed by parameter name
  (``torch.distributed.checkpoint.state_dict`` format), read back with ``weights_only=True``;
- ``rng_rank{r}.json``: torch (and CUDA), numpy and python RNG states of rank r;
- ``train_state.json``, written LAST: format, ``version``, ``world_size``, the LR scheduler
  state and every other file with its size in bytes. A directory without it, or whose files
  differ from it, is partial.

Full state dicts make a checkpoint independent of the number of ranks: one written by N FSDP
ranks loads into a single-process engine and back (RNG states are restored for the ranks the
writer had). The functions write only into the given directory; make the save atomic by
writing a temporary directory and renaming it.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FORMAT = "areal_fast.train_state/1"
STATE_FILE = "train_state.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"


def save_train_state(engine, directory: str) -> None:
    """Write ``engine``'s full training state into ``directory`` (created if needed).

    Collective for an :class:`~areal_fast.train.fsdp.FSDPTrainEngine`: every rank calls it;
    rank 0 writes the weights, the optimizer state and ``train_state.json``, each rank its
    own RNG file (``directory`` must be visible to all ranks).

    Parameters
    ----------
    engine : TorchTrainEngine or FSDPTrainEngine
        Its ``model``, ``optimizer``, ``scheduler`` and ``version`` are saved.
    directory : str
    """
    rank, world_size, distributed = _rank_info(engine)
    os.makedirs(directory, exist_ok=True)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(engine.model, options=options)
    optim_state = get_optimizer_state_dict(engine.model, engine.optimizer, options=options)
    if rank == 0:
        aliases = _tied_aliases(engine.model)
        kept = _saved_keys(engine)
        save_file(
            {
                k: v.contiguous()
                for k, v in model_state.items()
                if k not in aliases and (kept is None or k in kept)
            },
            os.path.join(directory, MODEL_FILE),
        )
        torch.save(optim_state, os.path.join(directory, OPTIM_FILE))
    write_json_durably(os.path.join(directory, f"rng_rank{rank}.json"), _rng_state())
    _barrier(engine, distributed)
    if rank == 0:
        names = [MODEL_FILE, OPTIM_FILE] + [f"rng_rank{r}.json" for r in range(world_size)]
        write_json_durably(
            os.path.join(directory, STATE_FILE),
            {
                "format": FORMAT,
                "version": engine.version,
                "world_size": world_size,
                "scheduler": engine.scheduler.state_dict(),
                "files": {n: os.path.getsize(os.path.join(directory, n)) for n in names},
            },
        )
    _barrier(engine, distributed)


def load_train_state(engine, directory: str) -> None:
    """Restore a directory written by :func:`save_train_state` into ``engine``.

    Collective for an FSDP engine (every rank calls it; rank 0 reads the weights and the
    optimizer state and broadcasts them). The world size may differ from the writer's; RNG
    states are restored on ranks the writer had.

    Parameters
    ----------
    engine : TorchTrainEngine or FSDPTrainEngine
        Model weights, optimizer and scheduler state, ``version`` and RNG states are set.
    directory : str

    Raises
    ------
    ValueError
        One line naming the file: ``train_state.json`` missing or unreadable (a partial
        directory), a listed file missing or of another size (truncated), a weight or
        optimizer entry missing, unexpected or of another shape than the model's.
    """
    rank, _, distributed = _rank_info(engine)
    meta = read_train_state(directory)
    kept = _saved_keys(engine)
    _check_model_file(os.path.join(directory, MODEL_FILE), engine.model, kept)
    rng = (
        _read_json(os.path.join(directory, f"rng_rank{rank}.json"))
        if rank < meta["world_size"]
        else None
    )
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=distributed, strict=kept is None
    )
    model_state, optim_state, error = {}, {}, ""
    if rank == 0:  # the others receive both by broadcast
        model_state, optim_state, error = _read_states(directory, engine.model, kept)
    if distributed:
        error = _broadcast_text(error, engine)
    if error:
        raise ValueError(error)
    set_model_state_dict(engine.model, model_state, options=options)
    set_optimizer_state_dict(engine.model, engine.optimizer, optim_state, options=options)
    engine.scheduler.load_state_dict(meta["scheduler"])
    engine.version = int(meta["version"])
    if rng is not None:
        _set_rng_state(rng)
    _barrier(engine, distributed)


# ---------------------------------------------------------------------------- validation
def read_train_state(directory) -> dict:
    """``train_state.json`` of ``directory``, checked, after checking every file it lists
    by size (cheap: no weights are read).

    Raises
    ------
    ValueError
        One line naming the missing, unreadable or truncated file.
    """
    directory = str(directory)
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: not a train-state directory, or a partial one")
    meta = _read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format is not {FORMAT!r}")
    for key, kind in (("version", int), ("world_size", int), ("scheduler", dict), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{path}: {key!r} is missing or not a {kind.__name__}")
    for name, size in meta["files"].items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise ValueError(f"{file} is missing (listed in {STATE_FILE})")
        if os.path.getsize(file) != size:
            raise ValueError(
                f"{file} has {os.path.getsize(file)} bytes, {STATE_FILE} says "
                f"{size} (truncated or replaced)"
            )
    return meta


def _saved_keys(engine):
    """The state-dict keys a checkpoint holds: None for all (full fine-tuning), with
    ``actor.lora`` the trainable (adapter) parameters' names."""
    lora = getattr(getattr(engine, "actor", None), "lora", None)
    if lora is None or not lora.enabled:
        return None
    return {n for n, p in engine.model.named_parameters() if p.requires_grad}


def _check_model_file(path: str, model, kept=None) -> None:
    """The safetensors header names exactly the model's tensors (``kept`` of them when
    given), with its (global) shapes."""
    expected = _expected_shapes(model)
    if kept is not None:
        expected = {k: v for k, v in expected.items() if k in kept}
    try:
        with safe_open(path, framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {_one_line(exc)}") from exc
    _compare_shapes(path, expected, found, "weight")


def _read_states(directory: str, model, kept=None) -> tuple[dict, dict, str]:
    """Model and optimizer state dicts, and an error line ("" when both are good)."""
    path = os.path.join(directory, MODEL_FILE)
    try:
        model_state = load_file(path)
        model_state = model_state if kept is not None else _with_aliases(model_state, model)
    except Exception as exc:
        return {}, {}, f"{path} is not a readable safetensors file: {_one_line(exc)}"
    optim_state, error = _read_optimizer(os.path.join(directory, OPTIM_FILE), model)
    return model_state, optim_state, error


def _read_optimizer(path: str, model) -> tuple[dict, str]:
    """The optimizer state (weights_only) and an error line ("" when it matches the model)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        return {}, f"{path} is not a readable optimizer state: {_one_line(exc)}"
    expected = _expected_shapes(model)
    if not (
        isinstance(state, dict)
        and isinstance(state.get("state"), dict)
        and isinstance(state.get("param_groups"), list)
    ):
        return {}, f"{path}: not an optimizer state dict (state, param_groups)"
    for name, entry in state["state"].items():
        if name not in expected:
            return {}, f"{path}: state for {name!r}, which the model does not have"
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.ndim
                and tuple(value.shape) != expected[name]
            ):
                return {}, (
                    f"{path}: {name}.{key} has shape {tuple(value.shape)}, the model "
                    f"{expected[name]}"
                )
    named = [n for group in state["param_groups"] for n in group.get("params", [])]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if sorted(named) != sorted(trainable):
        missing = sorted(set(trainable) - set(named)) or sorted(set(named) - set(trainable))
        return {}, f"{path}: param_groups do not match the model's parameters ({missing[0]!r})"
    return state, ""


def _compare_shapes(path: str, expected: dict, found: dict, what: str) -> None:
    for name in sorted(set(expected) | set(found)):
        if name not in found:
            raise ValueError(f"{path}: {what} {name!r} is missing")
        if name not in expected:
            raise ValueError(f"{path}: {what} {name!r} is not in the model")
        if found[name] != expected[name]:
            raise ValueError(
                f"{path}: {what} {name!r} has shape {found[name]}, the model {expected[name]}"
            )


def _expected_shapes(model) -> dict[str, tuple[int, ...]]:
    """Global shape of every state-dict entry except tied aliases (DTensor shapes are
    global)."""
    aliases = _tied_aliases(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in aliases}


def _tied_aliases(model) -> dict[str, str]:
    """Parameter name → the first name of the same (tied) parameter, for the later names."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _with_aliases(state: dict, model) -> dict:
    for alias, name in _tied_aliases(model).items():
        state[alias] = state[name]
    return state


# ---------------------------------------------------------------------------- RNG, files
def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def write_json_durably(path, obj, indent: int | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` and fsync it before returning."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------------------- ranks
def _rank_info(engine) -> tuple[int, int, bool]:
    """(rank, world size, whether the engine is an FSDP engine in a process group)."""
    group = getattr(engine, "group", None)
    if group is None:
        return 0, 1, False
    return engine.rank, engine.world_size, True


def _barrier(engine, distributed: bool) -> None:
    if distributed:
        dist.barrier(group=engine.group)


def _broadcast_text(text: str, engine) -> str:
    """Rank 0's ``text`` on every rank (as bytes in tensors: nothing is unpickled)."""
    device = engine.comm_device
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=dist.get_global_rank(engine.group, 0), group=engine.group)
    if engine.rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        dist.broadcast(data, src=dist.get_global_rank(engine.group, 0), group=engine.group)
    return bytes(data.cpu().tolist()).decode()
