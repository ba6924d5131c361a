"""VLLMServerEngine: contract tests against a fake ``vllm serve`` on 127.0.0.1 that checks
every request against a copy of vLLM's route schemas (tests/rollout/vllm_server_schema.py),
and live tests (marked ``vllm``) against a real server the engine starts on the demo model.

Live: ``pytest -m vllm tests/rollout/test_vllm_server.py`` in the vLLM venv (see .ci/vllm_lane).
One server is started for the whole module (about 20 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import areal_fast
from areal_fast.rollout.config import VLLMConfig
from areal_fast.rollout.engine import GenRequest
from areal_fast.rollout.loop_engine import EngineError
from areal_fast.rollout.vllm_server import GENERATE, VLLMServerEngine
from areal_fast.sync.receivers.vllm import buffer_spec_to_dict
from areal_fast.sync.shared_memory import SharedWeightBuffer


def _load(name: str):
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_areal_fast_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


schema = _load("vllm_server_schema")
WAIT_S = 10.0
KEY = "test-key"


def token_at(ids: list[int], seed: int, j: int) -> int:
    return 1 + (sum(ids) * 31 + seed * 7 + j * 13) % 97


class FakeVLLM:
    """Emulates ``vllm serve``'s token route (one token every ``step_s`` s), the RL pause
    modes (abort: running requests end with their partial tokens; keep: they wait and
    continue under the current label, with ``weight_versions`` spans), the weight-update
    routes and ``/collective_rpc`` with the areal_fast worker extension's state."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.lock = threading.Condition()
        self.requests: list[tuple[str, dict, object]] = []
        self.problems: list[str] = []
        self.label = "default"
        self.worker_version = None
        self.pending = None
        self.mode = None
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.tokens_done = 0
        self.broken: dict[str, str] = {}
        self.refuse_update = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                fake.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        with self.lock:
            self.mode = None
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def calls(self) -> list[str]:
        return [p for p, _, _ in self.requests]

    def bodies(self, path):
        return [b for p, _, b in self.requests if p == path]

    def handle(self, h):
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        payload = json.loads(raw) if raw else None
        with self.lock:
            self.requests.append((url.path, query, payload))
        authorized = h.headers.get("Authorization") == f"Bearer {KEY}"
        problems = schema.validate(url.path, query, payload, authorized)
        if problems:
            with self.lock:
                self.problems.extend(problems)
            return self.reply(h, 400, {"error": "; ".join(problems)})
        broken = self.broken.get(url.path)
        if broken == "500":
            return self.reply(h, 500, {"error": "Failed to pause generation: boom"})
        if broken == "malformed":
            return self.reply(h, 200, b"<html>not json")
        route = getattr(self, "route_" + url.path.strip("/").replace("/", "_"))
        status, body = route(query, payload or {})
        self.reply(h, status, body)

    @staticmethod
    def reply(h, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def route_inference_v1_generate(self, query, body):
        rid, ids, params = body["request_id"], body["token_ids"], body["sampling_params"]
        tokens, labels, reason = [], [], "length"
        with self.lock:
            self.running.add(rid)
        try:
            for j in range(params["max_tokens"]):
                with self.lock:
                    while self.mode == "keep":
                        self.lock.wait(0.05)
                    if rid in self.aborted:
                        reason = "abort"
                        break
                    tokens.append(token_at(ids, params.get("seed") or 0, j))
                    labels.append(self.label)
                    self.tokens_done += 1
                if self.step_s:
                    time.sleep(self.step_s)
        finally:
            with self.lock:
                self.running.discard(rid)
                self.aborted.discard(rid)
        spans = []
        for i, label in enumerate(labels):
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": label, "start": i, "end": i + 1})
        content = [{"token_id": t, "logprob": -0.01 * t, "rank": 1, "top_logprobs": []}
                   for t in tokens]  # fmt: skip
        choice = {"index": 0, "finish_reason": reason, "stop_reason": None,
                  "token_ids": tokens, "weight_versions": spans or None,
                  "logprobs": {"content": content}}  # fmt: skip
        return 200, {"request_id": f"generate-tokens-{rid}", "choices": [choice]}

    def route_pause(self, query, body):
        with self.lock:
            if query.get("mode", "abort") == "abort":
                self.aborted |= self.running
            self.mode = query.get("mode", "abort")
            self.lock.notify_all()
        return 200, {"status": "paused"}

    def route_resume(self, query, body):
        with self.lock:
            self.mode = None
            self.lock.notify_all()
        return 200, {"status": "resumed"}

    def route_start_weight_update(self, query, body):
        return 200, {"message": "Weight update started"}

    def route_update_weights(self, query, body):
        info = body["update_info"]
        if not self.refuse_update:
            self.pending = info["expected_version"]
        return 200, {"message": "Weights updated"}

    def route_finish_weight_update(self, query, body):
        if self.pending is not None:
            self.worker_version, self.pending = self.pending, None
        return 200, {"message": "Weight update finished"}

    def route_update_weight_version(self, query, body):
        with self.lock:
            self.label = body["new_version"]
        return 200, {"success": True, "new_version": body["new_version"]}

    def route_collective_rpc(self, query, body):
        if body["method"] == "areal_fast_sync_status":
            state = {"configured": True, "weight_version": self.worker_version, "failure": ""}
            if self.refuse_update:
                state["failure"] = "shared buffer checksum mismatch"
            return 200, {"results": [state]}
        return 200, b""  # every worker returned None


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def _engine(fake, **kw) -> VLLMServerEngine:
    kw.setdefault("max_running", 4)
    config = VLLMConfig(dtype="float32", call_timeout=kw.pop("call_timeout", WAIT_S))
    engine = VLLMServerEngine("unused-model", config, server_url=fake.url, api_key=KEY, **kw)
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
        requests = [GenRequest(i, [5, 6 + i], 3 + i, temperature=0.8, top_p=0.95,
                               seed=40 + i, offset=2 * i) for i in range(3)]  # fmt: skip
        engine.submit(requests)
        outputs = _collect(engine, 3)
    finally:
        engine.close()
    assert fake.problems == []
    assert fake.calls()[0] == "/update_weight_version"
    assert fake.bodies("/update_weight_version") == [{"new_version": "0"}]
    for r, body in zip(requests, sorted(fake.bodies(GENERATE), key=lambda b: b["token_ids"])):
        seed = r.seed ^ r.offset
        assert body["sampling_params"] == {"temperature": 0.8, "top_p": 0.95,
                                           "max_tokens": r.max_new_tokens, "logprobs": 0,
                                           "seed": seed}  # fmt: skip
        assert body["cache_salt"] == "v0" and body["request_id"].startswith(f"areal-{r.rid}-")
        out = outputs[r.rid]
        want = [token_at(r.input_ids, seed, j) for j in range(r.max_new_tokens)]
        assert out.output_ids == want
        assert out.logprobs == pytest.approx([-0.01 * t for t in want])
        assert out.versions == [0] * len(want) and out.stop_reason == "length"


def test_abort_pause_and_a_shared_memory_update(fake, tmp_path):
    fake.step_s = 0.02
    engine = _engine(fake)
    weights = [("w", torch.arange(4.0))]
    buffer = SharedWeightBuffer.create(weights, directory=str(tmp_path))
    buffer.write(weights)
    try:
        engine.submit([GenRequest(i, [2, i], 200) for i in range(2)])
        _wait(lambda: fake.tokens_done >= 6)
        engine.pause(WAIT_S)
        for out in _collect(engine, 2).values():
            assert out.stop_reason == "abort" and 0 < len(out.output_ids) < 200
            assert out.versions == [0] * len(out.output_ids)
        start = len(fake.requests)
        engine.update_weights_from_buffer(buffer.spec, 1)
        update_calls = fake.calls()[start:]
        engine.resume()
        fake.step_s = 0.0
        engine.submit([GenRequest(5, [7], 2)])
        after = _collect(engine, 1)[5]
    finally:
        engine.close()
        buffer.close()
    assert fake.problems == []
    assert [q for p, q, _ in fake.requests if p == "/pause"] == [
        {"mode": "abort", "clear_cache": "true"}
    ]
    assert update_calls == [
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/collective_rpc",
        "/update_weight_version",
        "/collective_rpc",
    ]
    assert fake.bodies("/update_weights") == [
        {"update_info": {"expected_version": 1, "shared_buffer": buffer_spec_to_dict(buffer.spec)}}
    ]
    assert fake.bodies("/update_weight_version")[-1] == {"new_version": "1"}
    assert after.versions == [1, 1] and fake.bodies(GENERATE)[-1]["cache_salt"] == "v1"


def test_keep_pause_switches_versions_mid_sample(fake, tmp_path):
    fake.step_s = 0.02
    engine = _engine(fake, pause_mode="keep")
    weights = [("w", torch.ones(2))]
    buffer = SharedWeightBuffer.create(weights, directory=str(tmp_path))
    buffer.write(weights)
    try:
        engine.submit([GenRequest(0, [3], 30, seed=5)])
        _wait(lambda: fake.tokens_done >= 4)
        engine.pause(WAIT_S)
        assert engine.get_outputs(0.2) == []
        engine.update_weights_from_buffer(buffer.spec, 1)
        engine.resume()
        out = _collect(engine, 1)[0]
    finally:
        engine.close()
        buffer.close()
    assert fake.problems == []
    assert [q for p, q, _ in fake.requests if p == "/pause"] == [
        {"mode": "keep", "clear_cache": "false"}
    ]
    seam = out.versions.index(1)
    assert 4 <= seam < 30 and out.versions == [0] * seam + [1] * (30 - seam)
    assert out.output_ids == [token_at([3], 5, j) for j in range(30)]


def test_an_update_the_workers_did_not_install_fails_the_engine(fake, tmp_path):
    fake.refuse_update = True
    engine = _engine(fake)
    weights = [("w", torch.ones(2))]
    buffer = SharedWeightBuffer.create(weights, directory=str(tmp_path))
    try:
        engine.pause(WAIT_S)
        with pytest.raises(EngineError, match="v1 not installed on 1 of 1 workers.*checksum"):
            engine.update_weights_from_buffer(buffer.spec, 1)
        assert engine.version == 0
        assert {"new_version": "1"} not in fake.bodies("/update_weight_version")
    finally:
        engine.close()
        buffer.close()


@pytest.mark.parametrize("path", [GENERATE, "/pause"])
@pytest.mark.parametrize("fault", ["malformed", "500"])
def test_bad_replies_are_errors_naming_the_endpoint(fake, path, fault):
    fake.broken[path] = fault
    engine = _engine(fake)
    want = "malformed JSON" if fault == "malformed" else "HTTP 500.*boom"
    start = time.monotonic()
    try:
        if path == GENERATE:
            engine.submit([GenRequest(0, [1, 2], 4)])
            with pytest.raises(EngineError, match=f"vLLM server engine.*POST .*{path}.*{want}"):
                _collect(engine, 1)
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
    engine = VLLMServerEngine(
        "m", VLLMConfig(call_timeout=5.0), max_running=1, server_url=f"http://127.0.0.1:{port}"
    )
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"vLLM server engine.*127.0.0.1:{port}.*connect"):
        engine.start()
    engine.close()
    assert time.monotonic() - start < 5.0


