"""areal-fast command line.

areal-fast train --config FILE [key=value ...]   asynchronous GRPO training
areal-fast sft   --config FILE [key=value ...]   supervised fine-tuning (prompt/completion, chat)
areal-fast eval  --config FILE model.path=...    greedy held-out accuracy of a model
areal-fast config [--markdown]                   every config key, its default and meaning
areal-fast compare RUN_A RUN_B [--json]          the first place where two run directories differ
areal-fast submit --config FILE [key=value ...]  the train run as a Slurm batch job (slurm.*)
areal-fast submit --status RUN_DIR               its Slurm state and last metrics line
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap

_TRAIN_ABOUT = (
    "Train a policy with fully asynchronous GRPO: rollout workers generate while the trainer "
    "trains, under a staleness bound. The held-out set is evaluated before and after "
    "training; everything goes to the run directory fileroot/experiment_name/trial_name."
)
_SFT_ABOUT = (
    "Supervised fine-tuning on jsonl / Hugging Face rows (prompt and completion columns, or "
    "chat messages with the loss on assistant turns only) through the trainer engine: "
    "packed micro-batches, the fused LM-head cross-entropy, LoRA, checkpoints and resume. "
    "The fine-tuned model (run directory's checkpoint/) is a model.path for areal-fast train."
)
_EVAL_ABOUT = (
    "Evaluate model.path (a directory such as a run's checkpoint/, an HF id, or demo:...) "
    "greedily on the held-out set of data.*, on the same rollout workers as training; prints "
    "the accuracy and writes eval.jsonl and summary.json into --out (default "
    "fileroot/experiment_name/eval-<trial_name>)."
)
_COMPARE_ABOUT = (
    "Compare two run directories: metrics.jsonl step by step (timing fields left out), each "
    "eval_*.jsonl problem by problem, and the final weights tensor by tensor; prints one line "
    "per kind, 'identical' or the first difference. Exit code 0: identical; 1: a difference; "
    "2: bad input."
)
_SUBMIT_ABOUT = (
    "Submit the same run as areal-fast train as a Slurm batch job: the config (slurm.* keys "
    "included) is checked, the batch script is written to the run directory's slurm/ folder "
    "and submitted with sbatch; prints the job id and its log. scancel stops the run as "
    "Ctrl-C does; a requeued job resumes from the newest complete checkpoint. --status "
    "RUN_DIR prints the job's Slurm state and the run's last metrics line."
)
_KEYS_HELP = (
    "config keys, by section (dotted, as key=value after the options;\n"
    "`areal-fast config` prints each with its type, default and meaning):"
)


def _keys_epilog(sft: bool = False) -> str:
    from areal_fast.launch.config_reference import section_index

    if sft:
        from areal_fast.launch.sft_config import SftConfig

        return f"{_KEYS_HELP}\n{section_index(SftConfig)}"
    return f"{_KEYS_HELP}\n{section_index()}"


def version() -> str:
    """The installed package's version (its metadata), or a note that it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("areal_fast")
    except PackageNotFoundError:
        return "unknown (areal_fast is not installed: pip install .)"


