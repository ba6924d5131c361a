"""Agent sessions: token-exact capture against the engine, continuation, export, bad agents."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest
import torch

from areal_fast.agent.bridge import EngineBridge
from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.client import AgentClient, ChatBackend, GenResult, SessionDefaults
from areal_fast.agent.protocol import BadRequest
from areal_fast.agent.runner import AgentConfig, AgentRunner, load_agent
from areal_fast.agent.session import ModelCall, Session
from areal_fast.rl.batch import IGNORE_INDEX, pack_trajectories
from areal_fast.rollout.engine import GenOutput, GenRequest, sample_seed


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def engine(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from areal_fast.rollout.hf_engine import HFEngine

    eng = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer, 8)
    eng.start()
    yield eng
    eng.close()


class Pump:
    """Routes the engine's outputs to the bridge from a thread (what a rollout worker does)."""

    def __init__(self, bridge):
        self.bridge, self.stop = bridge, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.bridge.pump(0.05)

    def close(self):
        self.stop.set()
        self.thread.join(5)


def _run_with_engine(engine, tokenizer, coro_fn):
    async def main():
        bridge = EngineBridge(engine, asyncio.get_running_loop())
        pump = Pump(bridge)
        try:
            return await coro_fn(ChatBackend(ChatFormat(tokenizer), bridge.generate))
        finally:
            pump.close()

    return asyncio.run(main())


def test_session_captures_exactly_the_engines_tokens(engine, tokenizer, fresh_seed):
    """Each recorded call equals a direct engine call with the same ids and seed; the
    second turn continues the first token-exactly."""
    session = Session()
    question = [{"role": "user", "content": f"Add {fresh_seed % 97} and 5."}]

    async def agent(backend):
        client = AgentClient(session, backend, SessionDefaults(max_tokens=12, seed=fresh_seed))
        first = await client.chat.completions.create(
            messages=question, temperature=1.0, seed=fresh_seed
        )
        reply = first.choices[0].message
        follow = question + [
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": "Wrong. Try again."},
        ]
        await client.chat.completions.create(
            messages=follow, temperature=0.8, n=2, seed=fresh_seed + 1, logprobs=True
        )
        return 1.0

    _run_with_engine(engine, tokenizer, agent)
    fmt = ChatFormat(tokenizer)
    first, second_a, second_b = session.calls
    assert first.input_ids == fmt.prompt_ids(question)
    assert second_a.parent == first.call_id == second_b.parent
    assert second_a.input_ids[: len(first.full_ids)] == first.full_ids
    assert second_a.input_ids == second_b.input_ids
    # request k's base seed mixes the session seed, k and the request's seed
    base0 = sample_seed(sample_seed(fresh_seed, 0), fresh_seed)
    base1 = sample_seed(sample_seed(fresh_seed, 1), fresh_seed + 1)
    expected_seeds = [
        (first, sample_seed(base0, 0), 1.0),
        (second_a, sample_seed(base1, 0), 0.8),
        (second_b, sample_seed(base1, 1), 0.8),
    ]
    engine.submit(
        [
            GenRequest(100 + i, c.input_ids, 12, t, 1.0, seed, 0)
            for i, (c, seed, t) in enumerate(expected_seeds)
        ]
    )
    outs = {}
    while len(outs) < 3:
        outs.update({o.rid: o for o in engine.get_outputs(5.0)})
    for i, (call, _, _) in enumerate(expected_seeds):
        assert outs[100 + i].output_ids == call.output_ids, f"seed {fresh_seed} call {i}"
        # a continuous batch's numerics follow its other rows at float32 rounding
        assert outs[100 + i].logprobs == pytest.approx(call.logprobs, abs=1e-5)
        assert outs[100 + i].versions == call.versions
        assert call.stop_reason == outs[100 + i].stop_reason


