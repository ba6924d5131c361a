"""The search agent example: its corpus generator, its BM25 retrieval, its reward, and a
2-step training job on the tiny model (examples/agent_search.yaml)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("bm25s")

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "examples" / "agents"
CONFIG = ROOT / "examples" / "agent_search.yaml"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", AGENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make = _module("make_search_corpus")
search = _module("search_agent")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("search_task")
    assert make.write_task(out, seed=3) == {"corpus": 170, "train": 244, "test": 40}
    return out


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def test_every_question_needs_its_two_documents(task):
    docs = {d["id"]: d for d in _read(task / "corpus.jsonl")}
    rows = _read(task / "train.jsonl") + _read(task / "test.jsonl")
    titles = [d["title"] for d in docs.values()]
    # entity names are unique, and so is every word of them (but company suffixes)
    assert len(set(titles)) == len(titles)
    words = [w for t in titles for w in t.split() if w not in make.COMPANY_SUFFIXES]
    assert len(set(words)) == len(words)
    assert len({r["question"] for r in rows}) == len(rows) == 284
    assert {r["kind"] for r in rows} == set(make.KINDS)
    for r in rows:
        first, second = (docs[i] for i in r["docs"])
        entity = first["title"]
        assert _mentions(r["question"], entity)
        # the first document leads to the second, which holds the answer
        assert _mentions(first["text"], second["title"])
        assert not _mentions(r["question"], second["title"])
        assert _mentions(second["text"], r["answer"])
        # no document holds both the question's entity and the answer
        for d in docs.values():
            text = f"{d['title']}. {d['text']}"
            assert not (_mentions(text, entity) and _mentions(text, r["answer"])), (r, d)


def test_the_answers_follow_from_the_documents(task):
    """Reading the answer off the two documents by their sentence patterns gives the row's."""
    docs = {d["id"]: d["text"] for d in _read(task / "corpus.jsonl")}
    pattern = {
        "founder_city": r"in the city of (\w+)\.",
        "founder_year": r"born in (\d{4})",
        "hq_country": r"is a city in (\w+),",
        "birth_country": r"is a city in (\w+),",
        "city_currency": r"Its currency is the (\w+)",
    }
    for r in _read(task / "train.jsonl"):
        [found] = re.findall(pattern[r["kind"]], docs[r["docs"][1]])
        assert found == r["answer"]


def test_the_generator_is_deterministic_and_the_committed_data_is_its_output(tmp_path):
    make.main([str(tmp_path / "a"), "--seed", "0"])
    for name in ("corpus", "train", "test"):
        written = (tmp_path / "a" / f"{name}.jsonl").read_bytes()
        assert written == (AGENTS / "search_data" / f"{name}.jsonl").read_bytes(), name
    make.write_task(tmp_path / "b", seed=1)
    assert (tmp_path / "b" / "test.jsonl").read_bytes() != written


