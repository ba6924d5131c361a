"""A reward for ``reward.path: examples/custom_reward.py:reward``: the completion's final answer
must match the row's ``answer`` or one of its other accepted spellings (``accept``).

Rows look like ``{"prompt": "...", "answer": "56", "accept": ["fifty-six"]}``: every column of
the dataset row reaches the reward in ``sample`` (with ``uid`` and ``answer``).
"""

from __future__ import annotations

import re

from areal_fast.data.rewards import math_reward

_WORD = re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)*")


def reward(completion: str, sample: dict) -> float:
    """1.0 if ``completion``'s final answer is ``sample["answer"]`` or any of
    ``sample.get("accept", [])``, else 0.0.

    A numeric answer is compared as a number (``"1,234"``, ``"\\boxed{56}"``, ``"The answer
    is 56."`` all match ``"56"``: :func:`areal_fast.data.rewards.math_reward`); a spelled-out
    one (``"fifty-six"``) must be the completion's last word, case ignored.
    """
    accepted = [str(sample["answer"]), *(str(a) for a in sample.get("accept", []))]
    if any(math_reward(completion, gold) == 1.0 for gold in accepted):
        return 1.0
    words = _WORD.findall(completion)
    last = words[-1].lower() if words else ""
    return 1.0 if last and any(last == gold.strip().lower() for gold in accepted) else 0.0
