"""Access to the compiled extension ``areal_fast._C``.

Every op that has a native implementation also has a pure-Python/torch one, so
the extension is optional: :func:`load_native` returns the module, or ``None``
when it is missing (e.g. a source checkout that was never built) or disabled.

Set ``AREAL_FAST_DISABLE_NATIVE=1`` to force the Python implementations, for
example to compare the two or to rule the extension out while debugging.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

DISABLE_ENV = "AREAL_FAST_DISABLE_NATIVE"
_TRUE_VALUES = frozenset({"1", "true", "yes", "on"})


def native_disabled() -> bool:
    """True when ``AREAL_FAST_DISABLE_NATIVE`` is set to 1/true/yes/on (read on every call)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE_VALUES


@functools.lru_cache(maxsize=None)
def _import_native() -> ModuleType | None:
    try:
        from areal_fast import _C
    except ImportError as exc:
        warnings.warn(
            f"areal_fast native extension is unavailable ({exc!r}); using the slower Python "
            f"implementations. Reinstall areal_fast with a C++ compiler to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return _C


def load_native() -> ModuleType | None:
    """Return the ``areal_fast._C`` extension module, or ``None``.

    ``None`` when ``AREAL_FAST_DISABLE_NATIVE`` is set (silently) or when the
    import fails; the failure is reported once per process with a
    ``RuntimeWarning`` that carries the import error.
    """
    if native_disabled():
        return None
    return _import_native()
