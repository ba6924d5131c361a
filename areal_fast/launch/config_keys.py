"""Every key of a nested config dataclass with its type, default and meaning.

Knows no particular config: the caller passes the root dataclass (the launcher's
:class:`~areal_fast.launch.config.ExperimentConfig` for its key checks,
:mod:`areal_fast.launch.config_reference` for the printed and written reference).

A key's meaning is the ``#`` comment beside its field in the source (the comment lines
right above the field, then the one at its end), or else its entry in the "Attributes" /
"Parameters" section of the dataclass's docstring. A field without either is a bug:
:func:`config_keys` raises, and the tests build the reference.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import re
import tokenize
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

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


def sections(root: type, strict: bool = True) -> list[Section]:
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


def config_keys(root: type, strict: bool = True) -> list[ConfigKey]:
    """Every leaf key of the config (see :func:`sections`), in reference order."""
    return [key for section in sections(root, strict) for key in section.keys]
