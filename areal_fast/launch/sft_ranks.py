"""The trainer ranks of an ``areal-fast sft`` run: this process is rank 0, and with
``scheduler.train_world_size`` > 1 the other ranks are spawned processes that run the same
loop on their share of each step's rows (FSDP2 over gloo on the CPU, NCCL on GPUs).

Rank 0 alone writes the run directory (metrics, sinks, evaluations, summary); the weights,
checkpoints and the final model are written collectively. A rank that fails makes the
others fail at their next collective, after at most ``scheduler.dist_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    """This process's place among the trainer ranks.

    Attributes
    ----------
    rank : int
        In ``[0, world_size)``; 0 is the launching process.
    world_size : int
        ``scheduler.train_world_size``.
    init_method : str
        The ranks' rendezvous (``tcp://127.0.0.1:<port>``); "" for one rank.
    """

    rank: int = 0
    world_size: int = 1
    init_method: str = ""

    @property
    def main(self) -> bool:
        """Whether this is rank 0, the one that writes the run directory."""
        return self.rank == 0

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective; the value itself with one rank)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank is here (nothing with one rank)."""
        if self.world_size > 1:
            dist.barrier()

    def rows(self, rows: list) -> list:
        """This rank's share of a step's rows: every ``world_size``-th from ``rank``."""
        return rows[self.rank :: self.world_size]


def rank_threads(threads: int | None, world_size: int) -> int:
    """torch threads of each rank: ``threads`` (or the cores) divided among the ranks."""
    return max(1, (threads or os.cpu_count() or 1) // world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: Callable, args: tuple, rank: Rank) -> None:
    """A spawned rank: ``target(*args, rank)``; a failure prints its traceback and exits 1."""
    try:
        target(*args, rank)
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        end_group()


def end_group() -> None:
    """Leave the trainer ranks' process group, when this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def started_ranks(world_size: int, target: Callable, args: tuple):
    """Spawn ranks 1..world_size-1, each running ``target(*args, Rank(r, ...))``; yields this
    process's :class:`Rank` (0). At the end of the block the ranks are joined (killed when
    the block raised) and the process group is left.

    Raises
    ------
    RuntimeError
        After a block that succeeded, a rank exited with an error.
    """
    if world_size == 1:
        yield Rank()
        return
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(target, args, Rank(r, world_size, init_method)))
        for r in range(1, world_size)
    ]
    for proc in procs:
        proc.start()
    ok = False
    try:
        yield Rank(0, world_size, init_method)
        ok = True
    finally:
        end_group()
        for proc in procs:
            proc.join(timeout=60 if ok else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failed = [r for r, p in enumerate(procs, start=1) if p.exitcode not in (0, None)]
    if failed:
        raise RuntimeError(
            f"trainer rank {failed[0]} exited with code {procs[failed[0] - 1].exitcode}"
        )


def set_threads(threads: int | None, world_size: int) -> None:
    """Set this rank's torch threads (:func:`rank_threads`)."""
    torch.set_num_threads(rank_threads(threads, world_size))
