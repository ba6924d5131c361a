"""A pytest plugin of ``benches/gpu_check.sh``: a session budget that always leaves the
reports (JUnit XML) written.

Load it with ``-p _pytest_budget`` (``benches/`` on ``sys.path``). Options:

``--stop-after SECONDS``
    Once SECONDS have passed since pytest started (collection included), no further test
    starts: the session ends as after ``-x``, and pytest writes its reports. A test already
    running is bounded by its own ``--timeout`` (pytest-timeout) where that is installed.
``--budget-report PATH``
    At the end, write ``{"stopped": bool, "interrupted": bool, "elapsed_s": float,
    "collected": int, "started": int}`` there as JSON: how many tests the budget left out.

SIGTERM (what ``timeout`` sends first) is turned into ``KeyboardInterrupt`` in the main
thread, so pytest ends the session the way it does on Ctrl-C and still writes the XML of the
tests that ran; ``timeout -k`` then has a few seconds to spare before its SIGKILL.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

_STATE_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("budget", "session budget (benches/gpu_check.sh)")
    group.addoption(
        "--stop-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no test after this many seconds since pytest started",
    )
    group.addoption(
        "--budget-report", default=None, metavar="PATH", help="write the budget's outcome here"
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the section's time limit")


def pytest_configure(config):
    config.stash[_STATE_KEY] = {
        "start": time.monotonic(),
        "collected": 0,
        "started": 0,
        "stopped": False,
        "interrupted": False,
    }
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_finish(session):
    session.config.stash[_STATE_KEY]["collected"] = len(session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Start ``item`` only inside the budget; past it, stop the session instead."""
    state = item.config.stash[_STATE_KEY]
    limit = item.config.getoption("stop_after")
    if limit is not None and time.monotonic() - state["start"] > limit:
        state["stopped"] = True
        item.session.shouldstop = f"--stop-after {limit:g} s reached"
        return True  # handled: the test does not run
    state["started"] += 1
    return None


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash[_STATE_KEY]
    # --stop-after ends the session as an interruption too; only a signal is "interrupted"
    state["interrupted"] = exitstatus == pytest.ExitCode.INTERRUPTED and not state["stopped"]
    path = session.config.getoption("budget_report")
    if not path:
        return
    report = {k: v for k, v in state.items() if k != "start"}
    report["elapsed_s"] = time.monotonic() - state["start"]
    report["stop_after_s"] = session.config.getoption("stop_after")
    Path(path).write_text(json.dumps(report) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash[_STATE_KEY]
    if state["stopped"] or state["interrupted"]:
        why = "interrupted (SIGTERM or Ctrl-C)" if state["interrupted"] else "budget reached"
        terminalreporter.write_line(
            f"budget: {why}: {state['started']} of {state['collected']} tests started"
        )
