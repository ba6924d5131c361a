"""Problem sets by task name: GSM8K, or any procedurally generated reasoning-gym dataset
(the user's own rows, tasks ``jsonl`` and ``hf``, are read by
:func:`areal_fast.data.user_data.load_user_data`).

Held-out sets
-------------
reasoning-gym datasets are generated from a seed, so a task has no fixed train/test
split: the caller makes one by passing *different seeds* for the training and the
evaluation set (for example ``seed=0`` for training, ``seed=999`` for evaluation).
Different seeds give different draws, but small task spaces (two one-digit terms has
only a few hundred distinct questions) repeat questions across draws; call
:func:`drop_eval_overlap` on the two lists so the evaluation questions stay unseen.
reasoning-gym draws item i of a dataset with seed ``seed + i``, so nearby seeds give
shifted copies of the same items (seed 1000 is seed 999 without its first item): pick
seeds far apart (e.g. 0 and 100000) when the sets should differ.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
from collections.abc import Sequence
from typing import Any

from areal_fast.data.config import USER_TASKS
from areal_fast.data.gsm8k import load_gsm8k
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import normalize_number

GSM8K_DEFAULT_SOURCE = "openai/gsm8k"
_RESERVED_KWARGS = ("size", "seed")


def _reasoning_gym_registry() -> dict[str, tuple[type, type]]:
    """Name -> (dataset class, config dataclass) as registered by reasoning-gym."""
    import reasoning_gym  # noqa: F401  (importing registers every dataset)
    from reasoning_gym.factory import DATASETS

    return DATASETS


def known_tasks() -> list[str]:
    """Every task name :func:`load_problems` accepts.

    Returns
    -------
    list of str
        ``"gsm8k"``, ``"jsonl"`` and ``"hf"`` (your own rows), then the reasoning-gym
        dataset names, sorted.
    """
    return ["gsm8k", *USER_TASKS, *sorted(_reasoning_gym_registry())]


def _unknown_task_error(task: str) -> ValueError:
    names = known_tasks()
    shown = ["gsm8k", "basic_arithmetic"] + [n for n in names[1:] if n != "basic_arithmetic"][:6]
    hint = difflib.get_close_matches(task, names, n=3)
    did_you_mean = f"; did you mean {', '.join(hint)}?" if hint else ""
    return ValueError(
        f"unknown task '{task}'; known: {', '.join(shown)}, ... "
        f"({len(names)} in all, see areal_fast.data.known_tasks()){did_you_mean}"
    )


def _subset(
    problems: list[MathProblem], size: int | None, seed: int, name: str
) -> list[MathProblem]:
    if size is None:
        return problems
    if size > len(problems):
        raise ValueError(f"size={size} exceeds the {len(problems)} rows of {name}")
    keep = sorted(random.Random(seed).sample(range(len(problems)), size))
    return [problems[i] for i in keep]


def _load_reasoning_gym(
    task: str, size: int | None, seed: int, task_kwargs: dict[str, Any]
) -> list[MathProblem]:
    registry = _reasoning_gym_registry()
    if task not in registry:
        raise _unknown_task_error(task)
    _, config_cls = registry[task]
    options = [f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED_KWARGS]
    for key in task_kwargs:
        if key in _RESERVED_KWARGS:
            raise ValueError(
                f"task_kwargs for '{task}' must not set '{key}'; use the {key}= argument"
            )
        if key not in options:
            raise ValueError(
                f"task '{task}' has no option '{key}'; its options: {', '.join(options)}"
            )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in task_kwargs.items()}
    if size is not None:
        kwargs["size"] = size

    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, seed=seed, **kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"invalid task_kwargs for task '{task}' {task_kwargs}: {e}") from None
    problems = []
    for i, entry in enumerate(dataset):
        answer = str(entry["answer"]).strip()
        problems.append(
            MathProblem(
                question=str(entry["question"]).strip(),
                answer=normalize_number(answer) or answer,
                uid=f"{task}/seed{seed}/{i}",
            )
        )
    return problems


def load_problems(
    task: str,
    *,
    split: str,
    size: int | None,
    seed: int,
    path: str | None = None,
    task_kwargs: dict | None = None,
) -> list[MathProblem]:
    """Load a problem set by task name.

    Parameters
    ----------
    task : str
        ``"gsm8k"`` or a reasoning-gym dataset name (e.g. ``"basic_arithmetic"``); see
        :func:`known_tasks`.
    split : str
        GSM8K split (``"train"``/``"test"``). Ignored by reasoning-gym tasks, whose
        train and evaluation sets differ by ``seed`` alone (see the module notes).
    size : int or None
        GSM8K: number of rows in a random subset, or None for all rows. reasoning-gym:
        number of problems to generate, or None for the dataset's default size.
    seed : int
        GSM8K: picks the subset (same seed, same rows). reasoning-gym: the generation
        seed; use different seeds for training and evaluation.
    path : str, optional
        GSM8K only: a ``.jsonl`` file or a folder of ``{split}.jsonl`` files; default
        the Hugging Face id ``"openai/gsm8k"`` (needs ``datasets``).
    task_kwargs : dict, optional
        reasoning-gym only: fields of the dataset's config, e.g. for
        ``basic_arithmetic`` ``{"min_terms": 2, "max_terms": 2, "min_digits": 1,
        "max_digits": 1, "operators": ["+"]}`` (lists become tuples).

    Returns
    -------
    list of MathProblem
        GSM8K subsets keep file order; reasoning-gym problems come in generation order
        with uids ``"<task>/seed<seed>/<index>"``.

    Raises
    ------
    ValueError
        For ``"jsonl"``/``"hf"`` (see :func:`~areal_fast.data.user_data.load_user_data`),
        an unknown task, ``size`` < 1 or above the GSM8K split size, task_kwargs
        given to gsm8k, an option the reasoning-gym config lacks (named in the
        message), ``size``/``seed`` passed through task_kwargs, or values the config
        rejects.
    FileNotFoundError, ImportError
        From :func:`load_gsm8k`.
    """
    task_kwargs = dict(task_kwargs or {})
    if size is not None and size < 1:
        raise ValueError(f"size must be >= 1 or None, got {size}")
    if task == "gsm8k":
        if task_kwargs:
            raise ValueError(
                f"task 'gsm8k' takes no task_kwargs, got '{next(iter(task_kwargs))}' "
                f"(data.task_kwargs={{}} clears those of the config)"
            )
        problems = load_gsm8k(path or GSM8K_DEFAULT_SOURCE, split)
        return _subset(problems, size, seed, f"gsm8k/{split}")
    if task in USER_TASKS:
        raise ValueError(
            f"task '{task}' is read with areal_fast.data.user_data.load_user_data(DataConfig), "
            "which draws the training and held-out rows together"
        )
    if path is not None:
        raise ValueError(f"path= is only used by task 'gsm8k', not '{task}'")
    return _load_reasoning_gym(task, size, seed, task_kwargs)


def _question_key(problem: MathProblem) -> str:
    return " ".join(problem.question.split()) if problem.messages is None else problem.prompt_id


def drop_eval_overlap(
    train: Sequence[MathProblem], held_out: Sequence[MathProblem]
) -> tuple[list[MathProblem], int]:
    """Remove from ``train`` every problem whose question also appears in ``held_out``.

    Questions are compared after collapsing whitespace; problems given as chat messages by
    their messages (:attr:`MathProblem.prompt_id`).

    Parameters
    ----------
    train : sequence of MathProblem
        Training problems.
    held_out : sequence of MathProblem
        Evaluation problems; left untouched.

    Returns
    -------
    kept : list of MathProblem
        ``train`` without the overlapping problems, order preserved.
    removed : int
        How many problems were dropped.
    """
    seen = {_question_key(p) for p in held_out}
    kept = [p for p in train if _question_key(p) not in seen]
    return kept, len(train) - len(kept)