class AbortingEngine:
    """Aborts each new request after 2 tokens (as a weight update does); finishes resumed ones.

    Token j of a completion is 10 + j and its log-prob -j / 10, from the request's offset, so
    the stitched output shows whether the bridge resumed at the right place."""

    def __init__(self):
        self.requests, self.outputs = [], []

    def submit(self, requests, front=False):
        for r in requests:
            self.requests.append((r, front))
            n = r.max_new_tokens if r.offset else 2
            ids = [10 + r.offset + j for j in range(n)]
            self.outputs.append(
                GenOutput(
                    r.rid,
                    ids,
                    [-(r.offset + j) / 10 for j in range(n)],
                    [1 if r.offset else 0] * n,
                    "length" if r.offset else "abort",
                )
            )

    def get_outputs(self, timeout):
        out, self.outputs = self.outputs, []
        return out


def test_a_call_aborted_by_a_weight_update_resumes_seamlessly():
    engine = AbortingEngine()

    async def main():
        bridge = EngineBridge(engine, asyncio.get_running_loop())
        task = asyncio.create_task(bridge.generate([1, 2, 3], 5, 0.7, 0.9, 99))
        await asyncio.sleep(0)
        for _ in range(3):
            bridge.pump(0)
            await asyncio.sleep(0)
        return await task, bridge

    result, bridge = asyncio.run(main())
    assert result.output_ids == [10, 11, 12, 13, 14]
    assert result.logprobs == [0.0, -0.1, -0.2, -0.3, -0.4]
    assert result.versions == [0, 0, 1, 1, 1] and result.stop_reason == "length"
    (first, _), (again, front) = engine.requests
    assert again.input_ids == [1, 2, 3, 10, 11] and again.offset == 2 and front
    assert (again.max_new_tokens, again.seed, again.temperature, again.top_p) == (3, 99, 0.7, 0.9)
    assert bridge.pending == {}


def _scripted(replies):
    """A generate() that returns scripted texts in order, with random log-probs."""
    rng = random.Random()
    queue = list(replies)

    def factory(tokenizer):
        async def generate(input_ids, max_new_tokens, temperature, top_p, seed):
            text = queue.pop(0)
            ids = tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
            stop = "length" if len(ids) == max_new_tokens else "stop"
            if stop == "stop":
                ids = ids + [tokenizer.eos_token_id]
            return GenResult(ids, [-rng.random() for _ in ids], [7] * len(ids), stop)

        return generate

    return factory


def _three_turn_session(tokenizer, turn_discount=1.0):
    session = Session(group_id=4)
    backend = ChatBackend(ChatFormat(tokenizer), _scripted(["12", "13", "8"])(tokenizer))
    client = AgentClient(session, backend, SessionDefaults(max_tokens=20))

    async def agent():
        msgs = [{"role": "user", "content": "3+5?"}]
        for _turn in range(3):
            out = await client.chat.completions.create(messages=msgs)
            msgs = msgs + [
                {"role": "assistant", "content": out.choices[0].message.content},
                {"role": "user", "content": "Incorrect, reflect and retry."},
            ]
        session.finish(0.5)

    asyncio.run(agent())
    return session


def test_concat_export_masks_exactly_the_model_tokens(tokenizer):
    session = _three_turn_session(tokenizer)
    [traj] = session.export("concat")
    calls = session.calls
    assert [c.parent for c in calls] == [None, calls[0].call_id, calls[1].call_id]
    assert traj.prompt_ids == calls[0].input_ids
    full = traj.prompt_ids + traj.completion_ids
    assert full == calls[2].full_ids
    generated = set()
    for c in calls:
        start = len(c.input_ids)
        generated |= set(range(start, start + len(c.output_ids)))
    mask = [False] * len(traj.prompt_ids) + traj.loss_mask
    assert {i for i, m in enumerate(mask) if m} == generated
    lps = [0.0] * len(traj.prompt_ids) + traj.logprobs
    assert [lps[i] for i in sorted(generated)] == [x for c in calls for x in c.logprobs]
    packed = pack_trajectories([traj], torch.tensor([1.0]))
    # position t predicts token t + 1: trained labels are exactly the generated tokens
    trained = (packed.labels != IGNORE_INDEX).nonzero().flatten().tolist()
    assert [t + 1 for t in trained] == sorted(generated)
    assert torch.equal(packed.loss_mask, packed.labels != IGNORE_INDEX)
    assert (packed.versions[packed.loss_mask] == 7).all()
    assert (packed.versions[~packed.loss_mask] == -1).all()
    assert traj.reward == 0.5 and traj.group_id == 4


