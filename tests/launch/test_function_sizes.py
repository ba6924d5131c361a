"""The launcher stays readable: no function in ``areal_fast/launch/`` is longer than
:data:`MAX_LINES` lines (from its ``def`` line to its last line, docstring included) or takes
more than :data:`MAX_PARAMS` parameters (``self`` / ``cls`` not counted). Read from the source
with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "areal_fast" / "launch"
MAX_LINES = 80
MAX_PARAMS = 6


class Function(NamedTuple):
    """One function or method: where it is, its length in lines and its parameter count."""

    path: Path
    line: int
    name: str
    lines: int
    params: int


def functions(folder: Path) -> list[Function]:
    """Every function and method (nested ones too) of the ``*.py`` files in ``folder``."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
            names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            params = len([n for n in names if n not in ("self", "cls")])
            lines = node.end_lineno - node.lineno + 1
            found.append(Function(path, node.lineno, node.name, lines, params))
    return found


def too_big(found: list[Function], max_lines: int, max_params: int) -> list[str]:
    """One line per function over either limit: ``path:line: name (N lines, P parameters)``."""
    return [
        f"{f.path.name}:{f.line}: {f.name} ({f.lines} lines, {f.params} parameters)"
        for f in found
        if f.lines > max_lines or f.params > max_params
    ]


def test_launch_functions_are_short_and_take_few_parameters():
    found = functions(LAUNCH)
    assert len(found) > 50  # the launcher's modules were read
    breaks = too_big(found, MAX_LINES, MAX_PARAMS)
    assert not breaks, (
        f"functions in areal_fast/launch over {MAX_LINES} lines or {MAX_PARAMS} parameters "
        "(split them; group what travels together in a dataclass):\n" + "\n".join(breaks)
    )


def test_the_check_finds_a_long_function_and_a_long_parameter_list(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # def line + 80: too long
    (tmp_path / "m.py").write_text(
        f"def long():\n{body}\n\n"
        "def fits(a, b, c, d, e, f):\n    return a\n\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f):\n        return a\n\n"
        "    def many(self, a, b, c, d, e, *rest, g=1):\n        return a\n"
    )
    found = functions(tmp_path)
    assert {f.name: (f.lines, f.params) for f in found} == {
        "long": (MAX_LINES + 1, 0),
        "fits": (2, 6),
        "method": (2, 6),
        "many": (2, 7),
    }
    assert too_big(found, MAX_LINES, MAX_PARAMS) == [
        "m.py:1: long (81 lines, 0 parameters)",
        f"m.py:{MAX_LINES + 10}: many (2 lines, 7 parameters)",
    ]
