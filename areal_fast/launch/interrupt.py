"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM, cleanly.

The launcher alone handles these signals: worker processes are started with SIGINT blocked
(Ray actors ignore it), so a Ctrl-C in the terminal, which reaches the whole process group,
prints no worker tracebacks; the launcher stops them. On the signal, the run

1. waits up to :data:`CHECKPOINT_WAIT_SECONDS` for a recoverable checkpoint the trainer is
   writing and commits it (a second Ctrl-C discards it instead),
2. stops every worker (further signals are held back meanwhile),
3. deletes uncommitted checkpoint folders (``checkpoints/.tmp-step-*``) and a half-written
   final model,
4. writes ``INTERRUPTED`` in the run directory, one line saying where the run stopped and
   what ``resume=true`` will do, and raises :class:`RunInterrupted` with that line.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from pathlib import Path

from areal_fast.launch import console
from areal_fast.launch.checkpoints import run_checkpoints
from areal_fast.launch.run_context import RunContext
from areal_fast.wire.handles import WorkerError, wait_messages
from areal_fast.wire.messages import StateSaved, StepDone

CHECKPOINT_WAIT_SECONDS = 60.0  # longest wait for a checkpoint in progress after Ctrl-C
INTERRUPTED_FILE = "INTERRUPTED"


class Interrupted(KeyboardInterrupt):
    """A stop requested by a signal other than SIGINT (the CLI raises it on SIGTERM).

    Attributes
    ----------
    signum : int
        The signal's number.
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunInterrupted(KeyboardInterrupt):
    """The run stopped cleanly after a signal; ``str()`` is the one line to show.

    Attributes
    ----------
    signum : int
        SIGINT or SIGTERM.
    exit_code : int
        ``128 + signum`` (130 for Ctrl-C, 143 for SIGTERM), as a shell reports it.
    """

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.message, self.signum, self.exit_code = message, signum, 128 + signum

    def __str__(self) -> str:
        return self.message


def signal_of(exc: BaseException) -> int:
    """The signal behind a ``KeyboardInterrupt`` (SIGINT unless it says otherwise)."""
    return getattr(exc, "signum", signal.SIGINT)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM back in the block (cleanup must not be cut short); a signal
    that arrives meanwhile is dropped: the run is stopping already. Does nothing outside the
    main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def finish_checkpoints(controller, trainer_ranks, timeout: float, say) -> bool:
    """Commit the checkpoints the trainer is still writing, waiting at most ``timeout`` s.

    Parameters
    ----------
    controller : AsyncController
        Its ``saves.saving`` maps each checkpoint's temporary folder to (version, asked
        at); :class:`StepDone` and :class:`StateSaved` answers go through its message
        handler (a save asked for at step v and answered after step v + 1 was trained holds
        step v + 1, whose controller state the :class:`StepDone` records). In a
        reproducible run every rollout worker message goes there too: the checkpoint
        commits once the groups it keeps have finished.
    trainer_ranks : list of WorkerHandle
    timeout : float
        Seconds.
    say : callable
        Prints one console line.

    Returns
    -------
    bool
        True when nothing is left uncommitted; False when the wait ran out, the trainer
        failed, or a second Ctrl-C came (the folders are then deleted by the caller).
    """
    saves = controller.saves
    try:
        saves.finish_answered()  # a commit the signal cut short
        saves.commit_written()  # an answer the signal kept from being handled
    except KeyboardInterrupt:
        return False
    except (ValueError, OSError) as exc:
        say(f"could not commit the checkpoint in progress: {exc}")
        return False
    if not saves.saving:
        return True
    versions = ", ".join(f"step-{v}" for v, _ in sorted(saves.saving.values()))
    say(
        f"finishing checkpoint {versions} (at most {timeout:g} s; a second Ctrl-C or SIGTERM discards it)"
    )
    deadline = time.monotonic() + timeout
    # a reproducible run's checkpoint also waits for the rollouts it keeps: the rollout
    # workers (which ignore the signal) go on generating, and their messages are handled
    rollout = list(controller.fleet.workers) if saves.held is not None else []
    try:
        while saves.saving:
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"gave up on checkpoint {versions} after {timeout:g} s: {_waiting_for(saves)}")
                return False
            for handle, message in wait_messages(
                [*trainer_ranks, *rollout], min(left, 1.0), "while finishing a checkpoint"
            ):
                # a step the trainer finished meanwhile is recorded first: a save asked for
                # before it holds that step's weights and is committed under its version;
                # an answer for a save committed from its files already is dropped
                if (
                    isinstance(message, StepDone)
                    or handle in rollout
                    or (isinstance(message, StateSaved) and message.path in saves.saving)
                ):
                    controller.handle([(handle, message)])
            saves.commit_written()
    except KeyboardInterrupt:
        return False
    except (WorkerError, ValueError, OSError) as exc:
        say(f"gave up on checkpoint {versions}: {exc}")
        return False
    return True


def _waiting_for(saves) -> str:
    """What the checkpoints in progress still wait for, in a few words."""
    unanswered = [v for path, (v, _) in saves.saving.items() if path not in saves.answered]
    if unanswered:
        return "the trainer has not saved it"
    missing = sum(len(saves.held.missing.get(p, ())) for p in saves.saving) if saves.held else 0
    return f"{missing} rollout groups it keeps have not finished"


def describe_stop(
    phase: str, version: int, total_steps: int, checkpoints, every_steps: int, discarded: bool
) -> str:
    """The one line an interrupted run prints and writes to ``INTERRUPTED``.

    Parameters
    ----------
    phase : str
        What the run was doing ("training", "evaluating before training", ...).
    version : int
        Steps trained when it stopped.
    total_steps : int
    checkpoints : CheckpointManager
        The run's checkpoints (temporary folders already removed).
    every_steps : int
        ``checkpoint.every_steps``.
    discarded : bool
        A checkpoint in progress was deleted.
    """
    if phase == "training":
        where = f"interrupted at step {version + 1} ({version} of {total_steps} trained)"
    else:
        where = f"interrupted while {phase} ({version} of {total_steps} steps trained)"
    latest = checkpoints.latest()
    if latest is not None:
        what = (
            f"checkpoint step-{latest.version} is complete; resume=true continues from "
            f"step {latest.version}"
        )
    elif every_steps == 0:
        what = "checkpoints are off (checkpoint.every_steps = 0): resume=true starts at step 0"
    else:
        what = "no checkpoint is complete yet: resume=true starts at step 0"
    if discarded:
        what += " (the checkpoint in progress was discarded)"
    return f"{where}; {what}"


def write_interrupted(run_dir: Path, line: str, signum: int) -> None:
    """Record the stop in ``<run_dir>/INTERRUPTED``: the line, then the signal's name."""
    (Path(run_dir) / INTERRUPTED_FILE).write_text(
        f"{line}\nsignal: {signal.Signals(signum).name}\n"
    )


