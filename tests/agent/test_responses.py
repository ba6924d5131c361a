"""The endpoint's Responses API (areal_fast.agent.responses), streaming, tool options and its
event loop under huge requests (the official ``openai`` client and raw aiohttp against a real
:class:`AgentServer`)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from test_server import CALCULATOR, MESSAGES, TOOL_REPLY, Scripted, client, post, serving

from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.client import SessionDefaults
from areal_fast.agent.session import Session

FLAT_CALCULATOR = {"type": "function", **CALCULATOR["function"]}  # the Responses API's form


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    from areal_fast.models.loading import DEMO_MODEL, load_tokenizer

    return ChatFormat(load_tokenizer(DEMO_MODEL))


async def _post(http, url, token, raw: bytes):
    """(status, JSON body, seconds) of one POST."""
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with http.post(url, data=raw, headers=headers) as r:
        body = await r.json(content_type=None)
    return r.status, body, time.perf_counter() - start


@pytest.mark.parametrize("chars", [5 << 20, 400_000])
def test_a_huge_request_does_not_stall_the_other_sessions(fmt, chars):
    """5 MB of messages are refused by the size bound before any rendering; 400 kB pass it
    and are refused by max_prompt_tokens after tokenising on a worker thread. Meanwhile
    another session's small requests are answered within 100 ms (90th percentile)."""
    gen = Scripted(fmt, "Hi.")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            other = server.open_session(Session(), SessionDefaults(seed=1, model="tiny"))
            url = server.url + "/chat/completions"
            big = json.dumps({"messages": [{"role": "user", "content": "ab " * (chars // 3)}]})
            small = json.dumps({"messages": MESSAGES, "max_tokens": 8}).encode()
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, url, other, small))[0] == 200  # warm
                refused = asyncio.ensure_future(_post(http, url, token, big.encode()))
                latencies = []
                while not refused.done() or not latencies:
                    status, _, seconds = await _post(http, url, other, small)
                    assert status == 200
                    latencies.append(seconds)
                return await refused, latencies, session

    (status, body, big_seconds), latencies, session = asyncio.run(main())
    print(
        f"{chars} chars refused in {big_seconds * 1e3:.0f} ms; {len(latencies)} small "
        f"requests meanwhile, slowest {max(latencies) * 1e3:.1f} ms"
    )
    # the 90th percentile: one slow request when the machine is busy (CI runs two lanes side by
    # side) is not a stall; a loop blocked by the big request delays every request meanwhile
    p90 = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
    assert status == 400 and p90 < 0.1
    message = body["error"]["message"]
    if chars > 8192 * fmt.max_token_chars:  # the cheap bound, nothing rendered
        assert message == (
            f"messages hold {chars // 3 * 3} characters, more than agent.max_prompt_tokens = "
            f"8192 tokens of at most {fmt.max_token_chars} characters can"
        )
    else:
        assert message.startswith("the prompt has ") and "agent.max_prompt_tokens = 8192" in message
    assert session.calls == []


def test_responses_api_with_a_tool_call_continues_token_exactly(fmt):
    gen = Scripted(fmt, "Let me compute.\n" + TOOL_REPLY, "It is 5.")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                first = await oa.responses.create(
                    model="tiny",
                    instructions="Be brief.",
                    input="What is 2+3?",
                    tools=[FLAT_CALCULATOR],
                    max_output_tokens=40,
                )
                items = [i.model_dump(exclude_none=True) for i in first.output]
                call = first.output[1]
                items.append(
                    {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
                )
                second = await oa.responses.create(
                    model="tiny",
                    instructions="Be brief.",
                    tools=[FLAT_CALCULATOR],
                    input=[{"role": "user", "content": "What is 2+3?"}, *items],
                )
            return first, second, session

    first, second, session = asyncio.run(main())
    assert first.status == "completed" and [i.type for i in first.output] == [
        "message",
        "function_call",
    ]
    assert first.output_text == "Let me compute."
    assert first.output[1].name == "calculator"
    assert json.loads(first.output[1].arguments) == {"expression": "2+3"}
    assert first.usage.input_tokens == len(session.calls[0].input_ids)
    assert first.usage.output_tokens == len(session.calls[0].output_ids)
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == "It is 5." and second.id != first.id
    parent, child = session.calls
    assert session.calls[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert child.parent == parent.call_id
    assert child.input_ids[: len(parent.full_ids)] == parent.full_ids
    assert child.messages[-1] == {
        "role": "tool",
        "content": "5",
        "tool_call_id": parent.tool_calls[0]["id"],
    }


def test_responses_stream_and_incomplete(fmt):
    gen = Scripted(fmt, "Five.")

    async def cut_off(*args):  # the engine stopped at the token budget
        result = await gen(*args)
        result.stop_reason = "length"
        return result

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                stream = await oa.responses.create(model="tiny", input="2+3?", stream=True)
                events = [e async for e in stream]
        async with serving(fmt, cut_off) as (server, session, token):
            async with client(server, token) as oa:
                cut = await oa.responses.create(model="tiny", input="2+3?", max_output_tokens=3)
        return events, cut

    events, cut = asyncio.run(main())
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[4].delta == "Five." and events[-1].response.output_text == "Five."
    # a reply cut off by the budget is "incomplete", as the OpenAI API reports it
    assert gen.calls[1]["max_new_tokens"] == 3
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")


def test_chat_stream_matches_the_plain_response(fmt):
    gen = Scripted(fmt, "Sure.\n" + TOOL_REPLY)

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                kwargs = dict(model="tiny", messages=MESSAGES, tools=[CALCULATOR], n=2)
                plain = await oa.chat.completions.create(**kwargs, seed=5)
                stream = await oa.chat.completions.create(
                    **kwargs, seed=5, stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
            return plain, chunks

    plain, chunks = asyncio.run(main())
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    for c in plain.choices:
        mine = [x.choices[0] for x in chunks[:-1] if x.choices[0].index == c.index]
        assert mine[0].delta.content == c.message.content == "Sure."
        [call] = mine[0].delta.tool_calls
        assert (call.index, call.function.name) == (0, "calculator")
        assert call.function.arguments == c.message.tool_calls[0].function.arguments
        assert mine[-1].finish_reason == c.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "route,extra,param,start",
    [
        ("/responses", {"previous_response_id": "resp_1"}, "previous_response_id", None),
        ("/responses", {"reasoning": {"effort": "low"}}, "reasoning", None),
        ("/responses", {"tools": [{"type": "web_search"}]}, "tools[0]", None),
        ("/responses", {"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", None),
        ("/responses", {"tool_choice": "required"}, "tool_choice", None),
        ("/responses", {"text": {"format": {"type": "json_object"}}}, "text", None),
        ("/chat/completions", {"tool_choice": "required"}, "tool_choice", None),
        ("/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls", None),
        ("/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options", None),
    ],
)
def test_unsupported_options_get_400_naming_the_field(fmt, route, extra, param, start):
    gen = Scripted(fmt)
    body = {"input": "hi"} if route == "/responses" else {"messages": MESSAGES}
    body.update(extra)

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with aiohttp.ClientSession() as http:
                status, payload, _ = await _post(
                    http, server.url + route, token, json.dumps(body).encode()
                )
            return status, payload, session

    status, payload, session = asyncio.run(main())
    err = payload["error"]
    assert status == 400 and err["param"] == param and "\n" not in err["message"]
    assert err["message"].startswith(param.split("[")[0]) and session.calls == []
    assert gen.calls == []


def test_post_helper_still_reaches_chat(fmt):
    """The shared helper of test_server (chat completions) and streaming off by default."""

    async def main():
        async with serving(fmt, Scripted(fmt, "Ok.")) as (server, session, token):
            return await post(server, token, {"messages": MESSAGES, "stream": False})

    status, payload = asyncio.run(main())
    assert status == 200 and payload["choices"][0]["message"]["content"] == "Ok."
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_refusal_quotes_at_most_a_bounded_part_of_the_request():
    """A megabyte value in a refused key comes back cut, naming the key and its length."""
    from areal_fast.agent.protocol import MESSAGE_LIMIT, BadRequest
    from areal_fast.agent.responses import parse_responses_request

    huge = "r" * 1_000_000
    with pytest.raises(BadRequest) as refused:
        parse_responses_request({"input": "hi", "previous_response_id": huge})
    message = str(refused.value)
    assert message.startswith("previous_response_id = 'rrr") and len(message) <= MESSAGE_LIMIT
    assert message.endswith(" characters in all)")
    assert str(BadRequest("short")) == "short"


def test_a_bad_tool_output_names_its_field():
    from areal_fast.agent.protocol import BadRequest
    from areal_fast.agent.responses import parse_responses_request

    item = {"type": "function_call_output", "call_id": "c1", "output": 5}
    with pytest.raises(BadRequest, match=r"^input\[0\]\.output must be a string"):
        parse_responses_request({"input": [item]})
