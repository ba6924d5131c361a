"""Every config key with its type, default and meaning, read from the config dataclasses.

One generator, two outputs: ``areal-fast config`` prints the plain-text table
(:func:`render_text`) and ``docs/config.md`` is :func:`render_markdown`'s output, written by

    python -m areal_fast.launch.config_reference --write docs/config.md

A key's meaning is the ``#`` comment beside its field in the source (the comment lines
right above the field, then the one at its end), or else its entry in the "Attributes" /
"Parameters" section of the dataclass's docstring. A field without either is a bug:
:func:`config_keys` raises, and the tests build the reference.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

REGENERATE = "python -m areal_fast.launch.config_reference --write docs/config.md"
TOP_LEVEL = "top level"


@dataclass(frozen=True)
class ConfigKey:
    """One leaf key of :class:`~areal_fast.launch.config.ExperimentConfig`.

    Attributes
    ----------
    key : str
        Dotted key as written on the command line, e.g. ``"actor.optim.lr"``.
    section : str
        Dotted section (``"actor.optim"``), or ``"top level"``.
    type : str
        The annotation, written plainly (``"int | None"``, ``"dict"``, ``"list[str]"``).
    default : str
        The default as YAML/JSON would write it (``null``, ``true``, ``"text"``, ``1e-05``).
    meaning : str
        What the key does (never empty).
    """

    key: str
    section: str
    type: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Section:
    """A nested dataclass of the config: its dotted name, what it is, and its keys."""

    name: str
    about: str
    keys: tuple[ConfigKey, ...]


def _type_name(hint) -> str:
    """``Optional[int]`` -> ``"int | None"``, ``Dict[str, Any]`` -> ``"dict"``, ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | None" if type(None) in args else "")
    if origin in (dict, typing.Dict):
        return "dict"
    if origin in (list, typing.List):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if hint is typing.Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def _default_text(f) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return json.dumps(value, ensure_ascii=False)


def _clean(text: str) -> str:
    """One line: RST double backticks become single ones, whitespace collapses."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text.replace("``", "`"))
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def _source_comments(path: str) -> tuple[dict[int, str], frozenset[int]]:
    """``{line: comment text}`` of a source file, and the lines that hold only a comment."""
    text = Path(path).read_text(encoding="utf-8")
    comments, alone = {}, set()
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            comments[line] = tok.string.lstrip("#").strip()
            if not lines[line - 1][: tok.start[1]].strip():
                alone.add(line)
    return comments, frozenset(alone)


def _docstring_entries(doc: str) -> dict[str, str]:
    """``{name: description}`` of a numpy-style "Attributes" or "Parameters" section."""
    entries: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    in_section, name = False, None
    for i, line in enumerate(lines):
        underline = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
        if underline:
            in_section, name = line.strip() in ("Attributes", "Parameters"), None
            continue
        if not in_section or set(line.strip()) == {"-"}:
            continue
        head = re.match(r"^(\w+)\s*:", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            entries[name] = ""
        elif name and line.startswith(" "):
            entries[name] = f"{entries[name]} {line.strip()}".strip()
    return entries


def field_meanings(cls) -> dict[str, str]:
    """What each field of dataclass ``cls`` means, from its source comments or docstring.

    Parameters
    ----------
    cls : type
        A dataclass defined at module level.

    Returns
    -------
    dict of str to str
        Field name -> one-line meaning ("" when the source says nothing).
    """
    path = inspect.getsourcefile(cls)
    comments, alone = _source_comments(path)
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    from_doc = _docstring_entries(cls.__doc__ or "")
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line in alone:
            above.insert(0, comments[line])
            line -= 1
        beside = [
            comments[n]
            for n in range(stmt.lineno, stmt.end_lineno + 1)
            if n in comments and n not in alone
        ]
        text = " ".join(above + beside) or from_doc.get(stmt.target.id, "")
        out[stmt.target.id] = _clean(text)
    return out


def _about(cls) -> str:
    """A section's title: the first paragraph of its dataclass's docstring, on one line (the
    comment beside the section's field in the parent, a shorter name, is not repeated)."""
    return _clean(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0])


