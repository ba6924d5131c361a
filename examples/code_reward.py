"""A code-execution reward (``reward.path: examples/code_reward.py:reward``): the completion's
last Python code block, followed by the row's ``tests`` (assert lines), runs in a child
process; it scores 1.0 when the program exits cleanly, else 0.0.

What the child gets, and what it does not:

- ``python -I`` (isolated mode: no ``PYTHON*`` environment variables, no user site-packages,
  the script's folder not on ``sys.path``), an empty environment, a fresh temporary working
  directory (deleted afterwards), no inherited file descriptors, stdin the program itself and
  stdout discarded; never a shell.
- Limits set in the child with :func:`resource.setrlimit` before the program runs: address
  space (``RLIMIT_AS``, :data:`MEMORY_LIMIT_BYTES`), CPU seconds (``RLIMIT_CPU``), files it
  writes (``RLIMIT_FSIZE``, 1 MiB) and no new processes (``RLIMIT_NPROC`` 0; not enforced for
  root). The parent kills the child's whole session after :data:`TIME_LIMIT_S` seconds of
  wall time (a program that sleeps uses no CPU).
- No network, as a guard: before the program runs, the child replaces ``socket.socket``,
  ``socket.create_connection``, ``socket.socketpair`` and ``_socket.socket`` with functions
  that raise ``PermissionError``.

This is not a sandbox. The program runs as this user, can read every file this user can and
write where this user may (within RLIMIT_FSIZE), and a determined program can get round the
socket guard (e.g. through ``ctypes`` or ``os`` system calls). For untrusted code, run the
rollout workers in a container or a network namespace without network (``unshare -n``,
nsjail, gVisor) as well.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

TIME_LIMIT_S = 5.0  # wall-clock seconds per program (its CPU limit too)
MEMORY_LIMIT_BYTES = 512 * 2**20  # address space of the child
_FILE_LIMIT_BYTES = 2**20
_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)

# run by `python -I -c` in the child: limits, the socket guard, then the program from stdin
_CHILD = """
import resource, socket, _socket, sys
memory, cpu, files = {memory}, {cpu}, {files}
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled for this program")
socket.socket = socket.create_connection = socket.socketpair = _no_network
_socket.socket = _no_network
source = sys.stdin.read()
del resource, socket, _socket, _no_network, memory, cpu, files
exec(compile(source, "<solution>", "exec"), {{"__name__": "__main__"}})
"""


@dataclass
class RunResult:
    """How a program ended: its exit code (negative: killed by that signal), whether the wall
    time limit stopped it, and the last 2,000 characters of its stderr."""

    returncode: int
    timed_out: bool
    stderr: str

    @property
    def passed(self) -> bool:
        """It exited with status 0 in time."""
        return self.returncode == 0 and not self.timed_out


def extract_code(completion: str) -> str | None:
    """The last fenced code block of ``completion`` (```` ```python ```` or a bare fence), or
    None when there is none."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def run_program(
    source: str,
    time_limit: float = TIME_LIMIT_S,
    memory_limit: int = MEMORY_LIMIT_BYTES,
) -> RunResult:
    """Run Python ``source`` in a limited child process (see the module docstring).

    Parameters
    ----------
    source : str
        The program.
    time_limit : float
        Seconds of wall time (and, rounded up, of CPU time) it may take.
    memory_limit : int
        Bytes of address space it may map.

    Returns
    -------
    RunResult
    """
    child = _CHILD.format(
        memory=int(memory_limit), cpu=max(1, int(time_limit + 0.999)), files=_FILE_LIMIT_BYTES
    )
    with tempfile.TemporaryDirectory(prefix="code_reward_") as folder:
        with open(os.path.join(folder, "stderr"), "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", child],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=folder,
                env={},
                start_new_session=True,  # its own process group: killed as a whole
            )
            timed_out = False
            try:
                proc.communicate(source.encode(), timeout=time_limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            err.seek(0)
            stderr = err.read().decode(errors="replace")[-2000:]
    # the CPU-seconds limit (SIGXCPU) may stop a busy loop before the wall-time limit does
    timed_out = timed_out or proc.returncode == -signal.SIGXCPU
    return RunResult(proc.returncode, timed_out, stderr)


def reward(completion: str, sample: dict) -> float:
    """1.0 if the completion's last code block passes every assert of ``sample["tests"]`` (a
    list of lines, or one string) within the limits, else 0.0 (no code block: 0.0)."""
    code = extract_code(completion)
    if code is None:
        return 0.0
    tests = sample.get("tests", [])
    tests = tests if isinstance(tests, str) else "\n".join(tests)
    return 1.0 if run_program(f"{code}\n\n{tests}\n").passed else 0.0
