"""What the controller asks rollout workers for: a seeded stream of training problems, their
chat prompts, and one :class:`~areal_fast.wire.messages.GroupRequest` per prompt group."""

from __future__ import annotations

import random

from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import apply_chat_template, build_prompt_messages
from areal_fast.rollout.engine import SamplingParams, sample_seed
from areal_fast.wire.messages import GroupRequest


class ProblemStream:
    """Endless, seeded, epoch-shuffled stream of training problems.

    Parameters
    ----------
    problems : list[MathProblem]
        Must not be empty.
    seed : int
        Shuffle seed; the same seed gives the same order.
    """

    def __init__(self, problems: list[MathProblem], seed: int):
        if not problems:
            raise ValueError("the training set is empty")
        self.problems = list(problems)
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = -1

    def next_batch(self, size: int) -> list[MathProblem]:
        """The next ``size`` problems, starting a new shuffled epoch when one runs out."""
        out = []
        while len(out) < size:
            if not self.order:
                self.order = list(range(len(self.problems)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.problems[self.order.pop()])
        return out


class ChatPrompts:
    """Chat-templated prompt token ids of problems (cached per ``prompt_id``).

    A problem with ``messages`` is rendered from them as given; any other is one user turn,
    its question with the instruction appended (:func:`build_prompt_messages`).

    Parameters
    ----------
    tokenizer : transformers tokenizer (with a chat template)
    instruction : str
        Appended to every plain-text question (the answer-format instruction).
    """

    def __init__(self, tokenizer, instruction: str):
        self.tokenizer = tokenizer
        self.instruction = instruction
        self._cache: dict[str, list[int]] = {}

    def __call__(self, problem: MathProblem) -> list[int]:
        """Prompt token ids of ``problem``."""
        key = problem.prompt_id
        if key not in self._cache:
            if problem.messages is not None:
                messages = list(problem.messages)
            else:
                messages = build_prompt_messages(problem.question, self.instruction)
            self._cache[key] = apply_chat_template(self.tokenizer, messages)
        return self._cache[key]


def group_seed(run_seed: int, group_id: int) -> int:
    """Sampling seed of GRPO group ``group_id`` in a run seeded with ``run_seed``."""
    return sample_seed(run_seed, group_id)


class MathRequests:
    """Endless source of rollout requests for the asynchronous controller.

    ``requests(group_id)`` takes the next problem of ``stream`` and returns its
    :class:`~areal_fast.wire.messages.GroupRequest` (``data``: the problem's sample
    dict, :meth:`~areal_fast.data.problems.MathProblem.sample`) with the group's seed
    (:func:`group_seed`); called with group ids 0, 1, 2, ... it draws the same problems and
    seeds on every run with the same ``run_seed``.
    """

    def __init__(
        self, stream: ProblemStream, prompts: ChatPrompts, params: SamplingParams, run_seed: int
    ):
        self.stream, self.prompts, self.params, self.run_seed = stream, prompts, params, run_seed

    def __call__(self, group_id: int) -> GroupRequest:
        problem = self.stream.next_batch(1)[0]
        return GroupRequest(
            group_id,
            self.prompts(problem),
            self.params,
            group_seed(self.run_seed, group_id),
            problem.answer,
            problem.uid,
            problem.sample(),
        )


def eval_requests(
    problems: list[MathProblem], prompts: ChatPrompts, max_new_tokens: int
) -> list[GroupRequest]:
    """Greedy, one-sample requests for held-out ``problems`` (group ids -1, -2, ...); each
    carries its problem's sample dict (:meth:`MathProblem.sample`) as ``data``."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return [
        GroupRequest(-1 - i, prompts(p), params, 0, p.answer, p.uid, p.sample())
        for i, p in enumerate(problems)
    ]
