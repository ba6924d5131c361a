"""Write train.jsonl (200 rows) and test.jsonl (40 rows): short word arithmetic questions.

Each row: {"prompt": str, "answer": "<number>", "accept": ["<the number in words>"], "op": str}.
The same seed writes the same files; no question is in both.

    python examples/data/word_arith/make.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
ONES += "fifteen sixteen seventeen eighteen nineteen"
ONES = ONES.split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "stamps", "marbles", "books", "shells", "coins", "pencils", "cards"]


def in_words(n: int) -> str:
    """English words of 0 <= n < 1000, e.g. 42 -> "forty-two"."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + in_words(rest))


def question(rng: random.Random) -> tuple[str, int, str]:
    """One (question, answer, operation) drawn from ``rng``."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    op = rng.choice(["add", "subtract", "multiply"])
    if op == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        text = f"{name} has {in_words(a)} {thing} and gets {in_words(b)} more."
        return f"{text} How many {thing} does {name} have now?", a + b, op
    if op == "subtract":
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        text = f"{name} has {in_words(a)} {thing} and gives away {in_words(b)}."
        return f"{text} How many {thing} are left?", a - b, op
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    text = f"{name} has {in_words(a)} boxes with {in_words(b)} {thing} in each box."
    return f"{text} How many {thing} is that in all?", a * b, op


def rows(count: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """``count`` rows with questions not in ``seen`` (added to it)."""
    out = []
    while len(out) < count:
        prompt, answer, op = question(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append(
            {"prompt": prompt, "answer": str(answer), "accept": [in_words(answer)], "op": op}
        )
    return out


def main() -> None:
    here = Path(__file__).resolve().parent
    rng, seen = random.Random(2026), set()
    for name, count in (("train", 200), ("test", 40)):
        lines = [json.dumps(row) for row in rows(count, rng, seen)]
        (here / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
