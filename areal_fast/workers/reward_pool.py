"""A rollout worker's reward pool: the user's reward runs off the worker's main loop.

The worker hands each finished group's completions and sample dicts to :meth:`RewardPool.submit`
and goes back to its inbox at once; ``reward.workers`` dispatcher threads take the calls (one
per sample, or one per group for a batched reward) and run each in a
:class:`ThreadRunner` or a :class:`ProcessRunner` with the limit ``reward.timeout``. When the
group's last call ends, the pool posts ``("rewards", GroupScores)`` into the worker's inbox,
beside its control messages and engine outputs, so a slow verifier never delays a weight
update or its acknowledgement.

A group's first failed call (an exception, a timeout, a non-finite value) is logged in one
line naming the reward, the sample's uid and the error. With ``reward.on_error = drop`` the group comes back
with a ``drop_reason`` (``reward_error`` or ``reward_timeout``; its remaining calls are
skipped); with ``zero`` the sample scores 0.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from areal_fast.data.user_reward import RewardConfig, RewardValueError, is_batched, load_reward
from areal_fast.data.user_reward import score as score_call
from areal_fast.workers.reward_child import read_message, write_message

STARTUP_TIMEOUT_S = 300.0  # a child process: importing the reward module
log = logging.getLogger("areal_fast.reward")


class RewardTimeout(Exception):
    """A reward call took longer than ``reward.timeout``."""


class RewardCallError(Exception):
    """A reward call failed in a child process (the message is the child's ``Type: text``)."""


@dataclass
class GroupScores:
    """The rewards of one group, posted into the worker's inbox as ``("rewards", scores)``.

    Attributes
    ----------
    group_id : int
    rewards : list[float]
        One per sample, in sample order (a failed sample: 0.0).
    drop_reason : str
        ``"reward_error"`` or ``"reward_timeout"`` when a call failed and
        ``reward.on_error = drop``; else ``""``.
    error : str
        The first failure, ``"<reward path> on sample uid '<uid>': <error>"`` (``""``: none).
    """

    group_id: int
    rewards: list[float]
    drop_reason: str = ""
    error: str = ""


class ThreadRunner:
    """Runs each call in a new daemon thread and waits at most ``timeout`` seconds for it.

    A thread cannot be stopped: a call that times out is abandoned (it keeps running until it
    returns; its result is ignored) and the runner takes the next call at once.
    """

    def __init__(self, fn: Callable, timeout: float):
        self.fn, self.timeout = fn, timeout

    def call(self, completions: list[str], samples: list[dict]) -> list[float]:
        """The call's values (:func:`~areal_fast.data.user_reward.score`).

        Raises
        ------
        RewardTimeout
            It ran longer than ``timeout``.
        Exception
            What the reward raised.
        """
        box: queue.Queue = queue.Queue(1)

        def target():
            try:
                box.put((True, score_call(self.fn, completions, samples)))
            except BaseException as exc:  # noqa: BLE001 - handed to the dispatcher
                box.put((False, exc))

        threading.Thread(target=target, name="reward-call", daemon=True).start()
        try:
            ok, value = box.get(timeout=self.timeout)
        except queue.Empty:
            raise RewardTimeout(
                f"took longer than reward.timeout = {self.timeout:g} s (its thread is abandoned)"
            ) from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Nothing to release (abandoned calls end on their own)."""


class ProcessRunner:
    """Runs calls in one child process (:mod:`areal_fast.workers.reward_child`); a call
    that times out has its process killed, and a new one is started for the next call."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout
        self.proc: Optional[subprocess.Popen] = None
        self.ready = False
        self.load_error = ""  # the child could not load the reward: every call fails so
        self.closed = False
        self._start()

    def _start(self) -> None:
        env = dict(os.environ)  # the child imports what this process imports
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_fast.workers.reward_child", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,  # unbuffered: select() sees every byte the child wrote
        )
        self.ready = False

    def _replace(self) -> Optional[int]:
        """Kill the child (if alive) and start a new one; returns the old one's exit code."""
        self.proc.kill()
        code = self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        if not self.closed:
            self._start()
        return code

    def _read(self, timeout: float):
        """The child's next message within ``timeout`` seconds.

        Raises
        ------
        TimeoutError
            Nothing complete came in time.
        EOFError
            The child's stdout ended (it exited).
        """
        stream = self.proc.stdout
        ready, _, _ = select.select([stream], [], [], timeout)
        if not ready:
            raise TimeoutError
        message = read_message(stream)  # the child writes each message whole
        if message is None:
            raise EOFError
        return message

    def call(self, completions: list[str], samples: list[dict]) -> list[float]:
        """The call's values, computed in the child.

        Raises
        ------
        RewardTimeout
            It ran longer than ``timeout`` (the child was killed and replaced).
        RewardCallError
            The reward raised or returned a bad value in the child, the child exited, or it
            could not load ``reward.path``.
        """
        if self.load_error:
            raise RewardCallError(self.load_error)
        try:
            if not self.ready:
                kind, value = self._read(STARTUP_TIMEOUT_S)
                if kind == "failed":
                    self.load_error = f"the reward process could not load it: {value}"
                    raise RewardCallError(self.load_error)
                self.ready = True
            write_message(self.proc.stdin, (completions, samples))
            kind, value = self._read(self.timeout)
        except TimeoutError:
            self._replace()
            raise RewardTimeout(
                f"took longer than reward.timeout = {self.timeout:g} s (its process was "
                "killed and replaced)"
            ) from None
        except (EOFError, BrokenPipeError, OSError):
            code = self._replace()
            raise RewardCallError(f"the reward process exited (code {code})") from None
        if kind == "error":
            raise RewardCallError(value)
        return value

    def close(self) -> None:
        """End the child: its stdin closes, then it is killed if still running after 1 s."""
        self.closed = True
        try:
            self.proc.stdin.close()
            self.proc.wait(1.0)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class _Pending:
    """One group's calls: the values so far and its first failure (thread safe)."""

    def __init__(self, group_id: int, uid: str, size: int, calls: int):
        self.group_id, self.uid, self.left = group_id, uid, calls
        self.values = [0.0] * size
        self.reason = self.error = ""
        self.lock = threading.Lock()

    def done(self, indices: list[int], values: list[float]) -> bool:
        """Record a call's values; True when it was the group's last call."""
        with self.lock:
            for i, value in zip(indices, values):
                self.values[i] = value
            self.left -= 1
            return self.left == 0

    def fail(self, reason: str, error: str) -> tuple[bool, bool]:
        """Record a failed call (its samples stay 0.0); (whether it was the group's first
        failure, whether it was the group's last call)."""
        with self.lock:
            first = not self.reason
            if first:
                self.reason, self.error = reason, error
            self.left -= 1
            return first, self.left == 0


