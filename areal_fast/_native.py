"""Access to the compiled extension ``areal_fast._C``.

Every op that has a native implementation also has a pure-Python/torch one, so
the extension is optional: :func:`load_native` returns the module, or ``None``
when it is missing (e.g. a source checkout that was never built) or disabled.

Set ``AREAL_FAST_DISABLE_NATIVE=1`` to force the Python implementations, for
example to compare the two or to rule the extension out while debugging. Set
``AREAL_FAST_REQUIRE_NATIVE=1`` to make a missing extension an ``ImportError`` instead of a
warning (CI does, so that a broken build cannot pass as skips and fallbacks).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

DISABLE_ENV = "AREAL_FAST_DISABLE_NATIVE"
REQUIRE_ENV = "AREAL_FAST_REQUIRE_NATIVE"
_TRUE_VALUES = frozenset({"1", "true", "yes", "on"})


def native_disabled() -> bool:
    """True when ``AREAL_FAST_DISABLE_NATIVE`` is set to 1/true/yes/on (read on every call)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE_VALUES


def native_required() -> bool:
    """True when ``AREAL_FAST_REQUIRE_NATIVE`` is set to 1/true/yes/on (read on every call)."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in _TRUE_VALUES


@functools.lru_cache(maxsize=None)
def _import_native() -> ModuleType | None:
    try:
        import areal_fast._C as _C  # the compiled module (torch.compile traces this form)
    except ImportError as exc:
        if native_required():
            message = unavailable_message(exc, fallback=False)
            raise ImportError(f"{REQUIRE_ENV}=1: {message}") from exc
        warnings.warn(unavailable_message(exc), RuntimeWarning, stacklevel=3)
        return None
    return _C


def _has_extension(package_dir: Path) -> bool:
    return any(package_dir.glob("_C.*")) or any(package_dir.glob("_C*.so"))


def installed_package_dir() -> Path | None:
    """Folder of the installed ``areal_fast`` distribution's package, or None when no
    distribution is installed (e.g. a source checkout on ``PYTHONPATH``)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("areal_fast")
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("areal_fast")))
    return path if (path / "__init__.py").is_file() else None


def unavailable_message(exc: BaseException, fallback: bool = True) -> str:
    """Why ``areal_fast._C`` could not be imported and what to do, in one line.

    Names the folder this process imported ``areal_fast`` from. When that folder is not the
    installed distribution's and the installed one has the extension, the cause is a source
    tree shadowing it (typically the current directory on ``sys.path``: running
    ``python -m ...`` from a checkout), not a missing compiler.

    Parameters
    ----------
    exc : BaseException
        The import error.
    fallback : bool
        Say that the Python implementations run instead (a warning); False when the import
        error is raised (``AREAL_FAST_REQUIRE_NATIVE``).
    """
    imported = Path(__file__).resolve().parent  # the imported areal_fast package
    instead = "; using the slower Python implementations." if fallback else "."
    head = (
        f"areal_fast native extension is unavailable ({exc!r}){instead} areal_fast was "
        f"imported from {imported}"
    )
    installed = installed_package_dir()
    if installed is not None and installed.resolve() != imported and _has_extension(installed):
        return (
            f"{head}, which shadows the installed areal_fast at {installed} (it has the "
            f"extension): run from another directory or remove {imported.parent} from "
            f"sys.path / PYTHONPATH."
        )
    return (
        f"{head}, which has no built extension: reinstall areal_fast with a C++ compiler "
        f"(pip install .) to build it."
    )


def load_native() -> ModuleType | None:
    """Return the ``areal_fast._C`` extension module, or ``None``.

    ``None`` when ``AREAL_FAST_DISABLE_NATIVE`` is set (silently) or when the
    import fails; the failure is reported once per process with a
    ``RuntimeWarning`` that carries the import error.

    Raises
    ------
    ImportError
        The import failed and ``AREAL_FAST_REQUIRE_NATIVE`` is set (the message says why and
        which folder ``areal_fast`` came from). Not cached: every call raises again.
    """
    if native_disabled():
        return None
    return _import_native()
