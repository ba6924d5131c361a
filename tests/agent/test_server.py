"""Tests of the OpenAI-compatible agent endpoint (areal_fast.agent.server).

The official ``openai`` client talks to a real :class:`AgentServer` on a loopback port; a
scripted ``generate`` makes replies (and tool calls) deterministic, and one test drives a real
:class:`HFEngine` over a tiny random model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import threading
from urllib.parse import urlparse

import aiohttp
import openai
import pytest

from areal_fast.agent.chat_format import ChatFormat
from areal_fast.agent.client import ChatBackend, GenResult, SessionDefaults
from areal_fast.agent.server import AgentServer
from areal_fast.agent.session import Session

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOL_REPLY = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    from areal_fast.models.loading import DEMO_MODEL, load_tokenizer

    return ChatFormat(load_tokenizer(DEMO_MODEL))


class Scripted:
    """Fake engine: replies with scripted texts (in order, the last one repeating) plus the
    end-of-sequence token, random log-probs in (-1, 0] drawn from the seed, version 3."""

    def __init__(self, fmt: ChatFormat, *replies: str, version: int = 3):
        self.fmt, self.replies, self.version = fmt, list(replies) or ["Hello there!"], version
        self.calls: list[dict] = []  # generate's arguments and result, in call order

    async def __call__(self, input_ids, max_new_tokens, temperature, top_p, seed):
        text = self.replies[min(len(self.calls), len(self.replies) - 1)]
        ids = self.fmt.encode_text(text) + [self.fmt.tokenizer.eos_token_id]
        rng = random.Random(seed)
        result = GenResult(ids, [-rng.random() for _ in ids], [self.version] * len(ids), "stop")
        self.calls.append(
            dict(
                input_ids=list(input_ids),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                result=result,
            )
        )
        await asyncio.sleep(0)
        return result


@contextlib.asynccontextmanager
async def serving(fmt, generate, defaults=None, **kwargs):
    """A started server with one open session: yields (server, session, token)."""
    server = AgentServer(ChatBackend(fmt, generate), **kwargs)
    await server.start()
    session = Session()
    token = server.open_session(session, defaults or SessionDefaults(seed=11, model="tiny"))
    try:
        yield server, session, token
    finally:
        await server.close()


def client(server: AgentServer, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key=token, max_retries=0, timeout=30)


async def post(server, token, body, raw: bytes | None = None, headers=None):
    """POST to /chat/completions with aiohttp: (status, decoded JSON body)."""
    hdrs = {"Content-Type": "application/json"}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    hdrs.update(headers or {})
    data = raw if raw is not None else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/chat/completions", data=data, headers=hdrs) as r:
            return r.status, await r.json(content_type=None)


def assert_error(payload: dict, kind: str) -> dict:
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind
    assert isinstance(err["message"], str) and "\n" not in err["message"]
    return err


def sdk_error_body(exc: openai.APIStatusError) -> dict:
    """The JSON error of an openai exception (the SDK keeps the whole body or its "error")."""
    body = exc.body
    return body if "error" in body else {"error": body}


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


# ------------------------------------------------------------------ chat completions


def test_chat_call_is_recorded_token_exact(fmt):
    gen = Scripted(fmt, "Hello there, friend.")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                resp = await oa.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=40, temperature=0.7
                )
            return resp, session

    resp, session = asyncio.run(main())
    assert resp.choices[0].message.content == "Hello there, friend."
    assert resp.choices[0].finish_reason == "stop" and resp.model == "tiny"
    (call,) = session.calls
    res = gen.calls[0]["result"]
    assert call.input_ids == fmt.prompt_ids(MESSAGES) == gen.calls[0]["input_ids"]
    assert call.output_ids == res.output_ids and call.logprobs == res.logprobs
    assert call.versions == [3] * len(res.output_ids) and call.parent is None
    assert gen.calls[0]["max_new_tokens"] == 40 and gen.calls[0]["temperature"] == 0.7
    assert resp.usage.prompt_tokens == len(call.input_ids)
    assert resp.usage.completion_tokens == len(call.output_ids)
    assert resp.usage.total_tokens == len(call.input_ids) + len(call.output_ids)
    assert call.call_id == f"{resp.id}:0"


def test_n_choices_with_logprobs(fmt):
    gen = Scripted(fmt, "One.", "Two, then.", "Three it is.")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                resp = await oa.chat.completions.create(
                    model="tiny", messages=MESSAGES, n=3, logprobs=True
                )
            return resp, session

    resp, session = asyncio.run(main())
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == ["One.", "Two, then.", "Three it is."]
    assert [c.call_id for c in session.calls] == [f"{resp.id}:{i}" for i in range(3)]
    assert len({g["seed"] for g in gen.calls}) == 3
    for choice, call, g in zip(resp.choices, session.calls, gen.calls):
        assert call.output_ids == g["result"].output_ids
        got = [t.logprob for t in choice.logprobs.content]
        assert got == call.logprobs == g["result"].logprobs  # float-exact through JSON
        assert [t.token for t in choice.logprobs.content] == fmt.token_texts(call.output_ids)
    assert resp.usage.completion_tokens == sum(len(c.output_ids) for c in session.calls)


def test_tool_call_round_trip_continues_token_exactly(fmt):
    gen = Scripted(fmt, TOOL_REPLY, "The answer is 5.")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                msgs = [{"role": "user", "content": "What is 2+3?"}]
                first = await oa.chat.completions.create(
                    model="tiny", messages=msgs, tools=[CALCULATOR]
                )
                choice = first.choices[0]
                assert choice.finish_reason == "tool_calls"
                (tc,) = choice.message.tool_calls
                assert tc.function.name == "calculator"
                assert json.loads(tc.function.arguments) == {"expression": "2+3"}
                msgs += [
                    choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": tc.id, "content": "5"},
                ]
                second = await oa.chat.completions.create(
                    model="tiny", messages=msgs, tools=[CALCULATOR]
                )
            return second, session

    second, session = asyncio.run(main())
    assert second.choices[0].message.content == "The answer is 5."
    first_call, second_call = session.calls
    assert second_call.parent == first_call.call_id
    assert second_call.input_ids[: len(first_call.full_ids)] == first_call.full_ids
    assert len(second_call.input_ids) > len(first_call.full_ids)
    assert gen.calls[1]["input_ids"] == second_call.input_ids
    session.finish(1.0)
    assert [len(t.completion_ids) for t in session.export("concat")] == [
        len(second_call.full_ids) - len(first_call.input_ids)
    ]


def test_models_lists_the_session_model(fmt):
    async def main():
        async with serving(fmt, Scripted(fmt)) as (server, session, token):
            async with client(server, token) as oa:
                return [m.model_dump(exclude_none=True) for m in (await oa.models.list()).data]

    assert asyncio.run(main()) == [
        {"id": "tiny", "object": "model", "created": 0, "owned_by": "areal-fast"}
    ]


def test_requests_are_served_concurrently(fmt):
    async def main():
        arrived, gate = [], asyncio.Event()
        scripted = Scripted(fmt, "done")

        async def generate(*args):
            arrived.append(args)
            if len(arrived) == 2:
                gate.set()
            await asyncio.wait_for(gate.wait(), 10)  # blocks unless both are in flight
            return await scripted(*args)

        async with serving(fmt, generate) as (server, session, token):
            other = Session()
            token2 = server.open_session(other, SessionDefaults(seed=5))
            async with client(server, token) as a, client(server, token2) as b:
                r1, r2 = await asyncio.gather(
                    a.chat.completions.create(model="tiny", messages=MESSAGES),
                    b.chat.completions.create(model="tiny", messages=MESSAGES),
                )
            return r1, r2, session, other

    r1, r2, s1, s2 = asyncio.run(main())
    assert r1.choices[0].message.content == r2.choices[0].message.content == "done"
    assert len(s1.calls) == len(s2.calls) == 1  # each token routes to its own session


def test_concurrent_calls_of_one_session_get_distinct_ids_and_seeds(fmt):
    gen = Scripted(fmt, "a", "b", "c")

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            async with client(server, token) as oa:
                resps = await asyncio.gather(
                    *[oa.chat.completions.create(model="tiny", messages=MESSAGES) for _ in range(3)]
                )
            return resps, session

    resps, session = asyncio.run(main())
    assert len({r.id for r in resps}) == 3
    assert len({c.call_id for c in session.calls}) == 3
    assert len({g["seed"] for g in gen.calls}) == 3


# ------------------------------------------------------------------------------ auth


def test_authentication(fmt):
    async def main():
        async with serving(fmt, Scripted(fmt)) as (server, session, token):
            async with client(server, token) as oa:
                with pytest.raises(openai.AuthenticationError) as missing:
                    await oa.chat.completions.create(
                        model="tiny",
                        messages=MESSAGES,
                        extra_headers={"Authorization": openai.Omit()},
                    )
            async with client(server, "not-a-token") as oa:
                with pytest.raises(openai.AuthenticationError) as wrong:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES)
                with pytest.raises(openai.AuthenticationError):
                    await oa.models.list()
            status, body = await post(
                server, None, {"messages": MESSAGES}, headers={"Authorization": f"Basic {token}"}
            )
            assert status == 401
            assert_error(body, "authentication_error")
            async with client(server, token) as oa:
                await oa.chat.completions.create(model="tiny", messages=MESSAGES)
                server.close_session(token)
                server.close_session(token)  # closing twice is harmless
                with pytest.raises(openai.AuthenticationError) as closed:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES)
            for exc in (missing, wrong, closed):
                assert exc.value.status_code == 401
                err = assert_error(sdk_error_body(exc.value), "authentication_error")
                assert token not in err["message"]
            return session

    assert len(asyncio.run(main()).calls) == 1


def test_tokens_are_fresh_and_random(fmt):
    async def main():
        async with serving(fmt, Scripted(fmt)) as (server, session, token):
            return {token} | {server.open_session(Session(), SessionDefaults()) for _ in range(50)}

    tokens = asyncio.run(main())
    assert len(tokens) == 51 and all(len(t) >= 40 for t in tokens)


# ---------------------------------------------------------------------------- errors


def test_bad_requests_get_400_naming_the_key(fmt):
    gen = Scripted(fmt)

    async def main():
        out = {}
        async with serving(fmt, gen) as (server, session, token):
            out["json"] = await post(server, token, None, raw=b"{not json")
            out["nan"] = await post(
                server, token, None, raw=b'{"messages": [], "temperature": NaN}'
            )
            out["array"] = await post(server, token, [1, 2])
            out["empty"] = await post(server, token, {"messages": []})
            out["temp"] = await post(server, token, {"messages": MESSAGES, "temperature": 5})
            out["parallel"] = await post(
                server, token, {"messages": MESSAGES, "parallel_tool_calls": False}
            )
            out["role"] = await post(server, token, {"messages": [{"role": "robot"}]})
            out["cap"] = await post(server, token, {"messages": MESSAGES, "max_tokens": 10**6})
            out["unknown"] = await post(server, token, {"messages": MESSAGES, "foo": 1})
            async with client(server, token) as oa:
                with pytest.raises(openai.BadRequestError) as exc:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES, temperature=5)
                out["sdk"] = exc.value
            return out, session

    out, session = asyncio.run(main())
    for key in ("json", "nan", "array", "empty", "temp", "parallel", "role", "cap", "unknown"):
        assert out[key][0] == 400, (key, out[key])
        assert_error(out[key][1], "invalid_request_error")
    err = lambda key: out[key][1]["error"]  # noqa: E731
    assert "JSON" in err("json")["message"] and err("json")["param"] is None
    assert "object" in err("array")["message"]
    assert "messages" in err("empty")["message"] and err("empty")["param"] == "messages"
    assert "temperature" in err("temp")["message"] and err("temp")["param"] == "temperature"
    assert err("parallel")["message"].startswith("parallel_tool_calls = False is not supported")
    assert err("parallel")["param"] == "parallel_tool_calls"
    assert err("role")["param"] == "messages[0].role"
    assert err("cap")["param"] == "max_tokens"
    assert err("unknown")["param"] == "foo"
    assert out["sdk"].status_code == 400 and "temperature" in out["sdk"].message
    assert session.calls == [] and gen.calls == []


def test_unknown_route_and_wrong_method(fmt):
    async def main():
        async with serving(fmt, Scripted(fmt)) as (server, session, token):
            auth = {"Authorization": f"Bearer {token}"}
            base = server.url
            async with aiohttp.ClientSession(headers=auth) as http:
                async with http.post(base + "/completions", json={"prompt": "x"}) as r:
                    nf = r.status, await r.json()
                async with http.get(base.removesuffix("/v1") + "/") as r:
                    root = r.status, await r.json()
                async with http.get(base + "/chat/completions") as r:
                    method = r.status, await r.json()
            return nf, root, method

    nf, root, method = asyncio.run(main())
    assert nf[0] == root[0] == 404 and method[0] == 405
    for _, body in (nf, root, method):
        assert_error(body, "invalid_request_error")


def test_oversized_body_gets_413(fmt):
    gen = Scripted(fmt)

    async def main():
        async with serving(fmt, gen, max_body_bytes=2048) as (server, session, token):
            big = {"messages": [{"role": "user", "content": "x" * 4096}]}
            sized = await post(server, token, big)

            async def chunks():  # no Content-Length: chunked transfer encoding
                data = json.dumps(big).encode()
                for i in range(0, len(data), 512):
                    yield data[i : i + 512]

            hdrs = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    server.url + "/chat/completions", data=chunks(), headers=hdrs
                ) as r:
                    chunked = r.status, await r.json()
            small = await post(server, token, {"messages": [{"role": "user", "content": "hi"}]})
            return sized, chunked, small

    sized, chunked, small = asyncio.run(main())
    assert sized[0] == chunked[0] == 413
    assert_error(sized[1], "invalid_request_error")
    assert_error(chunked[1], "invalid_request_error")
    assert small[0] == 200 and len(gen.calls) == 1


def test_engine_failure_gets_500_and_server_keeps_serving(fmt, caplog):
    scripted = Scripted(fmt, "still here")
    fail = [True]

    async def generate(*args):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("CUDA exploded\nsecond line of detail")
        return await scripted(*args)

    async def main():
        async with serving(fmt, generate) as (server, session, token):
            async with client(server, token) as oa:
                with pytest.raises(openai.InternalServerError) as exc:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES)
                ok = await oa.chat.completions.create(model="tiny", messages=MESSAGES)
            return exc.value, ok, session

    with caplog.at_level("ERROR", logger="areal_fast.agent"):
        exc, ok, session = asyncio.run(main())
    assert exc.status_code == 500
    err = assert_error(sdk_error_body(exc), "server_error")
    assert err["message"] == "the engine failed: RuntimeError: CUDA exploded"
    assert ok.choices[0].message.content == "still here" and len(session.calls) == 1
    assert any(r.name == "areal_fast.agent" and r.exc_info for r in caplog.records)


def test_deeply_nested_json_gets_400(fmt):
    gen = Scripted(fmt)
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    async def main():
        async with serving(fmt, gen) as (server, session, token):
            return await post(server, token, None, raw=deep), session

    (status, body), session = asyncio.run(main())
    assert status == 400
    err = assert_error(body, "invalid_request_error")
    assert err["message"] == "the request body is not valid JSON: it is nested too deeply"
    assert session.calls == [] and gen.calls == []


def test_a_parser_failure_is_not_called_an_engine_failure(fmt, monkeypatch, caplog):
    import areal_fast.agent.server as server_module

    def broken(body):
        raise KeyError("content")

    monkeypatch.setattr(server_module, "parse_chat_request", broken)

    async def main():
        async with serving(fmt, Scripted(fmt)) as (server, session, token):
            return await post(server, token, {"messages": MESSAGES})

    with caplog.at_level("ERROR", logger="areal_fast.agent"):
        status, body = asyncio.run(main())
    assert status == 500
    err = assert_error(body, "server_error")
    assert err["message"] == "cannot read the request: KeyError: 'content'"
    assert err["code"] == "internal_error"
    assert any(r.name == "areal_fast.agent" and r.exc_info for r in caplog.records)


class Hanging:
    """A ``generate`` that never returns; records that it started and that it was cancelled."""

    def __init__(self):
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()

    async def __call__(self, *args):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_request_is_cancelled_when_its_client_goes_away(fmt):
    async def main():
        gen = Hanging()
        async with serving(fmt, gen) as (server, session, token):
            request = asyncio.create_task(post(server, token, {"messages": MESSAGES}))
            await asyncio.wait_for(gen.started.wait(), 10)
            request.cancel()  # the client closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await request
            await asyncio.wait_for(gen.cancelled.wait(), 10)
            return session, server._running

    session, running = asyncio.run(main())
    assert session.calls == [] and running == {}


def test_closing_a_session_cancels_its_running_requests(fmt):
    async def main():
        gen = Hanging()
        async with serving(fmt, gen) as (server, session, token):
            other = server.open_session(Session(), SessionDefaults())
            request = asyncio.create_task(post(server, token, {"messages": MESSAGES}))
            await asyncio.wait_for(gen.started.wait(), 10)
            server.close_session(other)  # another session's token: changes nothing
            assert not gen.cancelled.is_set()
            server.close_session(token)
            status, body = await asyncio.wait_for(request, 10)
            return status, body, gen.cancelled.is_set(), session, server._running

    status, body, cancelled, session, running = asyncio.run(main())
    assert status == 401 and cancelled
    err = assert_error(body, "authentication_error")
    assert err["code"] == "session_closed"
    assert err["message"] == "the session was closed while this request was running"
    assert session.calls == [] and running == {}


# ---------------------------------------------------------------- lifecycle, binding


def _non_loopback_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: sends nothing, picks a route
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_binds_loopback_and_close_is_idempotent(fmt):
    async def main():
        server = AgentServer(ChatBackend(fmt, Scripted(fmt)))
        with pytest.raises(RuntimeError):
            _ = server.url
        await server.start()
        with pytest.raises(RuntimeError):
            await server.start()
        url = urlparse(server.url)
        listening = [a[:2] for a in server._runner.addresses]
        other = _non_loopback_ip()
        reachable_elsewhere = None
        if other is not None:
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(other, url.port), 5)
                w.close()
                reachable_elsewhere = True
            except (OSError, asyncio.TimeoutError):
                reachable_elsewhere = False
        await server.close()
        await server.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", url.port)
        return url, listening, reachable_elsewhere

    url, listening, reachable_elsewhere = asyncio.run(main())
    assert url.scheme == "http" and url.hostname == "127.0.0.1" and url.path == "/v1"
    assert url.port > 0 and listening == [("127.0.0.1", url.port)]
    assert reachable_elsewhere in (None, False)


# ------------------------------------------------------------------- a real engine


class EngineGenerate:
    """``generate`` over an HFEngine's request-level API (submit, then poll outputs)."""

    def __init__(self, engine):
        self.engine, self.rids, self.waiting = engine, itertools.count(), {}
        self.stop = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()

    async def __call__(self, input_ids, max_new_tokens, temperature, top_p, seed):
        from areal_fast.rollout.engine import GenRequest

        loop, rid = asyncio.get_running_loop(), next(self.rids)
        self.waiting[rid] = (loop, loop.create_future())
        self.engine.submit(
            [GenRequest(rid, list(input_ids), max_new_tokens, temperature, top_p, seed)]
        )
        out = await self.waiting[rid][1]
        return GenResult(out.output_ids, out.logprobs, out.versions, out.stop_reason)

    def _poll(self):
        while not self.stop.is_set():
            for out in self.engine.get_outputs(0.05):
                loop, fut = self.waiting.pop(out.rid)
                loop.call_soon_threadsafe(fut.set_result, out)

    def close(self):
        self.stop.set()
        self.poller.join(5)


