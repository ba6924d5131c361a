"""Helpers the batch script runs when the job's workers go on Ray (``slurm.placement = ray``,
the default with several nodes): a free port for the Ray head, and a wait until every node of
the allocation has joined the Ray cluster.

``python -m areal_fast.launch.slurm.ray_nodes --free-port`` prints a free TCP port of this
node; ``--address HOST:PORT --wait N`` returns once N Ray nodes are alive, or exits 1 after
``--timeout`` seconds with one line saying how many joined.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

JOIN_TIMEOUT = 300.0  # seconds for every node of the allocation to join


def free_port() -> int:
    """A TCP port no process of this node listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_for_nodes(address: str, count: int, timeout: float = JOIN_TIMEOUT) -> int:
    """Block until ``count`` nodes of the Ray cluster at ``address`` are alive.

    Returns
    -------
    int
        The nodes alive.

    Raises
    ------
    TimeoutError
        Fewer joined within ``timeout`` seconds (the message says how many, of how many).
    """
    import ray

    deadline = time.monotonic() + timeout
    while True:  # the head, started in the background, may not answer yet
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no Ray head answered at {address} within {timeout:g} s (see the "
                    f"`ray start --head` lines of the job's log)"
                ) from None
            time.sleep(1.0)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= count:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{alive} of the allocation's {count} nodes joined the Ray cluster at "
                    f"{address} within {timeout:g} s (see the srun lines of the job's log)"
                )
            time.sleep(1.0)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); exit code 0, or 1 with one line."""
    parser = argparse.ArgumentParser(prog="python -m areal_fast.launch.slurm.ray_nodes")
    parser.add_argument("--free-port", action="store_true", help="print a free TCP port")
    parser.add_argument("--address", help="the Ray head, HOST:PORT")
    parser.add_argument("--wait", type=int, metavar="N", help="wait for N alive nodes")
    parser.add_argument("--timeout", type=float, default=JOIN_TIMEOUT, help="seconds")
    args = parser.parse_args(argv)
    if args.free_port:
        print(free_port())
        return 0
    if not (args.address and args.wait):
        parser.error("give --free-port, or --address and --wait")
    try:
        alive = wait_for_nodes(args.address, args.wait, args.timeout)
    except TimeoutError as exc:
        print(f"areal-fast: error: {exc}", file=sys.stderr)
        return 1
    print(f"areal-fast: {alive} Ray nodes are up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
