"""A worker target for tests/launch/test_interrupt.py: it makes a multiprocessing lock (a
named semaphore, as tqdm's lock is), says so in a file and waits to be stopped."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path


def hold_a_lock(conn, name: str, ready_file: str, authkey: bytes) -> None:
    """Make a lock, write ``ready_file``, then sleep until a signal ends the process."""
    lock = multiprocessing.get_context("spawn").Lock()
    Path(ready_file).write_text("ready")
    while lock:
        time.sleep(0.1)
