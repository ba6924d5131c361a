"""Ray launcher: ``python -m areal_fast.launch.ray train --config FILE [key=value ...]``.

The same experiment as ``areal-fast train`` with ``scheduler.type=ray``: the controller runs
here (the Ray driver) and every rollout worker and trainer rank is a Ray actor placed by a
placement group (:mod:`areal_fast.launch.ray_cluster`). ``scheduler.ray_address`` joins an
existing cluster (``auto`` for the one ``ray start`` made); by default a local Ray instance
is started. Resources per worker: ``scheduler.cpus_per_rollout_worker``,
``gpus_per_rollout_worker``, ``cpus_per_trainer_rank``, ``gpus_per_trainer_rank``; trainer
ranks: ``scheduler.train_world_size``. Every server binds ``scheduler.bind_host``, by default
its own node's IP; which workers may run on other nodes: docs/scale-out.md.
"""

from __future__ import annotations

import sys

ENTRIES = ("train",)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code of :func:`areal_fast.launch.command_line.main`
    (2: a user error).

    ``argv[0]`` is the entry (``train``, the built-in GRPO experiment); the rest are the
    ``areal-fast train`` arguments. ``scheduler.type=ray`` is added last, so it wins.
    """
    from areal_fast.launch.command_line import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in ENTRIES:
        given = repr(argv[0]) if argv else "nothing"
        print(
            f"usage: python -m areal_fast.launch.ray {{{','.join(ENTRIES)}}} --config FILE "
            f"[key=value ...]\nareal_fast.launch.ray: error: the entry must be one of "
            f"{ENTRIES}, got {given}",
            file=sys.stderr,
        )
        return 2
    return cli_main([argv[0], *argv[1:], "scheduler.type=ray"])


if __name__ == "__main__":
    sys.exit(main())
