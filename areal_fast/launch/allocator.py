"""The trainer processes' memory allocator (``launcher.allocator``).

glibc's malloc raises its mapping threshold (up to 32 MiB) each time a mapped block is freed,
and from then on serves activation-sized blocks from its heap, where blocks of changing sizes
leave holes the next ones do not fit: measured on the default job's batch (demo model, one
thread), the LoRA trainer's heap reached 7.5 GB for 4.2 GB of live blocks, and its peak
resident set exceeded full fine-tuning's. mimalloc (Microsoft; the ``cmeel-mimalloc`` wheel)
serves blocks by size class and keeps no such holes. It is loaded into a trainer process with
``LD_PRELOAD`` when the process starts, and told never to return freed pages to the system
(``MIMALLOC_PURGE_DELAY=-1``), so a step's blocks are reused without fresh page faults. The
measurements are in docs/lora.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Optional

ALLOCATORS = ("auto", "mimalloc", "system")


def mimalloc_library() -> Optional[str]:
    """Path of ``libmimalloc.so`` from the installed ``cmeel-mimalloc`` distribution, or
    None where it is not installed (or not a Linux build)."""
    try:
        dist = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == "libmimalloc.so":
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    return None


def trainer_environment(allocator: str) -> dict[str, str]:
    """Environment variables that a trainer process starts with for ``allocator``.

    ``auto``: mimalloc on Linux where :func:`mimalloc_library` finds it, else nothing;
    ``mimalloc``: mimalloc or an error; ``system``: nothing (the C library's malloc). A
    library the user already preloads stays, after mimalloc; a ``MIMALLOC_PURGE_DELAY`` the
    user set is kept.

    Returns
    -------
    dict[str, str]
        ``LD_PRELOAD`` and ``MIMALLOC_PURGE_DELAY``, or empty.

    Raises
    ------
    ValueError
        ``allocator`` is not one of :data:`ALLOCATORS`, or is ``mimalloc`` where the library
        is not installed or the platform is not Linux (named, with the package to install).
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"launcher.allocator = {allocator!r} is not one of {ALLOCATORS}")
    if allocator == "system":
        return {}
    library = mimalloc_library() if sys.platform.startswith("linux") else None
    if library is None:
        if allocator == "mimalloc":
            raise ValueError(
                "launcher.allocator = 'mimalloc': libmimalloc.so not found "
                "(Linux only; pip install cmeel-mimalloc)"
            )
        return {}
    preloaded = os.environ.get("LD_PRELOAD", "")
    return {
        "LD_PRELOAD": f"{library} {preloaded}".strip() if library not in preloaded else preloaded,
        "MIMALLOC_PURGE_DELAY": os.environ.get("MIMALLOC_PURGE_DELAY", "-1"),
    }


def loaded_allocator(pid: int | str = "self") -> str:
    """``mimalloc`` when process ``pid`` has libmimalloc mapped, else ``system`` (Linux:
    read from ``/proc/<pid>/maps``; ``system`` where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "mimalloc" if "libmimalloc" in maps.read() else "system"
    except OSError:
        return "system"


_EXEC_MARK = "AREAL_FAST_ALLOCATOR_EXEC"  # set in a process this module started again


def exec_under(allocator: str, argv: list[str]) -> None:
    """Start this command again in this process (same pid, :func:`os.execve`): the
    interpreter runs :func:`areal_fast.cli.main` on ``argv``, from this same package, with
    :func:`trainer_environment` of ``allocator``, when that asks for mimalloc and it is not
    loaded yet; otherwise return at once.

    For a command whose own process trains (``areal-fast sft``): ``LD_PRELOAD`` takes effect
    only when a process starts. Call it before the command has done anything it would redo.
    Started once at most: a process this function started never starts itself again, even
    where the library failed to load.

    Raises
    ------
    ValueError
        As :func:`trainer_environment`.
    """
    env = trainer_environment(allocator)
    if not env or loaded_allocator() == "mimalloc" or os.environ.get(_EXEC_MARK):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # the package this process runs, first on the path (not the working directory, which
    # `python -m` would put there: a source checkout would shadow an installed wheel)
    root = str(Path(__file__).resolve().parents[2])
    code = f"import sys; sys.path[0] = {root!r}; from areal_fast.cli import main; sys.exit(main())"
    os.execve(
        sys.executable, [sys.executable, "-c", code, *argv], {**os.environ, **env, _EXEC_MARK: "1"}
    )
