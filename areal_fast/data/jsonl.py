"""Reading JSON-lines files row by row, each row named by file and line for error messages."""

from __future__ import annotations

import json
from pathlib import Path


def jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    """The rows of the JSON-lines file ``path``: ``(where, row)`` pairs, ``where`` being
    ``"<path> line <n>"`` (1-based); blank lines are skipped.

    Raises
    ------
    ValueError
        One line naming file and line: invalid JSON (the column counts from the line's start),
        a row that is not a JSON object, or a file without rows.
    OSError
        The file cannot be read.
    """
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    if not rows:
        raise ValueError(f"{path}: file holds no rows")
    return rows
