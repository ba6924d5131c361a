"""Your own rows as problems: ``data.task: jsonl`` (JSON-lines files) or ``hf`` (the
``datasets`` library: a Hub id or a ``save_to_disk`` folder).

Each row gives the prompt, either as plain text (the ``data.prompt_key`` column; the
instruction is appended as for the built-in tasks) or as chat messages (the
``data.messages_key`` column, a list of ``{"role", "content"}``), and the reference answer
(``data.answer_key``). The whole row travels with the problem: a reward or an agent gets it
as the sample dict, plus ``"answer"`` (normalised) and ``"uid"`` (see
:meth:`~areal_fast.data.problems.MathProblem.sample`).

Held-out rows come from the ``data.eval_split`` file or split when there is one; otherwise
``data.eval_size`` rows are drawn from the training rows with ``data.eval_seed`` and removed
from them. Every row is checked when the data is loaded (before any worker starts); a bad
one raises one line naming the file, the row (the 1-based line of a ``.jsonl`` file, the
0-based index of a ``datasets`` split) and the key.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from areal_fast.data.config import DataConfig
from areal_fast.data.jsonl import jsonl_rows
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import normalize_number

_PLAIN_SCALARS = (str, int, float, bool, bytes, type(None))


@dataclass
class _Split:
    """The raw rows of one split: ``(where, row)`` pairs, ``where`` naming file and row."""

    label: str  # "<source> [<split>]" or the file path, for messages about the whole split
    name: str  # split name used in uids
    rows: list


def _read_jsonl(path: Path, name: str) -> _Split:
    return _Split(str(path), name, jsonl_rows(path))


def _jsonl_splits(d: DataConfig) -> tuple[_Split, Optional[_Split]]:
    path = Path(d.path).expanduser()
    if path.is_file():
        return _read_jsonl(path, path.stem), None
    if not path.is_dir():
        raise FileNotFoundError(f"data.path {d.path}: no such file or folder")
    train_file = path / f"{d.train_split}.jsonl"
    if not train_file.is_file():
        found = sorted(p.name for p in path.glob("*.jsonl"))
        raise FileNotFoundError(
            f"data.path {d.path}: no {train_file.name} (data.train_split = {d.train_split}; "
            f".jsonl files there: {', '.join(found) or 'none'})"
        )
    eval_file = path / f"{d.eval_split}.jsonl"
    held_out = _read_jsonl(eval_file, d.eval_split) if eval_file.is_file() else None
    return _read_jsonl(train_file, d.train_split), held_out


def _load_hf(source: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data.task=hf needs `pip install datasets` (to load data.path {source})"
        ) from None
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any(
            (path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json")
        ):
            return datasets.load_from_disk(str(path))
        if not path.exists() and source.startswith(("/", ".", "~")):
            raise FileNotFoundError(f"data.path {source}: no such file or folder")
        return datasets.load_dataset(source)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"data.path {source}: cannot load it as a Hugging Face dataset "
            f"({type(e).__name__}: {first})"
        ) from None


def _hf_split(source: str, dataset, name: str) -> _Split:
    label = f"{source} [{name}]"
    rows = [(f"{label} index {i}", row) for i, row in enumerate(dataset)]
    if not rows:
        raise ValueError(f"{label}: split holds no rows")
    return _Split(label, name, rows)


def _hf_splits(d: DataConfig) -> tuple[_Split, Optional[_Split]]:
    loaded = _load_hf(d.path)
    if not isinstance(loaded, Mapping):  # one Dataset: no splits
        return _hf_split(d.path, loaded, d.train_split), None
    if d.train_split not in loaded:
        raise ValueError(
            f"data.path {d.path}: no split {d.train_split!r} (data.train_split; its splits: "
            f"{', '.join(loaded)})"
        )
    held_out = (
        _hf_split(d.path, loaded[d.eval_split], d.eval_split) if (d.eval_split in loaded) else None
    )
    return _hf_split(d.path, loaded[d.train_split], d.train_split), held_out


def _check_plain(value: Any, where: str, key: str) -> None:
    """Raise unless ``value`` is plain data that can travel to the workers (msgpack)."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, where, key)
        return
    if isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
        for item in value.values():
            _check_plain(item, where, key)
        return
    raise ValueError(
        f"{where}: column '{key}' holds a {type(value).__name__}; columns must be plain "
        "data (strings, numbers, booleans, null, lists, objects)"
    )


def _messages(value: Any, where: str, key: str) -> tuple:
    if not isinstance(value, (list, tuple)) or not value:
        got = "an empty list" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(
            f"{where}: '{key}' must be a non-empty list of {{role, content}} messages, got {got}"
        )
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"{where}: '{key}' message {i} must be an object with role and content, "
                f"got {type(m).__name__}"
            )
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = "missing" if field not in m else type(m[field]).__name__
                raise ValueError(
                    f"{where}: '{key}' message {i}: '{field}' must be a string ({got})"
                )
    return tuple(dict(m) for m in value)


