"""SFT rows: prompt/completion and chat rows tokenized with the loss on completion and
assistant tokens only; bad rows refused with one line naming file, row and key."""

from __future__ import annotations

import json

import pytest

from areal_fast.data.sft_data import (
    SftDataConfig,
    conversation_tokens,
    load_sft_examples,
    step_rows,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _trained_spans(tokenizer, example) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    spans, run = [], []
    for token, trained in zip(example.input_ids + [None], example.targets + [False]):
        if trained:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def test_multi_turn_conversation_trains_only_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+5?"},
        {"role": "assistant", "content": "3+5=8"},
    ]
    example = conversation_tokens(tokenizer, messages)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(example.input_ids) == whole
    # each assistant turn's content and end-of-turn, never its header nor another role's text
    assert _trained_spans(tokenizer, example) == ["4<|im_end|>\n", "3+5=8<|im_end|>\n"]
    assert example.num_targets == len("4") + 2 + len("3+5=8") + 2


def _write(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_completion_rows(tokenizer, tmp_path):
    path = _write(
        tmp_path, [{"prompt": "1+1", "completion": "2"}, {"prompt": "q", "completion": "ab"}]
    )
    examples = load_sft_examples(SftDataConfig(path=path), tokenizer, 64)
    assert [_trained_spans(tokenizer, e) for e in examples] == [
        ["2<|im_end|>\n"],
        ["ab<|im_end|>\n"],
    ]
    plain = load_sft_examples(SftDataConfig(path=path, chat_template=False), tokenizer, 64)
    assert tokenizer.decode(plain[0].input_ids) == "1+12<|im_end|>"
    assert _trained_spans(tokenizer, plain[0]) == ["2<|im_end|>"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "1+1"}, "line 2: missing key 'completion' (keys: prompt)"),
        ({"prompt": "1+1", "completion": "  "}, "line 2: 'completion' is empty"),
        ({"prompt": "1+1", "completion": 3}, "line 2: 'completion' must be a string, got int"),
        (
            {"prompt": "x" * 40, "completion": "2"},
            "line 2: 'prompt' + 'completion' is 62 tokens, more than actor.max_tokens_per_mb = 32",
        ),
    ],
)
def test_bad_rows_name_file_row_and_key(tokenizer, tmp_path, bad, message):
    path = _write(tmp_path, [{"prompt": "a", "completion": "b"}, bad])
    with pytest.raises(ValueError) as info:
        load_sft_examples(SftDataConfig(path=path), tokenizer, 32)
    assert str(info.value).startswith(f"{path} {message}")
    assert "\n" not in str(info.value)


def test_conversation_rows_need_an_assistant_turn(tokenizer, tmp_path):
    path = _write(tmp_path, [{"chat": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"line 1: 'chat': no assistant message"):
        load_sft_examples(SftDataConfig(path=path, messages_key="chat"), tokenizer, 64)


def test_step_rows_are_a_function_of_seed_and_step():
    steps = [step_rows(10, 4, seed=3, step=s) for s in range(5)]
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert steps[3] == step_rows(10, 4, seed=3, step=3)  # no state between calls
    assert step_rows(10, 4, seed=4, step=0) != steps[0]


def test_hf_rows_from_a_saved_dataset(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "1+1", "completion": "2"}, {"prompt": "2+2", "completion": None}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "ds")
    d = SftDataConfig(task="hf", path=str(tmp_path / "ds"), max_rows=1)
    (example,) = load_sft_examples(d, tokenizer, 64)
    assert _trained_spans(tokenizer, example) == ["2<|im_end|>\n"]
    with pytest.raises(ValueError, match=r"\[train\] index 1: 'completion' must be a string"):
        load_sft_examples(SftDataConfig(task="hf", path=str(tmp_path / "ds")), tokenizer, 64)


def test_sft_arith_rows_are_correct_worked_answers():
    """examples/data/sft_arith/train.jsonl as its script writes it: each completion the sum
    written out, scored 1 by the task's reward; no held-out question among the prompts."""
    import importlib.util
    from pathlib import Path

    from areal_fast.data.rewards import DEFAULT_INSTRUCTION, math_reward

    folder = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft_arith"
    spec = importlib.util.spec_from_file_location("sft_arith_make", folder / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert make.worked_answer("Calculate ( -9 + 8 ).", "-1") == "-9 + 8 = -1"
    assert make.worked_answer("Calculate 3 + -7.", "-4") == "3 + -7 = -4"
    rows = [json.loads(x) for x in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) > 1000
    for row in rows:
        assert row["prompt"].endswith("\n" + DEFAULT_INSTRUCTION)
        assert math_reward(row["completion"], row["answer"]) == 1.0
    from areal_fast.launch.config import load_config
    from areal_fast.launch.inputs import load_eval_set

    held_out = load_eval_set(load_config(str(folder.parents[1] / "arith.yaml")))
    questions = {r["prompt"].split("\n")[0] for r in rows}
    assert not questions & {p.question for p in held_out}
