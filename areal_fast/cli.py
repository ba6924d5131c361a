"""``areal-fast`` command line: ``areal-fast train --config FILE [key=value ...]``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run asynchronous GRPO training (local launcher)")
    train.add_argument("--config", help="YAML experiment config (e.g. examples/arith.yaml)")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def _raise_interrupted(signum, frame) -> None:
    from areal_fast.launch.interrupt import Interrupted

    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a user error, with one line).

    Set ``AREAL_FAST_DEBUG=1`` to get the full traceback of such an error instead.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)  # options may come between key=value items
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    from areal_fast.launch.config import load_config
    from areal_fast.launch.experiment import run_experiment

    if args.no_progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    from areal_fast.controller.workers import WorkerError

    from areal_fast.launch.interrupt import RunInterrupted

    # SIGTERM (schedulers, `timeout`) stops like Ctrl-C: one line, INTERRUPTED, exit 128 + N
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        cfg = load_config(args.config, args.overrides)
        summary = run_experiment(cfg, show_progress=not args.no_progress)
    except RunInterrupted as exc:
        print(f"areal-fast: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # before the run began (reading the config)
        print("areal-fast: interrupted before the run started", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except (ValueError, FileNotFoundError, ImportError, WorkerError, TimeoutError) as exc:
        if os.environ.get("AREAL_FAST_DEBUG"):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"areal-fast: error: {message}", file=sys.stderr)
        # 2: a user error found by the checks; 1: a failure while running
        return 1 if isinstance(exc, (WorkerError, TimeoutError)) else 2
    print(json.dumps(summary, indent=2))
    print(f"run directory: {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