class RewardPool:
    """``reward.workers`` calls at a time of the reward ``reward.path``.

    Parameters
    ----------
    config : RewardConfig
        ``reward.*`` (``path`` must be set).
    post : callable ((kind, item)) -> None
        Puts into the worker's inbox: ``("rewards", GroupScores)`` per submitted group.

    Raises
    ------
    ValueError
        ``reward.path`` cannot be loaded (see :func:`~areal_fast.data.user_reward.load_reward`).
    """

    def __init__(self, config: RewardConfig, post: Callable[[tuple], None]):
        self.config, self.post = config, post
        self.fn = load_reward(config.path)  # here too: whether it is batched
        self.batched = is_batched(self.fn)
        self.jobs: queue.Queue = queue.Queue()
        if config.pool == "process":
            self.runners = [
                ProcessRunner(config.path, config.timeout) for _ in range(config.workers)
            ]
        else:
            self.runners = [ThreadRunner(self.fn, config.timeout) for _ in range(config.workers)]
        self.threads = [
            threading.Thread(target=self._serve, args=(r,), name="reward-pool", daemon=True)
            for r in self.runners
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, group_id: int, completions: list[str], samples: list[dict]) -> None:
        """Score a group's completions (``samples[i]`` is completion i's sample dict); the
        result is posted later as ``("rewards", GroupScores)``."""
        uid = str(samples[0].get("uid", "")) if samples else ""
        if not completions:
            self.post(("rewards", GroupScores(group_id, [])))
            return
        calls = (
            [list(range(len(completions)))]
            if self.batched
            else [[i] for i in range(len(completions))]
        )
        pending = _Pending(group_id, uid, len(completions), len(calls))
        for indices in calls:
            self.jobs.put(
                (pending, indices, [completions[i] for i in indices], [samples[i] for i in indices])
            )

    def _serve(self, runner) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            pending, indices, completions, samples = job
            if pending.reason and self.config.on_error == "drop":  # dropped already: skip
                last = pending.fail(pending.reason, pending.error)[1]
            else:
                last = self._run(runner, pending, indices, completions, samples)
            if last:
                reason = pending.reason if self.config.on_error == "drop" else ""
                self.post(
                    (
                        "rewards",
                        GroupScores(pending.group_id, pending.values, reason, pending.error),
                    )
                )

    def _run(self, runner, pending: _Pending, indices, completions, samples) -> bool:
        try:
            values = runner.call(completions, samples)
        except RewardTimeout as exc:
            return self._failed(pending, "reward_timeout", str(exc))
        except Exception as exc:  # noqa: BLE001 - the user's reward failed: counted, logged
            text = str(exc) if isinstance(exc, (RewardCallError, RewardValueError)) else ""
            return self._failed(pending, "reward_error", text or f"{type(exc).__name__}: {exc}")
        return pending.done(indices, values)

    def _failed(self, pending: _Pending, reason: str, text: str) -> bool:
        """Record a failed call; the group's first failure is logged (one line per group)."""
        error = f"reward {self.config.path} on sample uid {pending.uid!r}: {text}"
        first, last = pending.fail(reason, error)
        if first:
            what = (
                f"group {pending.group_id} dropped ({reason})"
                if self.config.on_error == "drop"
                else "its failed samples score 0 (reward.on_error = zero)"
            )
            log.warning("%s; %s", error, what)
        return last

    def close(self) -> None:
        """Stop the dispatchers after the calls they run and end the child processes."""
        for _ in self.threads:
            self.jobs.put(None)
        for runner in self.runners:
            runner.close()
