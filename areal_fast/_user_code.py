"""Importing user code named by a config key: ``"module:name"`` or ``"file.py:name"``
(``reward.path``, ``agent.path``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def import_attribute(path: str, key: str) -> object:
    """The object ``name`` of the module or Python file that ``path`` names.

    A file is imported once per process, like a module: later calls return the same module
    (the file's path is resolved against the working directory).

    Parameters
    ----------
    path : str
        ``"module:name"`` or ``"file.py:name"``.
    key : str
        The config key that holds ``path``, named in every error (e.g. ``"reward.path"``).

    Raises
    ------
    ValueError
        One line naming ``key``: ``path`` has no ``:``, the file does not exist, the module
        cannot be imported (the first line of its error), or it has no ``name``.
    """
    where, _, name = path.rpartition(":")
    if not where or not name:
        raise ValueError(f"{key} = {path!r} must be 'module:function' or 'file.py:function'")
    try:
        if where.endswith(".py"):
            module = _import_file(Path(where))
        else:
            module = importlib.import_module(where)
    except FileNotFoundError:
        raise ValueError(
            f"{key} = {path!r}: no file {where!r} (relative to {Path.cwd()})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(
            f"{key} = {path!r}: cannot import {where!r} ({type(exc).__name__}: {message})"
        ) from exc
    if not hasattr(module, name):
        raise ValueError(f"{key} = {path!r}: {where!r} has no {name!r}")
    return getattr(module, name)


def _import_file(file: Path):
    """The module of the Python file ``file``, imported once per process."""
    if not file.is_file():
        raise FileNotFoundError(file)
    module_name = f"areal_fast_user_{file.stem}_{abs(hash(str(file.resolve()))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
