"""The record every task loader returns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class MathProblem:
    """One prompt with its reference answer (and, for user datasets, the row it came from).

    Attributes
    ----------
    question : str
        The problem text shown to the model (without any answer-format instruction). For a
        row given as chat messages, the content of its last user message.
    answer : str
        Canonical final answer. Numbers are written without thousands separators or
        trailing zeros (``"1234"``, ``"-2"``, ``"3.5"``); non-numeric answers are kept
        as the source gives them, stripped of surrounding whitespace.
    uid : str
        Stable identifier, ``"<task>/<split or seed>/<index>"``, e.g. ``"gsm8k/test/17"``
        or ``"basic_arithmetic/seed999/5"``.
    messages : tuple of dict, optional
        The prompt as chat messages (``{"role": str, "content": str}`` each), rendered with
        the tokenizer's chat template as given (no instruction is added); None: the prompt
        is ``question`` plus the instruction.
    columns : dict, optional
        Every column of the source row (user datasets; empty for generated tasks and GSM8K).
    """

    question: str
    answer: str
    uid: str
    messages: Optional[tuple] = field(default=None, hash=False)
    columns: dict = field(default_factory=dict, hash=False)

    @property
    def prompt_id(self) -> str:
        """What identifies the prompt: ``question``, or the messages as JSON when given.

        Two problems with the same ``prompt_id`` get the same prompt tokens; held-out
        overlap and duplicate questions are found by it.
        """
        if self.messages is None:
            return self.question
        return json.dumps(list(self.messages), sort_keys=True, ensure_ascii=False)

    def sample(self) -> dict[str, Any]:
        """The sample dict a reward or an agent receives (``GroupRequest.data``).

        Returns
        -------
        dict
            Every column of the row, then ``"answer"`` (the canonical answer string) and
            ``"uid"`` (replacing columns of those names), and ``"question"`` unless the row
            has a column of that name.
        """
        out = dict(self.columns)
        out.setdefault("question", self.question)
        out["answer"] = self.answer
        out["uid"] = self.uid
        return out
