"""A reward function of the user's (``reward.*`` keys): loading, checking and calling it.

``reward.path`` names the function: ``"module:function"`` (imported by name) or
``"file.py:function"`` (a file path, relative to the working directory, imported with
:func:`importlib.util.spec_from_file_location`; nothing is fetched from anywhere). It is
called as ``fn(completion: str, sample: dict) -> float``, where ``sample`` is the dataset row
of the prompt (with ``"uid"`` and ``"answer"``). A function marked with :func:`batched` is
called once per prompt group instead, as ``fn(completions: list[str], samples: list[dict]) ->
list[float]``. Either form may be an ``async def``.

The rollout workers run the calls in a pool (:mod:`areal_fast.workers.reward_pool`); this
module only holds what both the controller (the check at start-up) and the pool's threads
or processes need.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from areal_fast._checks import at_least, positive_finite
from areal_fast._user_code import import_attribute


@dataclass
class RewardConfig:
    """The reward of every completion (training and held-out)."""

    # the reward function, "module:function" or "file.py:function" (a file path relative to
    # the working directory); called as fn(completion, sample) -> float, or, when marked with
    # @areal_fast.data.user_reward.batched, as fn(completions, samples) -> list[float]; sync
    # or async. None: the built-in math reward (the last number matches the answer)
    path: Optional[str] = None
    # seconds one call may take (a sample, or a group when batched): a thread that takes
    # longer is abandoned (it cannot be stopped), a process is killed and replaced
    timeout: float = 60.0
    workers: int = 4  # calls that run at the same time on each rollout worker
    # "thread" (cheap; for I/O-bound or GIL-releasing rewards) or "process" (one child process
    # per slot: CPU-bound rewards run in parallel, and a hung call is killed)
    pool: str = "thread"
    # what an exception, a timeout or a non-finite value does: "drop" the sample's whole group
    # (counted in summary.json as reward_error / reward_timeout) or score the sample "zero"
    on_error: str = "drop"

    def __post_init__(self):
        positive_finite("timeout", self.timeout)
        at_least("workers", self.workers, 1)
        if self.pool not in ("thread", "process"):
            raise ValueError(f"pool = {self.pool!r} must be 'thread' or 'process'")
        if self.on_error not in ("drop", "zero"):
            raise ValueError(f"on_error = {self.on_error!r} must be 'drop' or 'zero'")
        if self.path is not None and (not isinstance(self.path, str) or ":" not in self.path):
            raise ValueError(
                f"path = {self.path!r} must be 'module:function' or 'file.py:function'"
            )


class RewardValueError(ValueError):
    """A reward function returned something other than finite numbers (one per sample)."""


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as a batched reward: called once per prompt group as
    ``fn(completions: list[str], samples: list[dict]) -> list[float]`` (one value per
    completion, in order) instead of once per completion. Returns ``fn`` itself."""
    fn.batched = True
    return fn


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` was marked with :func:`batched` (its ``batched`` attribute is True)."""
    return getattr(fn, "batched", False) is True


def resolve_path(path: str) -> str:
    """``path`` with a ``file.py`` part made absolute (against the working directory), so a
    worker process started elsewhere finds the same file; ``module:function`` unchanged."""
    where, _, name = path.rpartition(":")
    if where.endswith(".py"):
        return f"{Path(where).resolve()}:{name}"
    return path


def load_reward(path: str) -> Callable:
    """Import and check the reward function ``path`` names (``reward.path``).

    Parameters
    ----------
    path : str
        ``"module:function"`` or ``"file.py:function"``.

    Returns
    -------
    callable
        The function, sync or async, plain or :func:`batched`.

    Raises
    ------
    ValueError
        One line naming ``reward.path`` and the reason: the file does not exist, the module
        cannot be imported (its error), the name is not in it, it is not callable, or it
        cannot be called with two positional arguments.
    """
    fn = import_attribute(path, "reward.path")
    name = path.rpartition(":")[2]
    if not callable(fn):
        raise ValueError(
            f"reward.path = {path!r}: {name!r} is a {type(fn).__name__}, not a function"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # e.g. a builtin without a signature: try the call
        return fn
    try:
        signature.bind(None, None)
    except TypeError:
        form = "(completions, samples)" if is_batched(fn) else "(completion, sample)"
        raise ValueError(
            f"reward.path = {path!r}: {name}{signature} cannot be called as {name}{form} "
            f"(two positional arguments)"
        ) from None
    return fn


def score(fn: Callable, completions: list[str], samples: list[dict]) -> list[float]:
    """One call of the reward: ``fn(completions, samples)`` when batched, else
    ``fn(completions[0], samples[0])`` (then ``completions`` holds one completion). An async
    function runs to completion in a new event loop of this thread.

    Returns
    -------
    list[float]
        One finite value per completion (a bool counts as 1.0 / 0.0).

    Raises
    ------
    RewardValueError
        A value is not a real number or not finite, or a batched call returned the wrong
        number of values.
    Exception
        Whatever the reward function raised.
    """
    if is_batched(fn):
        values = _run(fn(list(completions), list(samples)))
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise RewardValueError(
                f"a batched reward returned {type(values).__name__}, not a list of numbers"
            )
        if len(values) != len(completions):
            raise RewardValueError(
                f"a batched reward returned {len(values)} values for {len(completions)} completions"
            )
    else:
        values = [_run(fn(completions[0], samples[0]))]
    out = []
    for value in values:
        if not isinstance(value, (int, float)) and not _is_real(value):  # bool is an int
            raise RewardValueError(f"the reward returned {value!r}, not a number")
        number = float(value)
        if not math.isfinite(number):
            raise RewardValueError(f"the reward returned {number}, not a finite number")
        out.append(number)
    return out


def _is_real(value) -> bool:
    """A numpy or torch scalar (anything with ``__float__`` that is not a container)."""
    return hasattr(value, "__float__") and not hasattr(value, "__len__")


def _run(result):
    """``result`` itself, or the value of the coroutine ``result`` (awaited here)."""
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable):
    return await awaitable