def test_generator_errors_name_the_argument(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make.main([str(tmp_path), "--test-size", "500"])
    assert "test_size = 500 must be in [0, 284)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="people = 3 must be >= companies = 5"):
        make.write_task(tmp_path, people=3, companies=5)


def test_each_document_is_the_first_hit_for_its_name(task):
    index = search.load_index(str(task / "corpus.jsonl"))
    assert search.load_index(str(task / "corpus.jsonl")) is index  # built once per process
    for doc in index.docs:
        assert [d["id"] for d in index.search(doc["title"], k=1)] == [doc["id"]]
    rows = _read(task / "train.jsonl")
    # the whole question finds its first document for every kind but city_currency (whose
    # words "currency" and "country" pull up the few country documents)
    for r in rows:
        hits = [d["id"] for d in index.search(r["question"], k=3)]
        assert (r["docs"][0] in hits) or r["kind"] == "city_currency", r
    assert index.search("zzzq of the", k=3) == []
    # "city" is in the 24 city documents and the 80 people's ("born ... in the city of")
    assert len(index.search("city", k=500)) == 24 + 80


def test_bad_corpus_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file .*make_search_corpus.py"):
        search.load_index(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "A", "text": "x"}\n\n{"id": "b", "title": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 3: 'title' must be a string"):
        search.load_index(str(bad))


def test_exact_match_normalises_the_final_answer():
    assert search.exact_match("I searched. Answer: The Grilkelia.", "Grilkelia") == 1.0
    assert search.exact_match("  grilkelia ", "Grilkelia") == 1.0
    assert search.exact_match("Answer: 1952", "1952") == 1.0
    assert search.exact_match("Answer: Grilkelia, I think", "Grilkelia") == 0.0
    assert search.exact_match("Answer:", "Grilkelia") == 0.0
    assert search.exact_match("answer: MARK", "mark") == 1.0


class _ScriptedClient:
    """Replies with the given messages in turn, recording what it was sent."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, model, messages, tools):
        from openai.types.chat import ChatCompletion

        self.sent.append(messages)
        message = {"role": "assistant", **self.replies.pop(0)}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        response = {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
        return ChatCompletion.model_validate({**response, "choices": [choice]})


def _call(arguments: str, name: str = "search") -> dict:
    function = {"name": name, "arguments": arguments}
    return {"content": None, "tool_calls": [{"id": "t", "type": "function", "function": function}]}


def test_the_agent_searches_twice_then_answers(task):
    rows = _read(task / "train.jsonl")
    row = next(r for r in rows if r["kind"] == "founder_city")
    docs = {d["id"]: d for d in _read(task / "corpus.jsonl")}
    bridge = docs[row["docs"][1]]["title"]
    company = docs[row["docs"][0]]["title"]
    client = _ScriptedClient(
        [
            _call(json.dumps({"query": company})),
            _call(json.dumps({"query": bridge})),
            {"content": f"Answer: {row['answer']}"},
        ]
    )
    agent = search.SearchAgent(corpus=str(task / "corpus.jsonl"), top_k=2)
    assert asyncio.run(agent.run_agent_return_reward(row, client)) == 1.0
    # the worked example comes first, then the question
    assert client.sent[0][: len(search.DEMONSTRATION)] == search.DEMONSTRATION
    assert client.sent[0][-1]["content"].startswith(row["question"])
    episode = client.sent[-1][len(search.DEMONSTRATION) :]
    tool_results = [m["content"] for m in episode if m["role"] == "tool"]
    assert len(tool_results) == 2
    assert tool_results[0].startswith("[1] " + docs[row["docs"][0]]["text"])
    assert tool_results[1].startswith("[1] " + docs[row["docs"][1]]["text"])
    # a bad tool call gets an error line back; still searching after max_turns earns 0
    agent = search.SearchAgent(corpus=str(task / "corpus.jsonl"), max_turns=2, demonstration=False)
    client = _ScriptedClient([_call("not json"), _call("{}", name="browse")])
    assert asyncio.run(agent.run_agent_return_reward(row, client)) == 0.0
    assert client.sent[0] == [
        {"role": "user", "content": f"{row['question']}\n{search.INSTRUCTION}"}
    ]
    assert client.sent[-1][-1]["content"].startswith("error: arguments must be a JSON object")
    with pytest.raises(ValueError, match="top_k = 0"):
        search.SearchAgent(corpus=str(task / "corpus.jsonl"), top_k=0)


def test_two_training_steps_on_the_tiny_model(tiny_model_dir, tmp_path, task):
    from areal_fast.agent.session import Session
    from areal_fast.agent.store import read_trajectories
    from areal_fast.cli import main

    args = [
        "train",
        "--config",
        str(CONFIG),
        "--no-progress",
        f"model.path={tiny_model_dir}",
        f"fileroot={tmp_path}",
        f"data.path={task}",
        f"agent.path={AGENTS / 'search_agent.py'}:SearchAgent",
        f"agent.kwargs.corpus={task / 'corpus.jsonl'}",
        "total_steps=2",
        "batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "data.train_size=20",
        "data.eval_size=4",
    ]
    assert main(args) == 0
    run = tmp_path / "agent-search" / "trial0"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["agent/sessions"] >= 8
    assert records[-1]["agent/sessions_dropped"] == 0
    sessions = [Session.from_dict(r) for r in read_trajectories(run / "trajectories")]
    assert sessions and all(s.status == "done" for s in sessions)
    for s in sessions:
        assert 1 <= len(s.calls) <= 4 and s.reward in (0.0, 1.0)
        assert all(c.tools[0]["function"]["name"] == "search" for c in s.calls)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts_trained"] == 4  # groups: 2 steps of batch_size 2
