"""Tests for areal_fast.data: GSM8K loading, task registry, answer extraction, rewards, prompts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_fast.data import (
    DEFAULT_INSTRUCTION,
    MathProblem,
    apply_chat_template,
    build_prompt_messages,
    drop_eval_overlap,
    extract_answer,
    known_tasks,
    load_gsm8k,
    load_problems,
    math_reward,
    normalize_number,
)

GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared/data/gsm8k"
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K_DIR / "test.jsonl").is_file(), reason=f"GSM8K files not present at {GSM8K_DIR}"
)

ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))


def _write_jsonl(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _row(question: str = "What is 2 + 2?", answer: str = "2 + 2 = 4\n#### 4") -> str:
    return json.dumps({"question": question, "answer": answer})


# --------------------------------------------------------------------------- GSM8K


@needs_gsm8k
def test_gsm8k_real_test_split():
    problems = load_gsm8k(str(GSM8K_DIR), split="test")
    assert len(problems) == 1319
    first = problems[0]
    assert first.question.startswith("Janet")
    assert first.answer == "18"
    assert first.uid == "gsm8k/test/0"
    assert problems[17].uid == "gsm8k/test/17"
    assert len({p.uid for p in problems}) == 1319
    for p in problems:
        assert normalize_number(p.answer) == p.answer  # every gold answer is canonical
        assert "," not in p.answer


@needs_gsm8k
def test_gsm8k_file_path_and_commas():
    problems = load_gsm8k(str(GSM8K_DIR / "train.jsonl"))
    assert len(problems) == 7473
    assert problems[0].uid == "gsm8k/train/0"
    raw = [json.loads(line) for line in (GSM8K_DIR / "train.jsonl").open(encoding="utf-8")]
    with_comma = [i for i, r in enumerate(raw) if "," in r["answer"].rsplit("####", 1)[1]]
    assert with_comma, "train split is expected to contain answers like '#### 1,200'"
    i = with_comma[0]
    assert problems[i].answer == raw[i]["answer"].rsplit("####", 1)[1].strip().replace(",", "")


def test_gsm8k_directory_split_and_uids(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [_row(), _row("Q2", "x\n#### -1,250.50")])
    problems = load_gsm8k(str(tmp_path), split="train")
    assert problems == [
        MathProblem("What is 2 + 2?", "4", "gsm8k/train/0"),
        MathProblem("Q2", "-1250.5", "gsm8k/train/1"),
    ]


def test_gsm8k_bad_json_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [_row(), _row(), '{"question": "oops", '])
    with pytest.raises(ValueError) as info:
        load_gsm8k(str(path))
    msg = str(info.value)
    assert "broken.jsonl" in msg and "line 3" in msg and "invalid JSON" in msg
    assert "\n" not in msg


def test_gsm8k_missing_final_answer(tmp_path):
    path = _write_jsonl(tmp_path / "nohash.jsonl", [_row(), _row(answer="2 + 2 = 4")])
    with pytest.raises(ValueError, match=r"nohash\.jsonl line 2.*####"):
        load_gsm8k(str(path))
    path = _write_jsonl(tmp_path / "word.jsonl", [_row(answer="so\n#### four")])
    with pytest.raises(ValueError, match=r"word\.jsonl line 1"):
        load_gsm8k(str(path))


def test_gsm8k_missing_key(tmp_path):
    path = _write_jsonl(tmp_path / "nokey.jsonl", [_row(), json.dumps({"question": "Q"})])
    with pytest.raises(ValueError, match=r"nokey\.jsonl line 2: missing key 'answer'"):
        load_gsm8k(str(path))
    path = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl line 1: expected a JSON object"):
        load_gsm8k(str(path))


def test_gsm8k_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        load_gsm8k(str(tmp_path / "nothere.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl"):
        load_gsm8k(str(tmp_path), split="test")
    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no rows"):
        load_gsm8k(str(empty))


def test_gsm8k_hub_id_without_datasets():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="datasets"):
            load_gsm8k("openai/gsm8k")
    else:
        pytest.skip("datasets is installed; hub loading would need the network")


@needs_gsm8k
def test_load_problems_gsm8k_subset_is_seeded():
    a = load_problems("gsm8k", split="test", size=50, seed=3, path=str(GSM8K_DIR))
    b = load_problems("gsm8k", split="test", size=50, seed=3, path=str(GSM8K_DIR))
    c = load_problems("gsm8k", split="test", size=50, seed=4, path=str(GSM8K_DIR))
    assert a == b
    assert [p.uid for p in a] != [p.uid for p in c]
    assert len({p.uid for p in a}) == 50
    indices = [int(p.uid.rsplit("/", 1)[1]) for p in a]
    assert indices == sorted(indices)
    full = load_problems("gsm8k", split="test", size=None, seed=0, path=str(GSM8K_DIR))
    assert len(full) == 1319
    with pytest.raises(ValueError, match="exceeds"):
        load_problems("gsm8k", split="test", size=5000, seed=0, path=str(GSM8K_DIR))


# --------------------------------------------------------------------------- tasks


def test_reasoning_gym_basic_arithmetic():
    problems = load_problems(
        "basic_arithmetic", split="train", size=20, seed=999, task_kwargs=ARITH
    )
    assert len(problems) == 20
    assert problems[5].uid == "basic_arithmetic/seed999/5"
    for p in problems:
        assert p.question.startswith("Calculate ") and "+" in p.question
        expression = p.question.removeprefix("Calculate ").removesuffix(".")
        assert re.fullmatch(r"[-+() 0-9]+", expression), expression
        assert int(p.answer) == eval(expression)  # digits, signs and brackets only


def test_reasoning_gym_determinism():
    a = load_problems("basic_arithmetic", split="train", size=30, seed=1, task_kwargs=ARITH)
    b = load_problems("basic_arithmetic", split="train", size=30, seed=1, task_kwargs=ARITH)
    c = load_problems("basic_arithmetic", split="eval", size=30, seed=2, task_kwargs=ARITH)
    assert a == b
    assert [p.question for p in a] != [p.question for p in c]


def test_task_kwargs_lists_accepted():
    as_list = dict(ARITH, operators=["+"])
    a = load_problems("basic_arithmetic", split="train", size=5, seed=0, task_kwargs=as_list)
    assert a == load_problems("basic_arithmetic", split="train", size=5, seed=0, task_kwargs=ARITH)


def test_unknown_task_and_bad_kwargs():
    with pytest.raises(ValueError, match=r"unknown task 'xyz'; known: gsm8k, basic_arithmetic"):
        load_problems("xyz", split="train", size=5, seed=0)
    with pytest.raises(ValueError, match="did you mean basic_arithmetic"):
        load_problems("basic_arithmtic", split="train", size=5, seed=0)
    with pytest.raises(ValueError, match="no option 'max_digitz'"):
        load_problems(
            "basic_arithmetic", split="train", size=5, seed=0, task_kwargs={"max_digitz": 1}
        )
    with pytest.raises(ValueError, match="'seed'"):
        load_problems("basic_arithmetic", split="train", size=5, seed=0, task_kwargs={"seed": 1})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        load_problems(
            "basic_arithmetic",
            split="train",
            size=5,
            seed=0,
            task_kwargs={"min_terms": 4, "max_terms": 2},
        )
    with pytest.raises(ValueError, match="takes no task_kwargs"):
        load_problems("gsm8k", split="train", size=5, seed=0, task_kwargs={"foo": 1})
    with pytest.raises(ValueError, match="size"):
        load_problems("basic_arithmetic", split="train", size=0, seed=0)
    names = known_tasks()
    assert names[0] == "gsm8k" and "basic_arithmetic" in names and len(names) > 50


def test_drop_eval_overlap():
    train = load_problems("basic_arithmetic", split="train", size=300, seed=0, task_kwargs=ARITH)
    held = load_problems("basic_arithmetic", split="eval", size=200, seed=999, task_kwargs=ARITH)
    kept, removed = drop_eval_overlap(train, held)
    held_questions = {p.question for p in held}
    assert removed > 0  # single-digit sums repeat across seeds
    assert removed == len(train) - len(kept)
    assert not any(p.question in held_questions for p in kept)
    assert kept == [p for p in train if p.question not in held_questions]

    toy_train = [MathProblem("a  b", "1", "t/0"), MathProblem("c", "2", "t/1")]
    kept, removed = drop_eval_overlap(toy_train, [MathProblem("a b", "1", "e/0")])
    assert (kept, removed) == ([toy_train[1]], 1)


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (r"The sum is 5 + 7 = 12, so the answer is \boxed{12}.", "12"),
        (r"\boxed{12}", "12"),
        ("The answer is 1,234.", "1234"),
        ("-3", "-3"),
        ("x = 4.50", "4.5"),
        ("Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", "18"),
        ("#### 1,000,000", "1000000"),
        ("First 3 apples, then 4 more. The answer is 7 apples.", "7"),
        ("Answer: $42.00", "42"),
        ("So she has 20 - 25 = -5 dollars left.", "-5"),
        ("It drops to −7 degrees.", "-7"),
        ("Total: 0.5 + 0.25 = 0.75.", "0.75"),
        (r"We get \boxed{\$1,250}", "1250"),
        (r"\boxed{18 \text{ dollars}}", "18"),
        (r"\boxed{x = 3}", "3"),
        (r"Step 1: 2+3. Step 2: \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        ("The final answer is: 13", "13"),
        ("13\n\nThe result above is correct.", "13"),
        ("Calculate 5 + 8. 5 + 8 = 13.", "13"),
        ("I am not sure how to solve this.", None),
        ("", None),
        ("<|endoftext|><|im_end|>", None),
    ],
)
def test_extract_answer(reply, expected):
    assert extract_answer(reply) == expected


def test_extract_answer_non_string():
    assert extract_answer(None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", "1234"),
        ("$12.50", "12.5"),
        ("-3.", "-3"),
        ("+7", "7"),
        ("45%", "45"),
        ("0.000001", "0.000001"),
        ("-0", "0"),
        ("1e5", None),
        ("12 apples", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


# --------------------------------------------------------------------------- rewards


def test_math_reward_numeric():
    assert math_reward(r"so \boxed{1234}", "1234") == 1.0
    assert math_reward("The answer is 1,234.", "1234") == 1.0
    assert math_reward("x = 4.50", "4.5") == 1.0
    assert math_reward("3.5000001", "3.5") == 1.0
    assert math_reward("3.51", "3.5") == 0.0
    assert math_reward("13", "12") == 0.0
    assert math_reward("-3", "3") == 0.0
    assert math_reward("no idea", "3") == 0.0
    assert math_reward("", "3") == 0.0


def test_math_reward_symbolic_fallback():
    assert math_reward(r"\boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward(r"The answer is \boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_reward(r"\boxed{\frac{1}{3}}", r"\frac{1}{2}") == 0.0
    assert math_reward(r"\boxed{Yes}", "yes") == 1.0


@pytest.mark.parametrize(
    "weird",
    [
        r"\boxed{",
        r"\boxed{\frac{1}{",
        "}}}{{{",
        "$" * 500,
        "9" * 5000,
        "\x00\ufffd",
        r"\boxed{}" * 3,
        None,
        12,
    ],
)
def test_math_reward_never_raises(weird):
    assert math_reward(weird, r"\frac{1}{2}") in (0.0, 1.0)
    assert math_reward(weird, "7") in (0.0, 1.0)


def test_math_reward_gold_type_checked():
    with pytest.raises(TypeError):
        math_reward("7", 7)  # type: ignore[arg-type]


def test_math_reward_off_main_thread():
    results: list[float] = []
    cases = [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        ("12", "13"),
        ("7", "7"),
    ]

    def work():
        results.extend(math_reward(text, gold) for text, gold in cases)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results == [1.0, 1.0, 0.0, 1.0]


# --------------------------------------------------------------------------- prompts


def test_build_prompt_messages():
    messages = build_prompt_messages("Calculate 5 + 8.", DEFAULT_INSTRUCTION)
    assert messages == [
        {"role": "user", "content": "Calculate 5 + 8.\nGive only the final answer as a number."}
    ]
    assert build_prompt_messages("Q") == build_prompt_messages("Q", DEFAULT_INSTRUCTION)
    assert build_prompt_messages("Q", "") == [{"role": "user", "content": "Q"}]


def _tiny_tokenizer(chat_template: str | None):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["[UNK]", "<s>", "<|user|>", "<|assistant|>", "<|end|>", "Calculate", "5", "+", "8"]
    words += [".", "Give", "only", "the", "final", "answer", "as", "a", "number", "Answer", ":"]
    vocab = {w: i for i, w in enumerate(words)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    pre = tokenizers.pre_tokenizers
    pieces = tokenizers.Regex(r"<\|[a-z]+\|>|\w+|[^\w\s]")
    backend.pre_tokenizer = pre.Sequence([pre.WhitespaceSplit(), pre.Split(pieces, "isolated")])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = chat_template
    return tok, vocab


def test_apply_chat_template_with_template():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok, vocab = _tiny_tokenizer(template)
    ids = apply_chat_template(tok, build_prompt_messages("Calculate 5 + 8."))
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert ids[0] == vocab["<|user|>"]
    assert ids[-1] == vocab["<|assistant|>"]  # generation prompt appended
    assert ids[1:5] == [vocab["Calculate"], vocab["5"], vocab["+"], vocab["8"]]
    assert vocab["[UNK]"] not in ids


def test_apply_chat_template_without_template():
    tok, vocab = _tiny_tokenizer(None)
    ids = apply_chat_template(tok, build_prompt_messages("Calculate 5 + 8."))
    assert ids == tok.encode("Calculate 5 + 8.\nGive only the final answer as a number.\nAnswer:")
    assert ids[-2:] == [vocab["Answer"], vocab[":"]]


def test_math_verify_off_the_main_thread_warns_nothing(tmp_path):
    """A reward thread (reward.path runs in a pool of them) calls math_verify with its
    timeout off, on purpose: math_verify's "Timeout is disabled" warnings (one from parse,
    one from verify in each process) are not shown; a fresh process, since they come once."""
    code = (
        "import threading\n"
        "from areal_fast.data.rewards import math_reward\n"
        "out = []\n"
        "def score():\n"
        "    out.append(math_reward('The answer is 0.5', '\\\\frac{1}{2}'))\n"
        "thread = threading.Thread(target=score)\n"
        "thread.start()\n"
        "thread.join()\n"
        "print(out[0], math_reward('The answer is 0.5', '\\\\frac{1}{2}'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1.0", "1.0"]  # symbolic equivalence on either thread
    assert "Timeout is disabled" not in proc.stderr, proc.stderr
