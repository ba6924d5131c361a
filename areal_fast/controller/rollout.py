"""Math rollout: prompts through the engine, completions scored into trajectories."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from areal_fast.controller.messages import GroupRequest
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import apply_chat_template, build_prompt_messages, math_reward
from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import InferenceEngine, SamplingParams, sample_seed


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


@dataclass
class RolloutResult:
    """Scored trajectories of one batch plus how long generation took."""

    trajectories: list[Trajectory]
    seconds: float

    @property
    def num_generated_tokens(self) -> int:
        """Completion tokens over all trajectories."""
        return sum(len(t.completion_ids) for t in self.trajectories)


class ChatPrompts:
    """Chat-templated prompt token ids of math problems (cached per question).

    Parameters
    ----------
    tokenizer : transformers tokenizer (with a chat template)
    instruction : str
        Appended to every question (the answer-format instruction).
    """

    def __init__(self, tokenizer, instruction: str):
        self.tokenizer = tokenizer
        self.instruction = instruction
        self._cache: dict[str, list[int]] = {}

    def __call__(self, problem: MathProblem) -> list[int]:
        """Prompt token ids of ``problem``."""
        if problem.question not in self._cache:
            messages = build_prompt_messages(problem.question, self.instruction)
            self._cache[problem.question] = apply_chat_template(self.tokenizer, messages)
        return self._cache[problem.question]


def group_seed(run_seed: int, group_id: int) -> int:
    """Sampling seed of GRPO group ``group_id`` in a run seeded with ``run_seed``."""
    return sample_seed(run_seed, group_id)


class MathRequests:
    """Endless source of rollout requests for the asynchronous controller.

    ``requests(group_id)`` takes the next problem of ``stream`` and returns its
    :class:`~areal_fast.controller.messages.GroupRequest` with the group's seed
    (:func:`group_seed`); called with group ids 0, 1, 2, ... it draws the same problems and
    seeds as :meth:`MathRollout.run` does step after step.
    """

    def __init__(self, stream: ProblemStream, prompts: ChatPrompts, params: SamplingParams,
                 run_seed: int):
        self.stream, self.prompts, self.params, self.run_seed = stream, prompts, params, run_seed

    def __call__(self, group_id: int) -> GroupRequest:
        problem = self.stream.next_batch(1)[0]
        return GroupRequest(group_id, self.prompts(problem), self.params,
                            group_seed(self.run_seed, group_id), problem.answer, problem.uid,
                            {"question": problem.question, "answer": problem.answer,
                             "uid": problem.uid})


def eval_requests(problems: list[MathProblem], prompts: ChatPrompts,
                  max_new_tokens: int) -> list[GroupRequest]:
    """Greedy, one-sample requests for held-out ``problems`` (group ids -1, -2, ...)."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return [GroupRequest(-1 - i, prompts(p), params, 0, p.answer, p.uid)
            for i, p in enumerate(problems)]


class MathRollout:
    """Turn problems into scored trajectories with an inference engine, in this process
    (the synchronous reference loop :func:`~areal_fast.controller.loop.train_loop`).

    Parameters
    ----------
    engine : InferenceEngine
    tokenizer : transformers tokenizer (chat template, decoding)
    instruction : str
        Appended to every question (the answer-format instruction).
    run_seed : int, optional
        With a seed, group g is sampled with :func:`group_seed` (run_seed, g), exactly as the
        asynchronous controller does; without one, with torch's global RNG.
    reward_fn : callable (completion_text, answer) -> float
    """

    def __init__(self, engine: InferenceEngine, tokenizer, instruction: str,
                 run_seed: Optional[int] = None, reward_fn: Callable = math_reward):
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_ids = ChatPrompts(tokenizer, instruction)
        self.run_seed = run_seed
        self.reward_fn = reward_fn
        self._next_group = 0

    def run(self, problems: list[MathProblem], params: SamplingParams) -> RolloutResult:
        """Generate ``params.n`` completions per problem and score each.

        Every trajectory gets a globally unique ``group_id`` per problem, its reward, and
        ``info`` with the problem uid, gold answer and decoded completion text.
        """
        start = time.perf_counter()
        seeds = None if self.run_seed is None else [
            group_seed(self.run_seed, self._next_group + i) for i in range(len(problems))]
        trajectories = self.engine.generate([self.prompt_ids(p) for p in problems], params,
                                            seeds=seeds)
        seconds = time.perf_counter() - start
        for traj in trajectories:
            problem = problems[traj.group_id]
            text = self.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
            traj.reward = float(self.reward_fn(text, problem.answer))
            traj.info = {"uid": problem.uid, "answer": problem.answer, "completion": text}
            traj.group_id += self._next_group
        self._next_group += len(problems)
        return RolloutResult(trajectories, seconds)

    def evaluate(self, problems: list[MathProblem], max_new_tokens: int,
                 batch_size: int) -> tuple[float, list[dict]]:
        """Greedy accuracy on ``problems``; also returns one record per problem."""
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
        records, next_group = [], self._next_group
        for start in range(0, len(problems), batch_size):
            chunk = problems[start:start + batch_size]
            for traj in self.run(chunk, params).trajectories:
                records.append({**traj.info, "correct": traj.reward == 1.0})
        self._next_group = next_group  # evaluation does not use up training group ids
        accuracy = sum(r["correct"] for r in records) / max(len(records), 1)
        return accuracy, records
