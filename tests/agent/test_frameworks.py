"""Agents written with real frameworks (the OpenAI Agents SDK, LangGraph + langchain-openai)
train token-exactly: the examples/agents/ framework agents against the endpoint with a scripted
engine (tool calls every time), and as 2-step `areal-fast train` jobs on the tiny model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
import torch

from areal_fast._user_code import import_attribute
from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.session import Session
from areal_fast.agent.store import read_trajectories
from areal_fast.cli import main
from areal_fast.rl.batch import IGNORE_INDEX, pack_trajectories

pytest.importorskip("agents")
pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from test_server import TOOL_REPLY, Scripted, serving  # noqa: E402 - after the skips
from test_workload import documented_step_keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "examples" / "agents"
SDK_AGENT = f"{AGENTS / 'openai_agents_calculator.py'}:OpenAIAgentsCalculator"
GRAPH_AGENT = f"{AGENTS / 'langgraph_calculator.py'}:LangGraphCalculator"


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    from areal_fast.models.loading import DEMO_MODEL, load_tokenizer

    return ChatFormat(load_tokenizer(DEMO_MODEL))


def assert_token_exact(session: Session) -> None:
    """Every call continues the previous one's exact ids, and the exported sequence trains
    exactly the sampled tokens (every call's output ids, in order) with their log-probs."""
    for parent, child in zip(session.calls, session.calls[1:]):
        assert child.parent == parent.call_id
        assert child.input_ids[: len(parent.full_ids)] == parent.full_ids
    [traj] = session.export("concat")
    packed = pack_trajectories([traj], torch.tensor([session.reward]))
    trained = packed.labels != IGNORE_INDEX
    sampled = [t for c in session.calls for t in c.output_ids]
    assert packed.labels[trained].tolist() == sampled
    behav = [lp for c in session.calls for lp in c.logprobs]
    assert packed.behav_logprobs[trained].tolist() == pytest.approx(behav)


@pytest.mark.parametrize(
    "path,kwargs",
    [
        (SDK_AGENT, {}),  # OpenAIResponsesModel: /v1/responses
        (SDK_AGENT, {"api": "chat_completions"}),
        (GRAPH_AGENT, {}),
        (GRAPH_AGENT, {"streaming": True}),  # server-sent events
    ],
)
def test_framework_agents_continue_token_exactly_across_tool_calls(fmt, path, kwargs):
    agent = import_attribute(path, "agent.path")(**kwargs)
    gen = Scripted(fmt, TOOL_REPLY, "The answer is 5.")

    async def run():
        async with serving(fmt, gen) as (server, session, token):
            client = openai.AsyncOpenAI(base_url=server.url, api_key=token, max_retries=0)
            async with client:
                data = {"question": "What is 2+3?", "answer": "5"}
                reward = await agent.run_agent_return_reward(data, client)
            session.finish(reward)
            return session

    session = asyncio.run(run())
    assert session.reward == 1.0  # the tool ran, its result went back, the answer is right
    [first, second] = session.calls
    assert [c["function"]["name"] for c in first.tool_calls] == ["calculator"]
    assert json.loads(first.tool_calls[0]["function"]["arguments"]) == {"expression": "2+3"}
    assert second.content == "The answer is 5." and not second.tool_calls
    # the tool's result ("5") is the environment's text between the two calls
    env = second.input_ids[len(first.full_ids) :]
    assert "5" in fmt.tokenizer.decode(env) and "calculator" not in fmt.tokenizer.decode(env)
    assert [g["result"].output_ids for g in gen.calls] == [first.output_ids, second.output_ids]
    assert_token_exact(session)


def _job(tiny_model_dir, root, config: str, agent: str, *extra) -> Path:
    args = [
        "train",
        "--config",
        str(ROOT / "examples" / config),
        "--no-progress",
        f"model.path={tiny_model_dir}",
        f"fileroot={root}",
        f"agent.path={agent}",
        "total_steps=2",
        "batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=4",
        "data.train_size=20",
        "eval.before=false",
        *extra,
    ]
    assert main(args) == 0
    [run] = list(root.glob("agent-*/trial0"))
    return run


@pytest.mark.parametrize(
    "config,agent",
    [("agent_openai_agents.yaml", SDK_AGENT), ("agent_langgraph.yaml", GRAPH_AGENT)],
)
def test_framework_agent_trains_two_steps_on_the_tiny_model(
    tiny_model_dir, tmp_path, config, agent
):
    run = _job(tiny_model_dir, tmp_path, config, agent)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(k in r for r in records for k in documented_step_keys())
    assert records[-1]["agent/sessions_dropped"] == 0 and records[-1]["agent/sessions"] >= 8
    sessions = [Session.from_dict(r) for r in read_trajectories(run / "trajectories")]
    assert sessions and all(s.status == "done" and s.calls for s in sessions)
    groups: dict[int, list[Session]] = {}
    for s in sessions:
        groups.setdefault(s.group_id, []).append(s)
        assert all(c.tools and c.tools[0]["function"]["name"] == "calculator" for c in s.calls)
        assert s.reward in (0.0, 1.0)
        assert_token_exact(s)
    # each session's own reward went to its group: the group's rewards are its sessions'
    for members in groups.values():
        assert len(members) == 2 and {s.group_id for s in members} == {members[0].group_id}
        [traj_a], [traj_b] = (m.export("concat") for m in members)
        assert [traj_a.reward, traj_b.reward] == [m.reward for m in members]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts_trained"] == 4
