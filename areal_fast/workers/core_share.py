"""Cores of one node shared between the processes that have work: the trainer takes the cores
an idle rollout worker leaves, and the other way round (``launcher.share_cores``).

The launcher creates a small table in shared memory (:func:`create_table`), one slot per
worker process: its pid and until when (``time.monotonic_ns``, the same clock in every
process of the node) it has work. Each process marks its slot (:class:`CoreShare`): the
trainer for the whole of a train step (:meth:`CoreShare.working`), a rollout worker at every
forward of its engine's model (:meth:`CoreShare.pulse`: work for a short lease) and while it
installs weights. At fine points of its work (each decoder layer's forward, each layer's
backward, the optimizer step, each decode step) a process sets its torch threads to
:func:`threads_wanted`: all the cores while every other slot is idle, its configured share
while others work (never fewer, so the configured split without oversubscription is what
remains when every process is busy). A check reads the mapped table (no system call) and
calls ``torch.set_num_threads`` only when the count changes. The hooks and the worker
processes' start are in :mod:`areal_fast.workers.core_hooks`.

``torch.set_num_threads`` sets the OpenMP and MKL thread counts of the calling thread (and
the count later threads start with), so each check runs in the thread that computes: the
trainer's main thread (autograd runs a CPU backward, with its hooks, in the thread that calls
``backward``), the engine thread of an HF engine (its forward pre-hooks).

Leases make a dead process harmless: its slot counts as idle once its lease has run out
(``pulse_lease`` seconds after its last decode step, ``hold_lease`` seconds after the last
check of a train step), and a restarted worker claims its slot afresh.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from areal_fast.sync.shared_memory import shm_dir

MAGIC = 0x41524C43  # "ARLC": the table's first int64
_HEADER = 2  # int64s before the slots: MAGIC, number of slots
_SLOT = 2  # int64s per slot: pid, working until (monotonic ns; 0: idle)
_NEVER_IDLE = 2**63 - 1
PREFIX = "areal_fast-cores-"


def threads_wanted(share: int, others_working: int, cores: int) -> int:
    """Torch threads of a process that has work.

    Parameters
    ----------
    share : int
        The process's configured threads (``launcher.*_threads`` as derived), >= 1.
    others_working : int
        Sum of the configured threads of the other processes that have work now.
    cores : int
        Cores the processes share.

    Returns
    -------
    int
        ``max(share, cores · share // (share + others_working))``: every core when no other
        process works, else a part of the cores in proportion to the shares of those that
        do, never below ``share``.
    """
    return max(share, cores * share // (share + others_working))


@dataclass(frozen=True)
class CoreShareSpec:
    """One process's place in a node's core table (picklable).

    Attributes
    ----------
    path : str
        The table's file (made by :func:`create_table`).
    slot : int
        This process's slot; -1 in the launcher's template (no process).
    shares : tuple[int, ...]
        Configured torch threads of the process of every slot.
    cores : int
        Cores the processes share.

    Raises
    ------
    ValueError
        An empty ``shares``, a share or ``cores`` below 1, a ``slot`` out of range.
    """

    path: str
    slot: int
    shares: tuple[int, ...]
    cores: int

    def __post_init__(self):
        if not self.shares or min(self.shares) < 1 or self.cores < 1:
            raise ValueError(
                f"core table {self.path}: shares {self.shares} and cores {self.cores} "
                f"must be >= 1 (one share per slot)"
            )
        if not -1 <= self.slot < len(self.shares):
            raise ValueError(f"core table {self.path}: slot {self.slot} of {len(self.shares)}")

    def for_slot(self, slot: int) -> "CoreShareSpec":
        """This table's spec for the process of ``slot``."""
        return CoreShareSpec(self.path, slot, self.shares, self.cores)


def create_table(shares: tuple[int, ...], cores: int, directory: Optional[str] = None):
    """Create a zeroed core table (every slot idle) for processes with ``shares`` threads.

    The file is ``<directory>/areal_fast-cores-<this pid>-<random>`` (default: /dev/shm,
    else the temporary directory); tables whose creating process is gone are deleted first.

    Returns
    -------
    CoreShareSpec
        The template (``slot`` -1); :meth:`CoreShareSpec.for_slot` gives each process its
        own.

    Raises
    ------
    ValueError
        Bad ``shares`` or ``cores`` (see :class:`CoreShareSpec`).
    OSError
        The file cannot be written.
    """
    folder = Path(directory) if directory else shm_dir()
    remove_orphaned_tables(str(folder))
    path = folder / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    spec = CoreShareSpec(str(path), -1, tuple(int(s) for s in shares), int(cores))
    header = [MAGIC, len(shares)] + [0] * (_SLOT * len(shares))
    path.write_bytes(b"".join(v.to_bytes(8, sys.byteorder, signed=True) for v in header))
    return spec


def remove_table(spec: CoreShareSpec) -> None:
    """Delete the table's file (processes that still map it keep their mapping)."""
    Path(spec.path).unlink(missing_ok=True)


def remove_orphaned_tables(directory: Optional[str] = None) -> int:
    """Delete core tables whose creating process no longer exists; returns how many."""
    removed = 0
    for path in (Path(directory) if directory else shm_dir()).glob(f"{PREFIX}*-*"):
        try:
            os.kill(int(path.name[len(PREFIX) :].split("-")[0]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except (ValueError, PermissionError):
            continue
    return removed


class ThreadUse:
    """Time-weighted torch threads of one thread over one :meth:`CoreShare.working` block.

    Attributes
    ----------
    mean : float
        Mean thread count over the block's wall time (set when the block ends).
    """

    def __init__(self, threads: int):
        self.thread = threading.get_ident()
        self.start = self.last = time.monotonic_ns()
        self.threads, self.thread_ns, self.mean = threads, 0, float(threads)

    def changed(self, now: int, threads: int) -> None:
        """The count changes to ``threads`` at ``now`` (ns)."""
        self.thread_ns += self.threads * (now - self.last)
        self.last, self.threads = now, threads

    def finish(self) -> float:
        """End the block; returns :attr:`mean`."""
        now = time.monotonic_ns()
        self.changed(now, self.threads)
        self.mean = self.thread_ns / (now - self.start) if now > self.start else self.threads
        return self.mean


class FixedCores:
    """The stand-in of :class:`CoreShare` where cores are not shared: its blocks measure the
    (constant) torch threads of the calling thread."""

    @contextlib.contextmanager
    def working(self):
        """Block of work; yields a :class:`ThreadUse`."""
        use = ThreadUse(torch.get_num_threads())
        try:
            yield use
        finally:
            use.finish()

    def close(self) -> None:
        """Nothing to release."""


class CoreShare:
    """This process's slot of a core table: marks its work, sets its torch threads.

    Claiming the slot writes this pid and "idle" into it (a restarted worker's slot starts
    afresh) and sets the calling thread to the configured share.

    Parameters
    ----------
    spec : CoreShareSpec
        The table and this process's slot (>= 0).
    hold_lease, pulse_lease : float
        Seconds a :meth:`working` block's last check, and a :meth:`pulse`, count as work
        for the other processes (so a dead process's slot turns idle).

    Raises
    ------
    ValueError
        ``slot`` -1, or the file is not a core table of ``len(spec.shares)`` slots (named).
    OSError
        The file cannot be opened.
    """

    def __init__(self, spec: CoreShareSpec, hold_lease: float = 60.0, pulse_lease: float = 1.0):
        if spec.slot < 0:
            raise ValueError(f"core table {spec.path}: a process needs a slot >= 0")
        size = 8 * (_HEADER + _SLOT * len(spec.shares))
        with open(spec.path, "r+b") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise ValueError(f"core table {spec.path} is not one of {len(spec.shares)} slots")
            self._map = mmap.mmap(f.fileno(), size)
        self._view = memoryview(self._map).cast("q")
        if (self._view[0], self._view[1]) != (MAGIC, len(spec.shares)):
            self.close()
            raise ValueError(f"core table {spec.path} is not one of {len(spec.shares)} slots")
        self.spec, self.share, self.cores = spec, spec.shares[spec.slot], spec.cores
        self._own = _HEADER + _SLOT * spec.slot + 1
        self._others = [
            (_HEADER + _SLOT * i + 1, s) for i, s in enumerate(spec.shares) if i != spec.slot
        ]
        self._hold_ns, self._pulse_ns = int(hold_lease * 1e9), int(pulse_lease * 1e9)
        self._held, self._pulse_until, self._use = 0, 0, None
        self._view[self._own - 1], self._view[self._own] = os.getpid(), 0
        torch.set_num_threads(self.share)

    def others_working(self, now: Optional[int] = None) -> int:
        """Sum of the shares of the other slots whose lease runs past ``now`` (ns)."""
        now = time.monotonic_ns() if now is None else now
        return sum(share for index, share in self._others if self._view[index] > now)

    def check(self) -> int:
        """Set the calling thread's torch threads to :func:`threads_wanted` now (inside a
        :meth:`working` block the lease is renewed first); returns the count."""
        now = time.monotonic_ns()
        if self._held:
            self._view[self._own] = max(now + self._hold_ns, self._pulse_until)
        want = threads_wanted(self.share, self.others_working(now), self.cores)
        have = torch.get_num_threads()
        if want != have:
            use = self._use
            if use is not None and use.thread == threading.get_ident():
                use.changed(now, want)
            torch.set_num_threads(want)
        return want

    def pulse(self) -> int:
        """Mark work for ``pulse_lease`` seconds from now, then :meth:`check`."""
        self._pulse_until = time.monotonic_ns() + self._pulse_ns
        if not self._held:
            self._view[self._own] = self._pulse_until
        return self.check()

    def always_working(self) -> None:
        """Mark this slot as working for good: for work no hook can see (an engine without a
        torch model in this process), so the others never take its cores."""
        self._held += 1
        self._view[self._own] = self._pulse_until = _NEVER_IDLE

    @contextlib.contextmanager
    def working(self):
        """Block of work: the slot is marked working, the calling thread's threads are set
        at once and at every hook's check; afterwards the slot is idle again (unless a pulse
        lease runs on) and the thread is back at its share.

        Yields
        ------
        ThreadUse
            The calling thread's time-weighted thread count over the block.
        """
        use = ThreadUse(torch.get_num_threads())
        outer, self._use = self._use, use
        self._held += 1
        try:
            self.check()
            yield use
        finally:
            self._held -= 1
            if not self._held:
                self._view[self._own] = self._pulse_until
            if torch.get_num_threads() != self.share:
                use.changed(time.monotonic_ns(), self.share)
                torch.set_num_threads(self.share)
            use.finish()
            self._use = outer

    def close(self) -> None:
        """Mark the slot idle and unmap the table."""
        if self._map.closed:
            return
        with contextlib.suppress(AttributeError, IndexError):
            self._view[self._own] = 0
        self._view.release()
        self._map.close()