def _parser(with_keys: bool = False) -> argparse.ArgumentParser:
    """The argument parser; ``with_keys`` adds the key index to the train/eval help."""
    parser = argparse.ArgumentParser(
        prog="areal-fast", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"areal-fast {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    epilog = _keys_epilog() if with_keys else None
    train = sub.add_parser(
        "train",
        help="run asynchronous GRPO training (local launcher)",
        description=textwrap.fill(_TRAIN_ABOUT, 90),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning (its output is a model.path for train)",
        description=textwrap.fill(_SFT_ABOUT, 90),
        epilog=_keys_epilog(sft=True) if with_keys else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate = sub.add_parser(
        "eval",
        help="greedy held-out accuracy of model.path (no training)",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(_EVAL_ABOUT, 90),
    )
    for command in (train, sft, evaluate):
        command.add_argument(
            "--config",
            required=True,
            metavar="FILE",
            help="YAML experiment config (e.g. examples/arith.yaml; examples/ holds ready ones)",
        )
        command.add_argument("--no-progress", action="store_true", help="hide progress bars")
        command.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    evaluate.add_argument(
        "--out", help="evaluation directory (default: fileroot/experiment_name/eval-<trial_name>)"
    )
    config = sub.add_parser("config", help="print every config key with its default")
    config.add_argument(
        "--markdown", action="store_true", help="print the markdown reference (docs/config.md)"
    )
    _add_compare(sub)
    _add_submit(sub, epilog)
    return parser


def _add_submit(sub, epilog) -> None:
    """The ``submit`` subcommand's parser."""
    submit = sub.add_parser(
        "submit",
        help="run the train config as a Slurm batch job (or --status RUN_DIR)",
        description=textwrap.fill(_SUBMIT_ABOUT, 90),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = submit.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", metavar="FILE", help="YAML experiment config, as for train")
    what.add_argument("--status", metavar="RUN_DIR", help="show the run's job and last step")
    submit.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def _add_compare(sub) -> None:
    """The ``compare`` subcommand's parser."""
    compare = sub.add_parser(
        "compare",
        help="the first place where two run directories differ",
        description=textwrap.fill(_COMPARE_ABOUT, 90),
    )
    compare.add_argument("run_a", metavar="RUN_A", help="a run directory (run A)")
    compare.add_argument("run_b", metavar="RUN_B", help="another run directory (run B)")
    compare.add_argument("--json", action="store_true", help="print one JSON object")
    compare.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="FIELD",
        help="a further metrics.jsonl field to skip (repeatable)",
    )


def _raise_interrupted(signum, frame) -> None:
    from areal_fast.launch.interrupt import Interrupted

    raise Interrupted(signum)


def _compare(args) -> int:
    """``areal-fast compare``: 0 identical, 1 a difference, 2 bad input (one line)."""
    from areal_fast.launch.compare import CompareError, run_compare

    try:
        return run_compare(args.run_a, args.run_b, tuple(args.ignore), args.json)
    except CompareError as exc:
        if os.environ.get("AREAL_FAST_DEBUG"):
            raise
        print(f"areal-fast: error: {exc}", file=sys.stderr)
        return 2


def _submit(args, overrides: list[str]) -> int:
    """``areal-fast submit``: 0 submitted (or status shown), 2 bad input or refused by
    Slurm (one line, nothing submitted)."""
    from areal_fast.launch.config import ConfigError
    from areal_fast.launch.slurm.status import status_lines
    from areal_fast.launch.slurm.submit import SubmitError, submit

    bad = [item for item in overrides if "=" not in item or item.startswith("-")]
    if bad or (args.status and overrides):
        what = "--status takes no key=value items" if not bad else "unrecognized arguments"
        print(f"areal-fast submit: error: {what}: {' '.join(bad or overrides)}", file=sys.stderr)
        return 2
    try:
        if args.status:
            print("\n".join(status_lines(args.status)))
            return 0
        job = submit(args.config, overrides)
    except (ConfigError, SubmitError) as exc:
        if os.environ.get("AREAL_FAST_DEBUG"):
            raise
        print(f"areal-fast: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"submitted Slurm job {job.job_id}: {job.script}")
    print(f"log: {job.log}")
    print(
        f"status: areal-fast submit --status {job.script.parent.parent}; stop: scancel {job.job_id}"
    )
    return 0


def _sft(args, argv: list[str] | None) -> int:
    """``areal-fast sft``: 0 when the run finished (its console summary names the run
    directory). ``argv``: the command line, when it is this process's own: the command then
    starts itself again under ``launcher.allocator`` first (:func:`~.allocator.exec_under`)."""
    from areal_fast.launch.allocator import exec_under
    from areal_fast.launch.sft import run_sft
    from areal_fast.launch.sft_config import load_sft_config

    cfg = load_sft_config(args.config, args.overrides)
    if argv is not None:
        exec_under(cfg.launcher.allocator, argv)
    run_sft(cfg, show_progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a user error, with one line).

    Set ``AREAL_FAST_DEBUG=1`` to get the full traceback of such an error instead.
    """
    own_command_line = argv is None  # the process's own: sft may start itself again
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(with_keys=any(a in ("-h", "--help") for a in argv))
    args, extra = parser.parse_known_args(argv)  # options may come between key=value items
    if args.command == "config":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from areal_fast.launch.config_reference import render_markdown, render_text

        try:
            print(render_markdown() if args.markdown else render_text())
        except BrokenPipeError:  # `areal-fast config | head`
            sys.stdout = open(os.devnull, "w")
        return 0
    if args.command == "compare":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return _compare(args)
    if args.command == "submit":
        return _submit(args, [*args.overrides, *extra])
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    if args.no_progress:
        # the worker processes inherit it: their model loading and saving draw no bars either
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        import transformers

        transformers.utils.logging.disable_progress_bar()
    from areal_fast.launch.config import load_config
    from areal_fast.launch.interrupt import RunInterrupted
    from areal_fast.wire.handles import WorkerError

    # SIGTERM (schedulers, `timeout`) stops like Ctrl-C: one line, INTERRUPTED, exit 128 + N
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        if args.command == "sft":
            return _sft(args, argv if own_command_line else None)
        cfg = load_config(args.config, args.overrides)
        if args.command == "eval":
            from areal_fast.launch.evaluation import accuracy_line, run_evaluation

            summary = run_evaluation(cfg, args.out)
        else:
            from areal_fast.launch.experiment import run_experiment

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
    if args.command == "eval":
        print(accuracy_line(summary))
        print(f"evaluation directory: {summary['eval_dir']}")
        return 0
    return 0  # the console summary named the run directory; summary.json holds the rest


if __name__ == "__main__":
    sys.exit(main())