def sections(root=None, strict: bool = True) -> list[Section]:
    """The config's sections, depth first in field order, the top level first.

    Parameters
    ----------
    root : type, optional
        The root dataclass; default :class:`~areal_fast.launch.config.ExperimentConfig`.
    strict : bool
        Raise on a field without a meaning (the reference and its tests); False leaves its
        meaning empty (key lookups such as "did you mean").

    Returns
    -------
    list of Section

    Raises
    ------
    ValueError
        With ``strict``: a field has no meaning (no comment, no docstring entry), naming the
        dotted key.
    """
    if root is None:
        from areal_fast.launch.config import ExperimentConfig as root
    out: list[Section] = []

    def walk(cls, prefix: str, about: str) -> None:
        hints = typing.get_type_hints(cls)
        try:
            meanings = field_meanings(cls)
        except (OSError, TypeError):  # no source to read (only without strict)
            if strict:
                raise
            meanings = {}
        keys, nested = [], []
        for f in fields(cls):
            dotted = f"{prefix}{f.name}"
            if is_dataclass(hints[f.name]):
                nested.append((hints[f.name], f"{dotted}."))
                continue
            if strict and not meanings.get(f.name):
                raise ValueError(
                    f"config key {dotted!r} has no meaning: write a # comment "
                    f"beside {cls.__name__}.{f.name}"
                )
            keys.append(
                ConfigKey(
                    dotted,
                    prefix.rstrip(".") or TOP_LEVEL,
                    _type_name(hints[f.name]),
                    _default_text(f),
                    meanings.get(f.name, ""),
                )
            )
        out.append(Section(prefix.rstrip(".") or TOP_LEVEL, about, tuple(keys)))
        for sub_cls, sub_prefix in nested:
            walk(sub_cls, sub_prefix, _about(sub_cls))

    walk(root, "", _about(root))
    return out


def config_keys(root=None, strict: bool = True) -> list[ConfigKey]:
    """Every leaf key of the config (see :func:`sections`), in reference order."""
    return [key for section in sections(root, strict) for key in section.keys]


def section_index() -> str:
    """Every section and its keys, for ``areal-fast train --help`` (one line per section)."""
    lines = []
    for section in sections(strict=False):
        prefix = "" if section.name == TOP_LEVEL else f"{section.name}."
        names = ", ".join(k.key[len(prefix) :] for k in section.keys)
        lines.append(
            textwrap.fill(
                f"{section.name}: {names}", 100, initial_indent="  ", subsequent_indent="      "
            )
        )
    return "\n".join(lines)


def render_text(width: int = 100) -> str:
    """Plain-text reference: per section, ``key  type  default`` then the wrapped meaning."""
    parts = []
    for section in sections():
        parts.append(f"[{section.name}]  {section.about}")
        for key in section.keys:
            parts.append(f"  {key.key}  ({key.type}) = {key.default}")
            parts.append(
                textwrap.fill(
                    key.meaning, width, initial_indent="      ", subsequent_indent="      "
                )
            )
        parts.append("")
    return "\n".join(parts)


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped; outside code spans a ``<`` that could open an HTML
    tag (``<run dir>``) becomes ``&lt;``."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"<(?=[A-Za-z/])", "&lt;", parts[i])
    return "`".join(parts)


def render_markdown() -> str:
    """``docs/config.md``: how keys are set, then a table per section."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by",
        f"`{REGENERATE}`; `areal-fast config`",
        "prints the same reference. Do not edit this file by hand: edit the `#` comment beside",
        "the field and regenerate.",
        "",
        "Keys are set in a YAML file given with `--config` (nested mappings) and on the",
        "command line as dotted `key=value` items, which win over the file:",
        "`areal-fast train --config examples/arith.yaml actor.optim.lr=2e-5 total_steps=5`.",
        "Values are YAML: `null` for none, `true`/`false`, `[a, b]` for a list, `{k: v}` for",
        "a mapping. A mapping given on the command line is merged into the file's, except",
        "`key={}`, which empties it (e.g. `data.task_kwargs={}`). An unknown key stops the run",
        "with the closest known key (`did you mean ...?`).",
        "",
        "Sections: "
        + ", ".join(f"[{s.name}](#{s.name.replace('.', '').replace(' ', '-')})" for s in sections())
        + ".",
        "",
    ]
    for section in sections():
        out += [
            f"## {section.name}",
            "",
            _cell(section.about),
            "",
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        out += [
            f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.meaning)} |"
            for k in section.keys
        ]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m areal_fast.launch.config_reference [--markdown] [--write FILE]``."""
    parser = argparse.ArgumentParser(
        prog="python -m areal_fast.launch.config_reference",
        description="Print or write the config reference.",
    )
    parser.add_argument("--markdown", action="store_true", help="print markdown")
    parser.add_argument("--write", metavar="FILE", help="write the markdown to FILE")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(render_markdown(), encoding="utf-8")
        print(f"wrote {args.write}")
    else:
        print(render_markdown() if args.markdown else render_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