def test_the_serve_command_binds_localhost_and_keeps_the_key_off_the_command_line():
    config = VLLMConfig(dtype="bfloat16", max_model_len=512, kv_cache_gib=2,
                        enable_prefix_caching=False, seed=4)  # fmt: skip
    engine = VLLMServerEngine("/models/x", config, max_running=3, threads=2)
    args = engine.serve_command(18000)
    env = engine._serve_env("secret-key")
    assert args[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    pairs = dict(zip(args[3::], args[4::]))
    assert pairs["--model"] == "/models/x" and pairs["--host"] == "127.0.0.1"
    assert pairs["--port"] == "18000" and pairs["--max-num-seqs"] == "3"
    assert pairs["--dtype"] == "bfloat16" and pairs["--max-model-len"] == "512"
    assert pairs["--logprobs-mode"] == "processed_logprobs" and pairs["--seed"] == "4"
    assert json.loads(pairs["--weight-transfer-config"]) == {"backend": "areal_fast"}
    assert pairs["--worker-extension-cls"].endswith("AReaLFastWorkerExtension")
    assert "--enable-scale-out" in args and "--no-enable-prefix-caching" in args
    assert "--enforce-eager" in args and not any("secret" in a for a in args)
    assert env["VLLM_API_KEY"] == "secret-key" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "2"
    # the server imports the same areal_fast (the backend and worker extension) as this one
    root = str(Path(areal_fast.__file__).resolve().parents[1])
    assert root in env["PYTHONPATH"].split(os.pathsep)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="http"):
        VLLMServerEngine("m", VLLMConfig(), max_running=1, server_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="startup_timeout"):
        VLLMServerEngine("m", VLLMConfig(startup_timeout=0), max_running=1)
    with pytest.raises(ValueError, match="pause_mode"):
        VLLMServerEngine("m", VLLMConfig(), max_running=1, pause_mode="wait")