def test_real_engine_through_the_sdk(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_fast.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, 8)
    engine.start()
    generate = EngineGenerate(engine)
    fmt = ChatFormat(tok)
    msgs = [{"role": "user", "content": "What is 6 times 7?"}]

    session_seed = int.from_bytes(os.urandom(4), "little")

    async def main():
        defaults = SessionDefaults(max_tokens=12, seed=session_seed)
        async with serving(fmt, generate, defaults) as (server, session, token):
            async with client(server, token) as oa:
                a = await oa.chat.completions.create(
                    model="m", messages=msgs, n=2, logprobs=True, seed=99
                )
                b = await oa.chat.completions.create(
                    model="m", messages=msgs, logprobs=True, seed=99
                )
            return a, b, session

    try:
        a, b, session = asyncio.run(main())
        *_, again = asyncio.run(main())
    finally:
        generate.close()
        engine.close()
    assert len(a.choices) == 2 and len(session.calls) == 3
    for choice, call in zip(a.choices + b.choices, session.calls):
        assert call.input_ids == fmt.prompt_ids(msgs)
        assert 1 <= len(call.output_ids) <= 12 and call.versions == [0] * len(call.output_ids)
        assert [t.logprob for t in choice.logprobs.content] == call.logprobs
        assert all(lp <= 0 for lp in call.logprobs)
        assert choice.message.content == fmt.parse_output(call.output_ids, False)[0]
    # Sampling is seeded per choice: the same session seed and request seeds reproduce
    # every choice.
    assert [c.output_ids for c in again.calls] == [c.output_ids for c in session.calls], (
        session_seed
    )
    # a continuous batch's numerics follow its other rows at float32 rounding
    for c_again, c in zip(again.calls, session.calls):
        assert c_again.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    assert a.usage.completion_tokens == sum(len(c.output_ids) for c in session.calls[:2])
