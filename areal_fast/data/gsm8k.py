"""GSM8K loader: local ``.jsonl`` files, or a Hugging Face dataset id (needs ``datasets``).

Each row holds ``question`` and ``answer``; the answer is a worked solution whose last
line is ``#### <number>`` (the number may contain thousands commas, e.g. ``#### 1,234``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_fast.data.jsonl import jsonl_rows
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import normalize_number

_FINAL_ANSWER_RE = re.compile(r"####\s*([^\n]*?)\s*$")


def parse_gsm8k_answer(solution: str) -> str | None:
    """Canonical final answer of a GSM8K solution.

    Parameters
    ----------
    solution : str
        The ``answer`` field, ending with ``#### <number>``.

    Returns
    -------
    str or None
        The number after the last ``####``, normalised (``"1,234"`` -> ``"1234"``);
        ``None`` if there is no ``####`` or what follows it is not a number.
    """
    if not isinstance(solution, str) or "####" not in solution:
        return None
    tail = solution[solution.rfind("####") :]
    match = _FINAL_ANSWER_RE.match(tail.strip())
    return normalize_number(match.group(1)) if match else None


def _problem_from_row(row: Any, where: str, uid: str) -> MathProblem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if key not in row:
            raise ValueError(f"{where}: missing key '{key}' (keys: {sorted(row)})")
        if not isinstance(row[key], str):
            raise ValueError(f"{where}: '{key}' must be a string, got {type(row[key]).__name__}")
    answer = parse_gsm8k_answer(row["answer"])
    if answer is None:
        last_line = row["answer"].strip().splitlines()[-1] if row["answer"].strip() else ""
        raise ValueError(
            f"{where}: answer does not end with '#### <number>' (last line: {last_line[:80]!r})"
        )
    return MathProblem(question=row["question"].strip(), answer=answer, uid=uid)


def _read_jsonl(path: Path, split_label: str) -> list[MathProblem]:
    return [
        _problem_from_row(row, where, f"gsm8k/{split_label}/{i}")
        for i, (where, row) in enumerate(jsonl_rows(path))
    ]


def _read_hub(dataset_id: str, split: str) -> list[MathProblem]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"'{dataset_id}' is neither a local file nor a directory; loading it as a Hugging "
            "Face dataset needs `pip install datasets`, or pass a local GSM8K .jsonl file or "
            "folder instead"
        ) from None
    # openai/gsm8k has two configurations ("main", "socratic"); other copies usually one.
    config = "main" if dataset_id.rstrip("/").split("/")[-1] == "gsm8k" else None
    rows: Iterable[dict] = datasets.load_dataset(dataset_id, config, split=split)
    problems = [
        _problem_from_row(row, f"{dataset_id} [{split}] row {i}", f"gsm8k/{split}/{i}")
        for i, row in enumerate(rows)
    ]
    if not problems:
        raise ValueError(f"{dataset_id} [{split}]: split holds no rows")
    return problems


def _looks_like_path(source: str) -> bool:
    return (
        source.endswith((".jsonl", ".json"))
        or source.startswith(("/", ".", "~"))
        or source.count("/") > 1
    )


def is_dataset_id(source: str) -> bool:
    """Whether :func:`load_gsm8k` reads ``source`` from the Hugging Face hub (with the
    ``datasets`` package) rather than from a local file or folder."""
    return not Path(source).expanduser().exists() and not _looks_like_path(source)


def load_gsm8k(source: str, split: str = "train") -> list[MathProblem]:
    """Load GSM8K problems.

    Parameters
    ----------
    source : str
        One of: a ``.jsonl`` file; a directory holding ``{split}.jsonl``; or a Hugging
        Face dataset id such as ``"openai/gsm8k"`` (needs the optional ``datasets``
        package; the ``"main"`` configuration is used for ids ending in ``gsm8k``).
    split : str, optional
        Which split to read (``"train"`` or ``"test"``). For a directory or dataset id it
        selects the data; for a file, the file's stem labels the uids instead
        (``test.jsonl`` -> ``"gsm8k/test/<i>"``). Default ``"train"``.

    Returns
    -------
    list of MathProblem
        In file order; ``uid`` is ``"gsm8k/<split>/<row index from 0>"`` and ``answer``
        the normalised number after ``####``.

    Raises
    ------
    FileNotFoundError
        If ``source`` looks like a path that does not exist, or the directory has no
        ``{split}.jsonl``.
    ValueError
        On an invalid JSON row, a row that is not an object, a missing or non-string
        ``question``/``answer``, an answer without a parseable ``#### <number>``, or an
        empty file. The message names the file and the 1-based line number.
    ImportError
        If ``source`` is a dataset id and ``datasets`` is not installed.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return _read_jsonl(path, split_label=path.stem)
    if path.is_dir():
        split_file = path / f"{split}.jsonl"
        if not split_file.is_file():
            found = sorted(p.name for p in path.glob("*.jsonl"))
            raise FileNotFoundError(
                f"GSM8K split file not found: {split_file} (.jsonl files there: {found or 'none'})"
            )
        return _read_jsonl(split_file, split_label=split)
    if _looks_like_path(source):
        raise FileNotFoundError(f"GSM8K file or directory not found: {source}")
    return _read_hub(source, split)
