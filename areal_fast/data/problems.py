"""The record every task loader returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MathProblem:
    """One question with its reference answer.

    Attributes
    ----------
    question : str
        The problem text shown to the model (without any answer-format instruction).
    answer : str
        Canonical final answer. Numbers are written without thousands separators or
        trailing zeros (``"1234"``, ``"-2"``, ``"3.5"``); non-numeric answers are kept
        as the source gives them, stripped of surrounding whitespace.
    uid : str
        Stable identifier, ``"<task>/<split or seed>/<index>"``, e.g. ``"gsm8k/test/17"``
        or ``"basic_arithmetic/seed999/5"``.
    """

    question: str
    answer: str
    uid: str