def test_per_turn_export_and_turn_discount(tokenizer):
    session = _three_turn_session(tokenizer)
    session.set_reward(session.calls[0].call_id, 0.25)
    trajs = session.export("per_turn", turn_discount=0.5)
    assert [t.prompt_ids for t in trajs] == [c.input_ids for c in session.calls]
    assert [t.completion_ids for t in trajs] == [c.output_ids for c in session.calls]
    # r2 = 0.5; r1 = 0 + 0.5 * 0.5; r0 = 0.25 + 0.5 * 0.25
    assert [t.reward for t in trajs] == pytest.approx([0.375, 0.25, 0.5])
    assert all(t.loss_mask == [True] * len(t.completion_ids) for t in trajs)


def test_edited_reply_starts_a_fresh_prompt(tokenizer):
    session = Session()
    backend = ChatBackend(ChatFormat(tokenizer), _scripted(["ab", "cd"])(tokenizer))
    client = AgentClient(session, backend, SessionDefaults(max_tokens=20))

    async def agent():
        msgs = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(messages=msgs)
        msgs += [
            {"role": "assistant", "content": "something else"},
            {"role": "user", "content": "again"},
        ]
        await client.chat.completions.create(messages=msgs)

    asyncio.run(agent())
    assert session.calls[1].parent is None
    assert session.calls[1].input_ids == ChatFormat(tokenizer).prompt_ids(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "something else"},
            {"role": "user", "content": "again"},
        ]
    )
    session.finish(1.0)
    # the model's first reply was replaced by the agent: it is not part of the episode
    [traj] = session.export("concat")
    assert traj.info["call_ids"] == [session.calls[1].call_id]


def test_unchosen_choices_are_left_out_and_rewards_follow_the_path(tokenizer):
    """n = 3 at turn 0, the agent goes on with choice 1: choices 0 and 2 are not trained
    (unless given their own reward), and the final reward flows back to choice 1 only."""
    session = Session()
    backend = ChatBackend(ChatFormat(tokenizer), _scripted(["a", "b", "c", "d"])(tokenizer))
    client = AgentClient(session, backend, SessionDefaults(max_tokens=20))

    async def agent():
        msgs = [{"role": "user", "content": "pick"}]
        out = await client.chat.completions.create(messages=msgs, n=3)
        msgs += [
            {"role": "assistant", "content": out.choices[1].message.content},
            {"role": "user", "content": "go on"},
        ]
        await client.chat.completions.create(messages=msgs)
        return out.id

    first_id = asyncio.run(agent())
    session.finish(-1.0)
    c0, c1, c2, last = session.calls
    assert last.parent == c1.call_id
    assert [c.call_id for c in session.path()] == [c1.call_id, last.call_id]
    per_turn = session.export("per_turn", turn_discount=0.5)
    assert [(t.info["call_ids"], t.reward) for t in per_turn] == [
        ([c1.call_id], -0.5),
        ([last.call_id], -1.0),
    ]
    [concat] = session.export("concat", turn_discount=0.5)
    assert concat.info["call_ids"] == [c1.call_id, last.call_id] and concat.reward == -0.5
    AgentClient(session, backend, SessionDefaults()).set_reward(first_id, 0.25, index=2)
    rewards = session.call_rewards(0.5)
    assert rewards == {c1.call_id: -0.5, c2.call_id: 0.25 - 0.5, last.call_id: -1.0}


