"""SGLangServerEngine against a fake SGLang server on 127.0.0.1 that validates every request
body against a copy of SGLang's request schemas (tests/rollout/sglang_generate_schema.py on
top of tests/sync/receivers/sglang_schema.py) and answers with SGLang's documented replies;
plus one live test that runs only where SGLang is installed (and a GPU, and
AREAL_FAST_SGLANG_MODEL, a small HF model, are there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from areal_fast.rollout.engine import GenRequest
from areal_fast.rollout.loop_engine import EngineError
from areal_fast.rollout.sglang_server import SGLangServerEngine


def _load(name: str):
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_areal_fast_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_schema = _load("sglang_generate_schema")
WAIT_S = 10.0


def token_at(input_ids: list[int], seed: int, j: int) -> int:
    """The fake's deterministic j-th new token (never 0, the fake's EOS)."""
    return 1 + (sum(input_ids) * 31 + seed * 7 + j * 13) % 97


def logprob_at(token: int, temperature: float) -> float:
    return -0.01 * token / max(temperature, 0.1)


class FakeSGLang:
    """Emulates SGLang's routes: ``/generate`` decodes one token every ``step_s`` seconds and
    honours ``/pause_generation`` (abort: running requests end now with finish reason
    abort; in_place: they wait, then continue under the current weight version),
    ``/abort_request`` and the weight routes. Bodies that break the schema are answered
    with HTTP 400 and recorded in ``problems``."""

    def __init__(self, step_s: float = 0.0, report_spans: bool = True):
        self.step_s = step_s
        self.report_spans = report_spans
        self.lock = threading.Condition()
        self.requests: list[tuple[str, dict]] = []
        self.problems: list[str] = []
        self.label = "default"
        self.pause_mode: str | None = None
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.max_concurrent = 0
        self.tokens_done = 0
        self.broken: dict[str, str] = {}  # path -> "malformed" | "500"
        self.tensor_payloads: list[bytes] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        with self.lock:
            self.pause_mode = None
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def bodies(self, path: str) -> list[dict]:
        return [b for p, b in self.requests if p == path]

    # ---------------------------------------------------------------- HTTP plumbing

    def handle(self, h: BaseHTTPRequestHandler, method: str):
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        payload = json.loads(raw) if raw else None
        with self.lock:
            self.requests.append((h.path, payload))
        problems = gen_schema.validate(h.path, method, payload)
        if problems:
            with self.lock:
                self.problems.extend(problems)
            return self.reply(h, 400, {"message": "; ".join(problems)})
        broken = self.broken.get(h.path)
        if broken == "500":
            return self.reply(h, 500, {"message": "Internal Server Error: boom"})
        if broken == "malformed":
            return self.reply(h, 200, b'{"output_ids": [1, 2')
        route = getattr(self, "route_" + h.path.strip("/"), None)
        if route is None:
            return self.reply(h, 404, {"detail": "Not Found"})
        status, body = route(payload or {})
        self.reply(h, status, body)

    @staticmethod
    def reply(h, status: int, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    # ---------------------------------------------------------------- routes

    def route_generate(self, body: dict):
        rid, ids, params = body["rid"], body["input_ids"], body["sampling_params"]
        seed = params.get("sampling_seed") or 0
        temperature = params.get("temperature", 1.0)
        tokens, labels, kind = [], [], "length"
        with self.lock:
            self.running.add(rid)
            self.max_concurrent = max(self.max_concurrent, len(self.running))
        try:
            for j in range(params.get("max_new_tokens", 128)):
                with self.lock:
                    while self.pause_mode == "in_place" and rid not in self.aborted:
                        self.lock.wait(0.05)
                    if rid in self.aborted:
                        kind = "abort"
                        break
                    tokens.append(token_at(ids, seed, j))
                    labels.append(self.label)
                    self.tokens_done += 1
                if self.step_s:
                    time.sleep(self.step_s)
        finally:
            with self.lock:
                self.running.discard(rid)
                self.aborted.discard(rid)
        finish = (
            {"type": kind, "message": "Abort"}
            if kind == "abort"
            else {"type": "length", "length": len(tokens)}
        )
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [[logprob_at(t, temperature), t, None] for t in tokens],
            "weight_version": self.label,
        }
        if self.report_spans:
            spans = []
            for i, label in enumerate(labels):
                if spans and spans[-1]["version"] == label:
                    spans[-1]["end"] = i + 1
                else:
                    spans.append({"version": label, "start": i, "end": i + 1})
            meta["weight_versions"] = spans
        return 200, {"text": "", "output_ids": tokens, "meta_info": meta}

    def route_pause_generation(self, body: dict):
        mode = body.get("mode", "abort")
        with self.lock:
            if mode == "abort":
                self.aborted |= self.running
            self.pause_mode = mode
            self.lock.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def route_continue_generation(self, body: dict):
        with self.lock:
            self.pause_mode = None
            self.lock.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def route_abort_request(self, body: dict):
        with self.lock:
            self.aborted |= set(self.running) if body.get("abort_all") else {body.get("rid")}
        return 200, b""

    def route_update_weight_version(self, body: dict):
        with self.lock:
            self.label = body["new_version"]
        return 200, {"success": True, "message": "Weight version updated"}

    def route_update_weights_from_tensor(self, body: dict):
        with self.lock:
            if body.get("flush_cache", True) and self.running:
                # SGLang asserts the flush: impossible while requests are kept in place
                return 400, {"success": False, "message": "flush cache failed: requests running"}
            self.tensor_payloads.extend(
                __import__("base64").b64decode(p) for p in body["serialized_named_tensors"]
            )
            if body.get("weight_version") is not None:
                self.label = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def route_update_weights_from_distributed(self, body: dict):
        with self.lock:
            self.label = body.get("weight_version") or self.label
        return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _serialize(named_tensors):
    return pickle.dumps([(n, t.clone()) for n, t in named_tensors])


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def _engine(fake, **kw) -> SGLangServerEngine:
    kw.setdefault("max_running", 4)
    kw.setdefault("call_timeout", WAIT_S)
    engine = SGLangServerEngine(fake.url, serializer=_serialize, **kw)
    engine.start()
    return engine


def _collect(engine, n: int, timeout: float = WAIT_S):
    outputs, deadline = [], time.monotonic() + timeout
    while len(outputs) < n and time.monotonic() < deadline:
        outputs += engine.get_outputs(0.1)
    assert len(outputs) == n, f"got {len(outputs)} of {n} outputs in {timeout} s"
    return {o.rid: o for o in outputs}


def _wait(predicate, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_generate_sends_documented_requests_and_parses_replies(fake):
    engine = _engine(fake, max_running=2)
    try:
        requests = [
            GenRequest(i, [5, 6, 7 + i], 4 + i, temperature=0.7, top_p=0.9, seed=100 + i, offset=i)
            for i in range(5)
        ]
        engine.submit(requests)
        outputs = _collect(engine, 5)
    finally:
        engine.close()
    assert fake.problems == []
    assert fake.paths()[0] == "/update_weight_version"
    assert fake.bodies("/update_weight_version") == [
        {"new_version": "0", "abort_all_requests": False}
    ]
    bodies = {b["input_ids"][-1] - 7: b for b in fake.bodies("/generate")}
    for r in requests:
        body = bodies[r.rid]
        seed = r.seed ^ r.offset
        assert body["sampling_params"] == {
            "temperature": 0.7,
            "top_p": 0.9,
            "max_new_tokens": r.max_new_tokens,
            "sampling_seed": seed,
        }
        assert body["return_logprob"] is True and body["cache_salt"] == "v0"
        assert body["rid"].startswith(f"areal-{r.rid}-")
        out = outputs[r.rid]
        want = [token_at(r.input_ids, seed, j) for j in range(r.max_new_tokens)]
        assert out.output_ids == want
        assert out.logprobs == pytest.approx([logprob_at(t, 0.7) for t in want])
        assert out.versions == [0] * len(want)
        assert out.stop_reason == "length"
    assert len({b["rid"] for b in fake.bodies("/generate")}) == 5
    assert fake.max_concurrent <= 2


def test_abort_pause_returns_partials_and_update_carries_the_version(fake):
    fake.step_s = 0.02
    engine = _engine(fake)
    try:
        engine.submit([GenRequest(i, [3, i + 1], 200, seed=i) for i in range(2)])
        _wait(lambda: fake.tokens_done >= 6)
        engine.pause(WAIT_S)
        partial = _collect(engine, 2)
        assert fake.bodies("/pause_generation") == [{"mode": "abort"}]
        for out in partial.values():
            assert out.stop_reason == "abort"
            assert 0 < len(out.output_ids) < 200
            assert out.versions == [0] * len(out.output_ids)
        weights = [("w", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(3))]
        engine.update_weights(weights, 1)
        engine.resume()
        fake.step_s = 0.0
        engine.submit([GenRequest(7, [9], 3, seed=1)])
        after = _collect(engine, 1)[7]
    finally:
        engine.close()
    assert fake.problems == []
    update = fake.bodies("/update_weights_from_tensor")[0]
    assert update["flush_cache"] is True and update["weight_version"] == "1"
    assert update["load_format"] is None and len(update["serialized_named_tensors"]) == 1
    got = pickle.loads(fake.tensor_payloads[0])
    assert [n for n, _ in got] == ["w", "b"] and torch.equal(got[0][1], weights[0][1])
    assert fake.bodies("/continue_generation") == [{}]
    assert after.versions == [1, 1, 1] and fake.bodies("/generate")[-1]["cache_salt"] == "v1"
    assert engine.version == 1


def test_keep_pause_switches_versions_mid_sample(fake, tmp_path):
    from areal_fast.sync.shared_memory import SharedWeightBuffer

    fake.step_s = 0.02
    engine = _engine(fake, pause_mode="keep")
    weights = [("w", torch.full((4,), 2.5))]
    buffer = SharedWeightBuffer.create(weights, directory=str(tmp_path))
    buffer.write(weights)
    try:
        engine.submit([GenRequest(0, [4, 4], 40, seed=3)])
        _wait(lambda: fake.tokens_done >= 5)
        engine.pause(WAIT_S)
        assert fake.bodies("/pause_generation") == [{"mode": "in_place"}]
        assert engine.get_outputs(0.2) == []  # the request stays inside the server
        engine.update_weights_from_buffer(buffer.spec, 1)
        engine.resume()
        out = _collect(engine, 1)[0]
    finally:
        engine.close()
        buffer.close()
    assert fake.problems == []
    update = fake.bodies("/update_weights_from_tensor")[0]
    assert update["flush_cache"] is False and update["weight_version"] == "1"
    name, tensor = pickle.loads(fake.tensor_payloads[0])[0]
    assert name == "w" and torch.equal(tensor, torch.full((4,), 2.5))
    seam = out.versions.index(1)
    assert 5 <= seam < 40 and out.versions == [0] * seam + [1] * (40 - seam)
    assert out.output_ids == [token_at([4, 4], 3, j) for j in range(40)]
    assert out.stop_reason == "length"


def test_keep_pause_without_spans_refuses_to_guess_the_seam():
    fake = FakeSGLang(step_s=0.02, report_spans=False)
    engine = _engine(fake, pause_mode="keep")
    try:
        engine.submit([GenRequest(0, [4], 30)])
        _wait(lambda: fake.tokens_done >= 3)
        engine.pause(WAIT_S)
        engine.update_weights([("w", torch.zeros(2))], 1)
        engine.resume()
        with pytest.raises(EngineError, match="weight_versions.*pause_mode: abort"):
            _collect(engine, 1)
    finally:
        engine.close()
        fake.close()


def test_distributed_update_names_the_tensors_the_trainer_broadcasts(fake):
    engine = _engine(fake)
    sent = []
    try:
        with pytest.raises(RuntimeError, match="pause"):
            engine.update_weights_distributed(["w"], ["float32"], [[2]], lambda: None, 1)
        engine.pause(WAIT_S)
        engine.update_weights_distributed(
            ["w", "b"], [torch.float32, "float32"], [[2, 3], [3]], lambda: sent.append(1), 1
        )
        engine.resume()
        engine.submit([GenRequest(0, [1], 2)])
        out = _collect(engine, 1)[0]
    finally:
        engine.close()
    assert fake.problems == [] and sent == [1]
    assert fake.bodies("/update_weights_from_distributed") == [
        {"names": ["w", "b"], "dtypes": ["float32", "float32"], "shapes": [[2, 3], [3]],
         "group_name": "areal_fast", "flush_cache": True, "weight_version": "1"}
    ]  # fmt: skip
    assert engine.version == 1 and out.versions == [1, 1]


@pytest.mark.parametrize("path", ["/generate", "/pause_generation"])
@pytest.mark.parametrize("fault", ["malformed", "500"])
def test_bad_replies_are_errors_naming_the_endpoint(fake, path, fault):
    fake.broken[path] = fault
    engine = _engine(fake)
    want = "malformed JSON" if fault == "malformed" else "HTTP 500.*boom"
    start = time.monotonic()
    try:
        if path == "/generate":
            engine.submit([GenRequest(0, [1, 2], 4)])
            with pytest.raises(EngineError, match=f"SGLang server engine.*POST .*{path}.*{want}"):
                _collect(engine, 1)
            with pytest.raises(EngineError, match=path):  # stored: every later call fails
                engine.submit([GenRequest(1, [1], 1)])
        else:
            with pytest.raises(EngineError, match=f"POST .*{path}.*{want}"):
                engine.pause(WAIT_S)
    finally:
        engine.close()
    assert time.monotonic() - start < WAIT_S


def test_a_url_nobody_listens_on_fails_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = SGLangServerEngine(f"http://127.0.0.1:{port}", max_running=1, call_timeout=5.0)
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"127.0.0.1:{port}/update_weight_version.*connect"):
        engine.start()
    engine.close()
    assert time.monotonic() - start < 5.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="http"):
        SGLangServerEngine("localhost:30000", max_running=1)
    with pytest.raises(ValueError, match="pause_mode"):
        SGLangServerEngine("http://127.0.0.1:1", max_running=1, pause_mode="retract")
    with pytest.raises(ValueError, match="tp_size"):
        SGLangServerEngine("http://127.0.0.1:1", max_running=1, tp_size=0)


# ------------------------------------------------------------------ live SGLang server


def _live_ready() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if not torch.cuda.is_available():
        return "SGLang needs a GPU"
    if not os.environ.get("AREAL_FAST_SGLANG_MODEL"):
        return "AREAL_FAST_SGLANG_MODEL (a small HF model path) is not set"
    return None


@pytest.mark.skipif(_live_ready() is not None, reason=str(_live_ready()))
def test_live_sglang_server_generates_pauses_and_updates(tmp_path):
    import signal
    import subprocess
    import sys

    import transformers

    model_path = os.environ["AREAL_FAST_SGLANG_MODEL"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "sglang.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--mem-fraction-static",
            "0.3",
            "--skip-tokenizer-init",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    engine = SGLangServerEngine(f"http://127.0.0.1:{port}", max_running=4, call_timeout=300)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                engine.start()
                break
            except EngineError:
                engine.close()
                engine = SGLangServerEngine(
                    f"http://127.0.0.1:{port}", max_running=4, call_timeout=300
                )
                assert proc.poll() is None and time.monotonic() < deadline, "no SGLang server"
                time.sleep(5)
        engine.submit([GenRequest(i, [1, 2, 3, 4], 64, temperature=1.0, seed=i) for i in range(4)])
        time.sleep(0.5)
        engine.pause(120)
        first = _collect(engine, 4, 120)
        assert all(o.stop_reason in ("abort", "length", "stop") for o in first.values())
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path)
        named = [(n, p.detach().cuda()) for n, p in model.named_parameters()]
        engine.update_weights(named, 1)
        engine.resume()
        engine.submit([GenRequest(9, [1, 2, 3], 8, seed=9)])
        out = _collect(engine, 1, 120)[9]
        assert out.versions == [1] * len(out.output_ids) and len(out.logprobs) == len(
            out.output_ids
        )
    finally:
        engine.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
