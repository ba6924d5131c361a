"""Holding SIGINT and SIGTERM back while a block changes state that must change whole.

The controller acts on its workers' messages in a loop; a Ctrl-C or SIGTERM raised in the
middle of acting on one (a finished group recorded in the ledger but not yet in the
checkpoint waiting for it, a step recorded but its weights not yet sent on) would leave the
run's state half changed for the clean stop that follows. :func:`signals_held` delays such a
signal to the end of the block.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held():
    """Delay SIGINT and SIGTERM to the end of the block, then act on the first that came
    as the handlers in place before the block would have (``KeyboardInterrupt`` for
    SIGINT, the launcher's stop for SIGTERM). A block that raises drops the signal: the run
    is failing already. Does nothing outside the main thread, where handlers cannot be
    set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if caught:
        _deliver(caught[0], previous[caught[0]])


def _deliver(signum: int, handler) -> None:
    """Act on ``signum`` as ``handler`` (a handler as :func:`signal.signal` returns it) would."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # its default action, now that it is restored
