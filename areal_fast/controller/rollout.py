"""Math rollout: prompts through the engine, completions scored into trajectories."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import apply_chat_template, build_prompt_messages, math_reward
from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import InferenceEngine, SamplingParams


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


class MathRollout:
    """Turn problems into scored trajectories with an inference engine.

    Parameters
    ----------
    engine : InferenceEngine
    tokenizer : transformers tokenizer (chat template, decoding)
    instruction : str
        Appended to every question (the answer-format instruction).
    """

    def __init__(self, engine: InferenceEngine, tokenizer, instruction: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.instruction = instruction
        self._prompt_cache: dict[str, list[int]] = {}
        self._next_group = 0

    def prompt_ids(self, problem: MathProblem) -> list[int]:
        """Chat-templated prompt token ids of ``problem`` (cached)."""
        if problem.question not in self._prompt_cache:
            messages = build_prompt_messages(problem.question, self.instruction)
            self._prompt_cache[problem.question] = apply_chat_template(self.tokenizer, messages)
        return self._prompt_cache[problem.question]

    def run(self, problems: list[MathProblem], params: SamplingParams) -> RolloutResult:
        """Generate ``params.n`` completions per problem and score each.

        Every trajectory gets a globally unique ``group_id`` per problem, its reward, and
        ``info`` with the problem uid, gold answer and decoded completion text.
        """
        start = time.perf_counter()
        trajectories = self.engine.generate([self.prompt_ids(p) for p in problems], params)
        seconds = time.perf_counter() - start
        for traj in trajectories:
            problem = problems[traj.group_id]
            text = self.tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
            traj.reward = math_reward(text, problem.answer)
            traj.info = {"uid": problem.uid, "answer": problem.answer, "completion": text}
            traj.group_id += self._next_group
        self._next_group += len(problems)
        return RolloutResult(trajectories, seconds)

    def evaluate(self, problems: list[MathProblem], max_new_tokens: int,
                 batch_size: int) -> tuple[float, list[dict]]:
        """Greedy accuracy on ``problems``; also returns one record per problem."""
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
        records = []
        for start in range(0, len(problems), batch_size):
            chunk = problems[start:start + batch_size]
            for traj in self.run(chunk, params).trajectories:
                records.append({**traj.info, "correct": traj.reward == 1.0})
        accuracy = sum(r["correct"] for r in records) / max(len(records), 1)
        return accuracy, records
