"""Your own rows (data.task jsonl / hf): loading, splits, pass-through columns, prompts made
from plain text or chat messages, and the one-line errors on bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from areal_fast.controller.requests import ChatPrompts, MathRequests, ProblemStream, eval_requests
from areal_fast.data.config import DataConfig
from areal_fast.data.problems import MathProblem
from areal_fast.data.rewards import DEFAULT_INSTRUCTION, apply_chat_template
from areal_fast.data.user_data import load_user_data
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.inputs import load_datasets, load_eval_set
from areal_fast.rollout.engine import SamplingParams
from areal_fast.wire.codec import decode_message, encode_message

REPO = Path(__file__).resolve().parents[2]
WORD_ARITH = REPO / "examples" / "data" / "word_arith"


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"What is {i} + 1?", "answer": i + 1, "accept": [f"n{i + 1}"], "level": i % 3}
        for i in range(start, start + n)
    ]


def _index(problem: MathProblem) -> int:
    return int(problem.uid.split("/")[-1])


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _cfg(path, **kw) -> DataConfig:
    kw.setdefault("prompt_key", "prompt")
    kw.setdefault("train_size", None)
    return DataConfig(task=kw.pop("task", "jsonl"), path=str(path), **kw)


def test_jsonl_file_draws_held_out_rows_with_eval_seed(tmp_path):
    path = _write(tmp_path / "all.jsonl", _rows(30))
    train, held = load_user_data(_cfg(path, eval_size=8, eval_seed=5))
    assert len(held) == 8 and len(train) == 22
    assert not {p.uid for p in train} & {p.uid for p in held}
    assert sorted(_index(p) for p in train + held) == list(range(30))
    # the documented draw: eval_size row indices sampled with eval_seed, kept in file order
    assert [_index(p) for p in held] == sorted(random.Random(5).sample(range(30), 8))
    assert [_index(p) for p in train] == sorted(_index(p) for p in train)
    assert all(p.uid.startswith("jsonl/all/") for p in train + held)
    again_train, again_held = load_user_data(_cfg(path, eval_size=8, eval_seed=5))
    assert (again_train, again_held) == (train, held)
    _, other = load_user_data(_cfg(path, eval_size=8, eval_seed=6))
    assert [p.uid for p in other] != [p.uid for p in held]
    # train_size draws from the rows left after the held-out ones, with train_seed
    small, held2 = load_user_data(_cfg(path, eval_size=8, eval_seed=5, train_size=10))
    assert held2 == held and len(small) == 10 and set(small) <= set(train)
    small2, _ = load_user_data(_cfg(path, eval_size=8, eval_seed=5, train_size=10, train_seed=1))
    assert small2 != small and set(small2) <= set(train)


def test_problem_carries_the_row():
    train, held = load_user_data(_cfg(WORD_ARITH, eval_size=40))
    assert len(train) == 200 and len(held) == 40
    rows = [json.loads(x) for x in (WORD_ARITH / "train.jsonl").read_text().splitlines()]
    first = train[0]
    assert first.question == rows[0]["prompt"] and first.answer == rows[0]["answer"]
    assert first.uid == "jsonl/train/0" and first.messages is None
    assert first.sample() == {**rows[0], "question": rows[0]["prompt"], "uid": "jsonl/train/0"}
    assert held[0].uid == "jsonl/test/0"
    test_rows = (WORD_ARITH / "test.jsonl").read_text().splitlines()
    assert held[-1].question == json.loads(test_rows[-1])["prompt"]
    assert not {p.question for p in train} & {p.question for p in held}


def test_answers_normalised_and_kept_as_text(tmp_path):
    rows = [
        {"q": "a", "sol": "1,234.50"},
        {"q": "b", "sol": 7},
        {"q": "c", "sol": 2.0},
        {"q": "d", "sol": "  Paris "},
        {"q": "e", "sol": "x"},
    ]
    path = _write(tmp_path / "t.jsonl", rows)
    train, held = load_user_data(_cfg(path, prompt_key="q", answer_key="sol", eval_size=1))
    answers = {p.question: p.answer for p in train + held}
    assert answers == {"a": "1234.5", "b": "7", "c": "2", "d": "Paris", "e": "x"}
    p = next(p for p in train + held if p.question == "a")
    assert p.sample()["answer"] == "1234.5" and p.sample()["sol"] == "1,234.50"


def test_folder_without_test_file_draws_from_train(tmp_path):
    _write(tmp_path / "train.jsonl", _rows(12))
    train, held = load_user_data(_cfg(tmp_path, eval_size=3))
    assert len(train) == 9 and len(held) == 3
    assert all(p.uid.startswith("jsonl/train/") for p in train + held)
    _write(tmp_path / "dev.jsonl", _rows(5, start=100))
    train, held = load_user_data(_cfg(tmp_path, eval_size=3, eval_split="dev"))
    assert len(train) == 12 and [p.uid for p in held] == [
        p.uid for p in held if p.uid.startswith("jsonl/dev/")
    ]


def test_hf_saved_dataset_dict_and_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(_rows(20)),
        test=datasets.Dataset.from_list(_rows(6, start=50)),
    )
    both.save_to_disk(str(tmp_path / "dd"))
    train, held = load_user_data(_cfg(tmp_path / "dd", task="hf", eval_size=4, eval_seed=3))
    assert len(train) == 20 and len(held) == 4
    assert all(p.uid.startswith("hf/test/") for p in held)
    assert held[0].sample()["accept"] == [f"n{int(held[0].answer)}"]
    assert train[3].sample() == {
        **_rows(20)[3],
        "answer": "4",
        "question": "What is 3 + 1?",
        "uid": "hf/train/3",
    }
    datasets.Dataset.from_list(_rows(10)).save_to_disk(str(tmp_path / "one"))
    train, held = load_user_data(_cfg(tmp_path / "one", task="hf", eval_size=2))
    assert len(train) == 8 and len(held) == 2
    assert not {p.uid for p in train} & {p.uid for p in held}


def test_hf_bad_rows_name_dataset_split_and_index(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows(4)
    rows[2]["prompt"] = ""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError) as err:
        load_user_data(_cfg(tmp_path / "bad", task="hf", eval_size=1))
    assert str(err.value) == f"{tmp_path / 'bad'} [train] index 2: 'prompt' is empty"
    datasets.DatasetDict(validation=datasets.Dataset.from_list(_rows(3))).save_to_disk(
        str(tmp_path / "nosplit")
    )
    with pytest.raises(ValueError, match=r"no split 'train' \(data.train_split; its splits: "):
        load_user_data(_cfg(tmp_path / "nosplit", task="hf", eval_size=1))
    with pytest.raises(FileNotFoundError, match="data.path ./nowhere-at-all: no such"):
        load_user_data(_cfg("./nowhere-at-all", task="hf", eval_size=1))


def test_hf_load_failure_is_one_line(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def offline(source, *args, **kwargs):
        calls.append(source)
        raise ConnectionError("Couldn't reach 'someone/set' on the Hub\n(more detail)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError) as err:
        load_user_data(_cfg("someone/set", task="hf", eval_size=1))
    assert calls == ["someone/set"]
    assert str(err.value) == (
        "data.path someone/set: cannot load it as a Hugging Face dataset "
        "(ConnectionError: Couldn't reach 'someone/set' on the Hub)"
    )


def test_messages_key_renders_the_chat_template(tmp_path, tiny_model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = [
        {
            "chat": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{i} + {i}?"},
            ],
            "answer": str(2 * i),
        }
        for i in range(6)
    ]
    path = _write(tmp_path / "chat.jsonl", chats)
    train, held = load_user_data(_cfg(path, prompt_key=None, messages_key="chat", eval_size=2))
    problem = train[0]
    i = int(problem.uid.split("/")[-1])
    assert problem.question == f"{i} + {i}?"
    assert problem.messages == tuple(chats[i]["chat"])
    prompts = ChatPrompts(tok, DEFAULT_INSTRUCTION)
    ids = prompts(problem)
    assert ids == apply_chat_template(tok, chats[i]["chat"])
    text = tok.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{i} + {i}?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert DEFAULT_INSTRUCTION not in text  # messages are sent as given
    # a plain-text problem with the same question gets the instruction appended
    plain = MathProblem(problem.question, problem.answer, "x/0")
    assert plain.prompt_id != problem.prompt_id
    assert DEFAULT_INSTRUCTION in tok.decode(prompts(plain))


def test_columns_reach_group_requests_and_survive_the_wire(tmp_path, tiny_model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    path = _write(tmp_path / "d.jsonl", _rows(6))
    train, held = load_user_data(_cfg(path, eval_size=2))
    prompts = ChatPrompts(tok, "Answer.")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    requests = MathRequests(ProblemStream(train, seed=0), prompts, params, run_seed=1)
    seen = set()
    for group_id in range(len(train)):
        req = requests(group_id)
        row = _rows(6)[int(req.uid.split("/")[-1])]
        assert req.data == {
            **row,
            "answer": str(row["answer"]),
            "question": row["prompt"],
            "uid": req.uid,
        }
        assert req.answer == str(row["answer"])
        back = decode_message(encode_message(req))
        assert back.data == req.data and back.prompt_ids == req.prompt_ids
        seen.add(req.uid)
    assert seen == {p.uid for p in train}
    for req, p in zip(eval_requests(held, prompts, 4), held):
        assert req.data == p.sample() and req.data["accept"] == [f"n{p.answer}"]


def test_experiment_config_loads_and_drops_nothing():
    # examples/custom_data.yaml without its reward line (the reward section is separate)
    text = (REPO / "examples" / "custom_data.yaml").read_text()
    assert "reward: {path: examples/custom_reward.py:reward}" in text
    yaml = "\n".join(line for line in text.splitlines() if not line.startswith("reward:"))
    cfg_path = Path(__import__("tempfile").mkdtemp()) / "custom.yaml"
    cfg_path.write_text(yaml)
    cfg = load_config(str(cfg_path), [f"data.path={WORD_ARITH}"])
    train, held, removed = load_datasets(cfg)
    assert (len(train), len(held), removed) == (200, 40, 0)
    assert load_eval_set(cfg) == held


# --------------------------------------------------------------------------- bad input


def _error(path, **kw) -> str:
    with pytest.raises(ValueError) as err:
        load_user_data(_cfg(path, eval_size=kw.pop("eval_size", 1), **kw))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "row, key, expected",
    [
        ({"answer": "1"}, "prompt", "missing key 'prompt' (keys: answer)"),
        ({"prompt": "q"}, "answer", "missing key 'answer' (keys: prompt)"),
        ({"prompt": ["q"], "answer": "1"}, "prompt", "'prompt' must be a string, got list"),
        ({"prompt": "  ", "answer": "1"}, "prompt", "'prompt' is empty"),
        ({"prompt": "q", "answer": None}, "answer", "'answer' must be a string or a number, got"),
        ({"prompt": "q", "answer": True}, "answer", "'answer' must be a string or a number, got"),
        ({"prompt": "q", "answer": " "}, "answer", "'answer' is empty"),
    ],
)
def test_bad_row_names_file_line_and_key(tmp_path, row, key, expected):
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": "ok2", "answer": "2"}, row]
    path = _write(tmp_path / "bad.jsonl", rows)
    assert _error(path).startswith(f"{path} line 3: {expected}")


@pytest.mark.parametrize(
    "messages, expected",
    [
        ("hi", "'chat' must be a non-empty list of {role, content} messages, got str"),
        ([], "'chat' must be a non-empty list of {role, content} messages, got an empty list"),
        (["hi"], "'chat' message 0 must be an object with role and content, got str"),
        ([{"role": "user"}], "'chat' message 0: 'content' must be a string (missing)"),
        (
            [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}],
            "'chat' message 1: 'role' must be a string (int)",
        ),
    ],
)
def test_malformed_messages(tmp_path, messages, expected):
    rows = [{"chat": [{"role": "user", "content": "ok"}], "answer": "1"}]
    path = _write(tmp_path / "m.jsonl", rows + [{"chat": messages, "answer": "2"}])
    message = _error(path, prompt_key=None, messages_key="chat")
    assert message == f"{path} line 2: {expected}"


def test_invalid_json_line_blank_lines_and_empty_file(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": 2\n')
    assert _error(path).startswith(f"{path} line 3: invalid JSON (")
    path.write_text('{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    assert _error(path) == f"{path} line 2: expected a JSON object, got list"
    path.write_text("\n  \n")
    assert _error(path) == f"{path}: file holds no rows"
    path.write_text('{"prompt": "a", "answer": "1", "when": {"1": [1, {"x": null}]}}\n' * 3)
    load_user_data(_cfg(path, eval_size=1))  # nested plain columns are fine


def test_sizes_and_missing_files(tmp_path):
    path = _write(tmp_path / "s.jsonl", _rows(5))
    assert _error(path, eval_size=5) == (
        f"data.eval_size = 5 leaves no training rows of the 5 rows of {path} "
        "(without a 'test' split the held-out rows are drawn from these)"
    )
    assert _error(path, eval_size=2, train_size=4) == (
        f"data.train_size = 4 exceeds the 3 rows of {path} left after the 2 held-out rows "
        "(null: all of them)"
    )
    _write(tmp_path / "train.jsonl", _rows(5))
    _write(tmp_path / "test.jsonl", _rows(2, start=9))
    assert _error(tmp_path, eval_size=3) == (
        f"data.eval_size = 3 exceeds the 2 rows of {tmp_path / 'test.jsonl'}"
    )
    assert "task 'jsonl' takes none, got 'min_terms'" in _error(path, task_kwargs={"min_terms": 2})
    with pytest.raises(FileNotFoundError, match=r"data.path .*nope.jsonl: no such file or folder"):
        load_user_data(_cfg(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError) as err:
        load_user_data(_cfg(tmp_path, train_split="fit"))
    assert str(err.value) == (
        f"data.path {tmp_path}: no fit.jsonl (data.train_split = fit; .jsonl files there: "
        "s.jsonl, test.jsonl, train.jsonl)"
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [],
            "data.prompt_key / messages_key: data.task=jsonl needs exactly one of them "
            "(neither is set)",
        ),
        (["data.prompt_key=p", "data.messages_key=m"], "(both are set)"),
        (["data.prompt_key=p", "data.path=null"], "data.path is required with data.task=jsonl"),
        (
            ["data.task=hf", "data.prompt_key=p", "data.path=null"],
            "data.path is required with data.task=hf (a Hugging Face dataset id",
        ),
        (
            ["data.task=gsm8k", "data.prompt_key=p"],
            "data.prompt_key is only read by data.task jsonl or hf, not 'gsm8k'",
        ),
        (["data.prompt_key=''"], "data.prompt_key must be a non-empty column name"),
    ],
)
def test_config_errors(overrides, expected):
    args = ["data.task=jsonl", "data.path=x.jsonl", "data.task_kwargs={}", *overrides]
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert expected in str(err.value) and "\n" not in str(err.value)