# ------------------------------------------------------------------ live vLLM server

live = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (see .ci/vllm_lane)"
)
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def served():
    from areal_fast.models.loading import demo_model_dir

    config = VLLMConfig(dtype="float32", max_model_len=512, kv_cache_gib=1, call_timeout=120,
                        startup_timeout=300)  # fmt: skip
    engine = VLLMServerEngine(str(demo_model_dir()), config, max_running=4)
    start = time.monotonic()
    engine.start()
    print(f"vllm serve started in {time.monotonic() - start:.1f} s, log {engine.log_path}")
    yield engine
    engine.close()
    assert engine.process.poll() is not None, "the server outlived its engine"


def _hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _mean_abs_diff(model, prompt, out) -> float:
    want = _hf_logprobs(model, prompt, out.output_ids)
    return (torch.tensor(out.logprobs, dtype=torch.float64) - want).abs().mean().item()


PROMPT = [1, 504, 3575, 282, 4649, 314]


@live
@pytest.mark.vllm
@pytest.mark.slow
def test_live_generate_matches_hf_logprobs(served):
    from areal_fast.models.loading import load_causal_lm

    served.submit([GenRequest(i, PROMPT, 16, temperature=TEMPERATURE, seed=i)
                   for i in range(3)])  # fmt: skip
    outputs = _collect(served, 3, 120)
    model = load_causal_lm(served.model_path, "float32").eval()
    for out in outputs.values():
        assert len(out.output_ids) >= 1 and out.versions == [0] * len(out.output_ids)
        diff = _mean_abs_diff(model, PROMPT, out)
        print(f"request {out.rid}: {len(out.output_ids)} tokens, log-prob mean |diff| {diff:.2e}")
        assert diff < 1e-4