@contextlib.contextmanager
def stops_cleanly(run: RunContext):
    """Turn a Ctrl-C or SIGTERM in the block into :class:`RunInterrupted`, after cleaning up
    the run directory (see :func:`stopped`; the workers are stopped already).

    Raises
    ------
    RunInterrupted
        On the signal; the exception's text says where and what ``resume=true`` will do.
    """
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt as exc:
        raise stopped(run, signal_of(exc)) from None


def stopped(run: RunContext, signum: int) -> RunInterrupted:
    """Clean up after Ctrl-C / SIGTERM (the workers are stopped already): delete
    uncommitted checkpoints and a partial final model, write ``INTERRUPTED``; returns the
    exception to raise."""
    with signals_deferred():
        run_dir = run.run_dir
        if run_dir is None:
            return RunInterrupted(f"interrupted while {run.phase}; nothing was written", signum)
        checkpoints = run_checkpoints(run.cfg, run_dir)
        discarded = any(checkpoints.root.glob(".tmp-step-*"))
        checkpoints.remove_temporaries()
        shutil.rmtree(run_dir / "shards", ignore_errors=True)  # pending groups: not resumed
        if run.phase == "saving the final model":
            shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
        line = describe_stop(
            run.phase,
            run.version,
            run.cfg.total_steps,
            checkpoints,
            run.cfg.checkpoint.every_steps,
            discarded,
        )
        write_interrupted(run_dir, line, signum)
        return RunInterrupted(line, signum)


@contextlib.contextmanager
def checkpoints_finished_on_stop(controller, trainer_ranks, timeout: float):
    """On Ctrl-C / SIGTERM in the block, first commit the checkpoints the trainer is still
    writing (:func:`finish_checkpoints`, at most ``min(CHECKPOINT_WAIT_SECONDS, timeout)``
    seconds), then let the interrupt go on.

    Parameters
    ----------
    controller : AsyncController
    trainer_ranks : list of WorkerHandle
    timeout : float
        ``launcher.timeouts.train_step``, seconds.
    """
    try:
        yield
    except KeyboardInterrupt:
        wait = min(CHECKPOINT_WAIT_SECONDS, timeout)
        finish_checkpoints(controller, trainer_ranks, wait, console.say)
        raise
