"""Write train.jsonl: correct worked answers to the training problems of examples/arith.yaml.

Each row: {"prompt": str, "completion": str, "answer": str}. The prompt is the user turn that
`areal-fast train` sends for the problem (its question and the answer-format instruction), the
completion the sum written out with its result, e.g. "3 + -7 = -4", which the task's reward
scores 1. The problems are those the RL job trains on (examples/arith.yaml's data.*: the
reasoning-gym generator with its seed; the held-out questions removed), so the same run of
this script writes the same file and no held-out question is in it.

    python examples/data/sft_arith/make.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from areal_fast.data.rewards import build_prompt_messages, math_reward
from areal_fast.launch.config import load_config
from areal_fast.launch.inputs import load_datasets

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parents[1] / "arith.yaml"


def worked_answer(question: str, answer: str) -> str:
    """``"Calculate ( -9 + 8 )."`` and ``"-1"`` -> ``"-9 + 8 = -1"``."""
    expression = re.sub(r"^Calculate\s+|\.\s*$", "", question.strip())
    expression = re.sub(r"^\(\s*(.*?)\s*\)$", r"\1", expression)
    return f"{expression} = {answer}"


def rows() -> list[dict]:
    """One row per training problem of examples/arith.yaml, each checked by its reward."""
    cfg = load_config(str(CONFIG))
    train, _, _ = load_datasets(cfg)
    out = []
    for problem in train:
        completion = worked_answer(problem.question, problem.answer)
        if math_reward(completion, problem.answer) != 1.0:
            raise ValueError(f"{problem.uid}: {completion!r} does not score 1")
        prompt = build_prompt_messages(problem.question, cfg.data.instruction)[0]["content"]
        out.append({"prompt": prompt, "completion": completion, "answer": problem.answer})
    return out


def main() -> None:
    """Write ``train.jsonl`` beside this script."""
    written = rows()
    path = HERE / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in written))
    print(f"wrote {len(written)} rows to {path}")


if __name__ == "__main__":
    main()