@live
@pytest.mark.vllm
@pytest.mark.slow
def test_live_abort_pause_returns_partial_tokens(served):
    served.submit([GenRequest(10 + i, PROMPT, 400, temperature=1.0, seed=i) for i in range(2)])
    time.sleep(2.0)
    served.pause(60, keep=False)
    outputs = _collect(served, 2, 60)
    served.resume()
    for out in outputs.values():
        assert out.stop_reason == "abort" and 0 < len(out.output_ids) < 400, out
        assert len(out.logprobs) == len(out.output_ids)


@live
@pytest.mark.vllm
@pytest.mark.slow
def test_live_keep_pause_and_shared_memory_update_switch_versions_mid_sample(served, tmp_path):
    from areal_fast.models.loading import load_causal_lm

    model = load_causal_lm(served.model_path, "float32").eval()
    gen = torch.Generator().manual_seed(int(time.time()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    buffer = SharedWeightBuffer.create(named, directory=str(tmp_path))
    buffer.write(named)
    try:
        served.submit([GenRequest(20, PROMPT, 200, temperature=1.0, seed=3)])
        time.sleep(2.0)
        served.pause(60, keep=True)
        start = time.monotonic()
        served.update_weights_from_buffer(buffer.spec, 1)
        print(f"shared-memory update took {time.monotonic() - start:.2f} s")
        served.resume()
        kept = _collect(served, 1, 120)[20]
        served.submit([GenRequest(21, PROMPT, 16, temperature=TEMPERATURE, seed=4)])
        fresh = _collect(served, 1, 120)[21]
    finally:
        buffer.close()
    assert kept.stop_reason in ("length", "stop")
    seam = kept.versions.index(1)
    assert 0 < seam < len(kept.versions)
    assert kept.versions == [0] * seam + [1] * (len(kept.versions) - seam)
    assert served.version == 1 and fresh.versions == [1] * len(fresh.output_ids)
    diff = _mean_abs_diff(model, PROMPT, fresh)
    print(
        f"kept request: seam at token {seam} of {len(kept.versions)}; after the update: "
        f"log-prob mean |diff| {diff:.2e} against the new weights"
    )
    assert diff < 1e-4


@live
@pytest.mark.vllm
@pytest.mark.slow
def test_live_a_killed_server_fails_the_engine_naming_it(served):
    """Runs last: it kills the module's server."""
    served.submit([GenRequest(30, PROMPT, 400, seed=1)])
    time.sleep(1.0)
    os.killpg(served.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"vLLM server engine \(pid .*exited"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            served.get_outputs(0.2)
    assert time.monotonic() - start < 30
    with pytest.raises(EngineError, match="vLLM server engine"):
        served.submit([GenRequest(31, PROMPT, 4)])
    assert isinstance(served.process.wait(10), int)