_THINK_TEMPLATE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_templates_that_rewrite_earlier_turns_still_continue_token_exactly(tokenizer):
    """Like Qwen3's template, this one drops reasoning from earlier assistant turns: the next
    prompt still holds the model's own tokens (reasoning included), not a re-render."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = _THINK_TEMPLATE
    session = Session()
    backend = ChatBackend(ChatFormat(tok), _scripted(["<think>2+2</think>4", "5"])(tok))
    client = AgentClient(session, backend, SessionDefaults(max_tokens=40))

    async def agent():
        msgs = [{"role": "user", "content": "2+2?"}]
        out = await client.chat.completions.create(messages=msgs)
        msgs += [
            {"role": "assistant", "content": out.choices[0].message.content},
            {"role": "user", "content": "sure?"},
        ]
        await client.chat.completions.create(messages=msgs)

    asyncio.run(agent())
    first, second = session.calls
    assert second.parent == first.call_id
    assert second.input_ids[: len(first.full_ids)] == first.full_ids
    env = tok.decode(second.input_ids[len(first.full_ids) :])
    assert env == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"


def test_a_dropped_session_records_no_late_call(tokenizer):
    session = Session()
    backend = ChatBackend(ChatFormat(tokenizer), _scripted(["x"])(tokenizer))
    client = AgentClient(session, backend, SessionDefaults())
    session.drop("timeout", "too slow")
    with pytest.raises(BadRequest, match="has ended"):
        asyncio.run(client.chat.completions.create(messages=[{"role": "user", "content": "q"}]))
    assert session.calls == []


def test_tool_calls_round_trip(tokenizer):
    session = Session()
    call_text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    )
    backend = ChatBackend(ChatFormat(tokenizer), _scripted([call_text, "12"])(tokenizer))
    client = AgentClient(session, backend, SessionDefaults(max_tokens=200))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]

    async def agent():
        msgs = [{"role": "user", "content": "3*4?"}]
        out = await client.chat.completions.create(messages=msgs, tools=tools)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        [tc] = choice.message.tool_calls
        assert tc.function.name == "calculator" and tc.function.arguments == '{"expression": "3*4"}'
        msgs += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "12"},
        ]
        out = await client.chat.completions.create(messages=msgs, tools=tools)
        assert out.choices[0].message.content == "12"

    asyncio.run(agent())
    assert session.calls[1].parent == session.calls[0].call_id
    assert session.calls[0].tool_calls[0]["function"]["name"] == "calculator"


def test_bad_requests_name_the_key(tokenizer):
    session = Session()
    backend = ChatBackend(ChatFormat(tokenizer), _scripted(["x"] * 5)(tokenizer))
    client = AgentClient(session, backend, SessionDefaults(max_tokens_cap=50))
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 51}, "max_tokens_cap"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ]
    for kwargs, key in cases:
        with pytest.raises(BadRequest, match=key.replace("[", r"\[").replace("]", r"\]")):
            asyncio.run(client.chat.completions.create(**kwargs))
    assert session.calls == []


# ---------------------------------------------------------------- the runner


async def good_agent(data, client):
    out = await client.chat.completions.create(
        messages=[{"role": "user", "content": data["question"]}]
    )
    return 1.0 if out.choices[0].message.content else 0.0


async def raising_agent(data, client):
    await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
    raise RuntimeError("tool crashed")


async def slow_agent(data, client):
    await asyncio.sleep(60)
    return 1.0


async def text_agent(data, client):
    await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
    return "one"


async def nan_agent(data, client):
    await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
    return math.nan


async def silent_agent(data, client):
    return 1.0


async def blocking_agent(data, client):
    await client.chat.completions.create(messages=[{"role": "user", "content": "q"}])
    time.sleep(0.6)  # blocks the event loop: wait_for cannot fire
    return 1.0


def test_an_agent_that_blocks_the_event_loop_past_its_timeout_is_dropped(tokenizer, caplog):
    [group] = _run_groups(tokenizer, blocking_agent, n=1, config=AgentConfig(timeout=0.3))
    [session] = group.sessions
    assert (session.status, session.drop_reason) == ("dropped", "timeout")
    assert "blocking the event loop" in session.error and "asyncio.to_thread" in session.error


class ClassAgent:
    def __init__(self, bonus=0.0):
        self.bonus = bonus

    async def run_agent_return_reward(self, data):
        from areal_fast.agent.runner import current_client

        out = await current_client().chat.completions.create(
            messages=[{"role": "user", "content": data["question"]}]
        )
        return self.bonus + len(out.choices)


def _run_groups(tokenizer, agent, n, config=None, groups=1):
    done = []
    event = threading.Event()
    config = config or AgentConfig(timeout=2.0)

    def factory(loop):
        return ChatBackend(ChatFormat(tokenizer), _scripted(["42"] * 100)(tokenizer)), None

    def on_done(result):
        done.append(result)
        if len(done) == groups:
            event.set()

    runner = AgentRunner(agent, factory, config, on_done)
    runner.start()
    try:
        for g in range(groups):
            runner.submit_group(
                g, {"question": "6*7?", "answer": "42"}, n, 11, SessionDefaults(max_tokens=8)
            )
        assert event.wait(30)
    finally:
        runner.close()
    return done


@pytest.mark.parametrize(
    "bad,reason",
    [
        (raising_agent, "agent_error"),
        (slow_agent, "timeout"),
        (text_agent, "bad_reward"),
        (nan_agent, "bad_reward"),
        (silent_agent, "no_calls"),
    ],
)
def test_bad_agents_are_dropped_with_a_reason(tokenizer, bad, reason, caplog):
    calls = iter(range(100))

    async def mixed(data, client):
        agent = bad if next(calls) % 2 == 0 else good_agent
        return await agent(data, client)

    [group] = _run_groups(tokenizer, mixed, n=4)
    statuses = sorted((s.status, s.drop_reason) for s in group.sessions)
    assert statuses == [("done", "")] * 2 + [("dropped", reason)] * 2
    assert all(s.reward == 1.0 for s in group.sessions if s.status == "done")
    assert sum(reason in r.message for r in caplog.records) == 2


def test_class_agent_from_path(tmp_path, tokenizer):
    file = tmp_path / "my_agent.py"
    file.write_text("from test_session import ClassAgent\n")
    agent = load_agent(f"{file}:ClassAgent", {"bonus": 2.0})
    groups = _run_groups(tokenizer, agent, n=3, groups=2)
    assert sorted(g.group_id for g in groups) == [0, 1]
    for g in groups:
        assert [s.reward for s in g.sessions] == [3.0] * 3
        assert all(s.group_id == g.group_id and len(s.calls) == 1 for s in g.sessions)


def test_kwargs_for_a_function_agent_are_refused():
    with pytest.raises(ValueError, match=r"agent.kwargs = \{'x': 1\} is set but"):
        load_agent("test_session:good_agent", {"x": 1})


@pytest.mark.parametrize(
    "path,match",
    [
        ("nomodule_xyz:agent", "cannot import"),
        ("test_session:missing", "has no 'missing'"),
        ("test_session:Pump", "cannot construct Pump"),
        ("test_session:_scripted", "not an async function"),
        ("test_session", "module:name"),
    ],
)
def test_load_agent_errors_name_the_path(path, match):
    with pytest.raises(ValueError, match=match):
        load_agent(path) if ":" in path else AgentConfig(path=path)


def test_session_records_round_trip_through_dicts(tokenizer):
    session = _three_turn_session(tokenizer)
    again = Session.from_dict(session.to_dict())
    assert again == session
    assert again.export("concat")[0].completion_ids == session.export("concat")[0].completion_ids


def test_model_call_checks_lengths():
    with pytest.raises(ValueError, match="logprobs"):
        ModelCall("c", [1], [2, 3], [0.0], [1, 1], "stop")