def _problem(row: dict, where: str, uid: str, d: DataConfig) -> MathProblem:
    """One checked row as a problem (see the module notes)."""
    prompt_key = d.prompt_key or d.messages_key
    for key in (prompt_key, d.answer_key):
        if key not in row:
            raise ValueError(f"{where}: missing key '{key}' (keys: {', '.join(sorted(row))})")
    for key, value in row.items():
        _check_plain(value, where, key)
    answer = row[d.answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(
            f"{where}: '{d.answer_key}' must be a string or a number, got {type(answer).__name__}"
        )
    answer = str(answer).strip()
    if not answer:
        raise ValueError(f"{where}: '{d.answer_key}' is empty")
    answer = normalize_number(answer) or answer
    if d.prompt_key is not None:
        prompt = row[d.prompt_key]
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: '{d.prompt_key}' must be a string, got {type(prompt).__name__}"
            )
        if not prompt.strip():
            raise ValueError(f"{where}: '{d.prompt_key}' is empty")
        return MathProblem(prompt.strip(), answer, uid, None, dict(row))
    messages = _messages(row[d.messages_key], where, d.messages_key)
    users = [m["content"] for m in messages if m["role"] == "user"]
    question = (users or [messages[-1]["content"]])[-1].strip()
    return MathProblem(question, answer, uid, messages, dict(row))


def _problems(split: _Split, d: DataConfig) -> list[MathProblem]:
    """Every row of ``split`` checked and made a problem (uid: task, split, row index)."""
    return [
        _problem(row, where, f"{d.task}/{split.name}/{i}", d)
        for i, (where, row) in enumerate(split.rows)
    ]


def _draw(n: int, size: Optional[int], seed: int, what: str, label: str) -> list[int]:
    """Sorted row indices: ``size`` of ``range(n)`` drawn with ``seed`` (None: all)."""
    if size is None:
        return list(range(n))
    if size > n:
        hint = " (null: all of them)" if what == "data.train_size" else ""
        raise ValueError(f"{what} = {size} exceeds the {n} rows of {label}{hint}")
    return sorted(random.Random(seed).sample(range(n), size))


def load_user_data(d: DataConfig) -> tuple[list[MathProblem], list[MathProblem]]:
    """Training and held-out problems of a ``jsonl`` or ``hf`` task.

    Parameters
    ----------
    d : DataConfig
        ``task`` is ``"jsonl"`` or ``"hf"``; ``path``, ``prompt_key`` or ``messages_key``,
        ``answer_key``, the splits, sizes and seeds are read.

    Returns
    -------
    train : list of MathProblem
        ``train_size`` rows of the training split drawn with ``train_seed`` (all rows when
        None), in file order, without the held-out rows when those were drawn from it.
    held_out : list of MathProblem
        ``eval_size`` rows, in file order: drawn with ``eval_seed`` from the eval split
        when there is one, else from the training split. uids are
        ``"<task>/<split>/<row index from 0>"`` (the file's stem for a single file).

    Raises
    ------
    FileNotFoundError
        ``path`` is not there, or its folder has no ``{train_split}.jsonl``.
    ValueError
        One line naming the file (or dataset and split), the row and the key: invalid JSON,
        a row that is not an object, a missing prompt/messages/answer key, a non-string or
        empty prompt, malformed messages, an answer that is not a string or number, a column
        that is not plain data, an empty file; or ``train_size`` / ``eval_size`` above the
        rows there are, or ``task_kwargs`` given.
    ImportError
        ``task`` is ``"hf"`` and ``datasets`` is not installed.
    """
    if d.task_kwargs:
        raise ValueError(
            f"data.task_kwargs: task '{d.task}' takes none, got '{next(iter(d.task_kwargs))}' "
            "(data.task_kwargs={} clears those of the config)"
        )
    train, held_out = (_jsonl_splits if d.task == "jsonl" else _hf_splits)(d)
    rows = _problems(train, d)
    if held_out is not None:
        pool = _problems(held_out, d)
        picked = _draw(len(pool), d.eval_size, d.eval_seed, "data.eval_size", held_out.label)
        eval_problems = [pool[i] for i in picked]
        rest, where = rows, train.label
    else:
        if d.eval_size >= len(rows):
            raise ValueError(
                f"data.eval_size = {d.eval_size} leaves no training rows of the {len(rows)} "
                f"rows of {train.label} (without a '{d.eval_split}' split the held-out rows "
                "are drawn from these)"
            )
        picked = _draw(len(rows), d.eval_size, d.eval_seed, "data.eval_size", train.label)
        eval_problems = [rows[i] for i in picked]
        taken = set(picked)
        rest = [p for i, p in enumerate(rows) if i not in taken]
        where = f"{train.label} left after the {d.eval_size} held-out rows"
    picked = _draw(len(rest), d.train_size, d.train_seed, "data.train_size", where)
    return [rest[i] for i in picked], eval_problems
