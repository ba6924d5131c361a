"""SGLangWeightClient against a fake SGLang server on 127.0.0.1 that checks every request
body against a copy of SGLang's request schemas (tests/sync/sglang_schema.py), plus one live
test against a real SGLang server (runs only with sglang, a GPU and AREAL_FAST_SGLANG_MODEL).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import random
import socket
import string
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from areal_fast.sync.receivers.sglang import SGLangWeightClient


def _load_schema():
    path = Path(__file__).with_name("sglang_schema.py")
    spec = importlib.util.spec_from_file_location("_areal_fast_sglang_schema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


schema = _load_schema()

PAUSE, UPDATE, CONTINUE = (
    "/pause_generation",
    "/update_weights_from_distributed",
    "/continue_generation",
)
WAIT_S = 5.0  # bound of every wait inside the fake server and the fake trainer


class FakeSGLang:
    """Records requests, validates their bodies against the schema copy and answers like
    SGLang's routes. ``update_received`` / ``broadcast_done`` emulate the process-group
    rendezvous: the update handler replies only after the trainer's broadcast ran."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.paused = False
        self.weight_version = "default"
        self.fail_update: tuple[int, dict] | None = None  # (HTTP status, JSON reply)
        self.hang: set[str] = set()  # paths whose handler never answers (until teardown)
        self.flush_busy = False
        self.need_broadcast = True
        self.update_received = threading.Event()
        self.broadcast_done = threading.Event()
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    @property
    def paths(self) -> list[str]:
        with self.lock:
            return [r["path"] for r in self.requests]

    def of(self, path: str) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["path"] == path]

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, body) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        payload = json.loads(raw) if raw else None
        path = h.path
        problems = schema.validate(path, method, payload)
        with self.lock:
            self.requests.append(
                {
                    "method": method,
                    "path": path,
                    "payload": payload,
                    "problems": problems,
                    "auth": h.headers.get("Authorization"),
                    "content_type": h.headers.get("Content-Type"),
                }
            )
        if self.api_key is not None and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self.reply(h, 401, {"error": "Unauthorized"})
        if path not in schema.ENDPOINTS:
            return self.reply(h, 404, {"detail": "Not Found"})
        if problems:  # FastAPI answers a body that does not validate with 400
            return self.reply(h, 400, {"object": "error", "message": "; ".join(problems)})
        if path in self.hang:
            self.release.wait(2 * WAIT_S)
            return None
        if path == PAUSE:
            self.paused = True
            return self.reply(
                h, 200, {"message": "Generation paused successfully.", "status": "ok"}
            )
        if path == CONTINUE:
            self.paused = False
            return self.reply(
                h, 200, {"message": "Generation continued successfully.", "status": "ok"}
            )
        if path == "/flush_cache":
            if self.flush_busy:
                return self.reply(
                    h,
                    400,
                    "Cache flushed.\nPlease check backend logs for more "
                    "details. (When there are running or waiting "
                    "requests, the operation will not be performed.)\n",
                )
            return self.reply(h, 200, "Cache flushed.\n")
        if path == "/get_weight_version":
            return self.reply(h, 200, {"weight_version": self.weight_version})
        if path == UPDATE:
            self.update_received.set()
            if self.fail_update is not None:
                return self.reply(h, *self.fail_update)
            if self.need_broadcast and not self.broadcast_done.wait(WAIT_S):
                return self.reply(
                    h, 400, {"success": False, "message": "fake: no broadcast arrived"}
                )
            if payload.get("weight_version") is not None:
                self.weight_version = payload["weight_version"]
            return self.reply(
                h, 200, {"success": True, "message": "Succeeded to update parameter online."}
            )
        return self.reply(h, 200, {"success": True, "message": "ok"})


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


@pytest.fixture
def rng(fresh_seed) -> random.Random:
    return random.Random(fresh_seed)


def random_specs(rng: random.Random, one_dtype: str | None = None, min_n: int = 1):
    n = rng.randint(min_n, 8)
    token = "".join(rng.choices(string.ascii_lowercase, k=6))
    names = [f"model.layers.{i}.{token}_{rng.randint(0, 999)}.weight" for i in range(n)]
    dtypes = [one_dtype or rng.choice(["bfloat16", "float16", "float32"]) for _ in range(n)]
    shapes = [[rng.randint(1, 64) for _ in range(rng.randint(1, 3))] for _ in range(n)]
    return names, dtypes, shapes


def trainer_broadcast(fake: FakeSGLang, calls: list):
    """The trainer side: like NCCL it cannot finish before the receiver joined."""

    def broadcast():
        calls.append(time.monotonic())
        assert fake.update_received.wait(WAIT_S), "update request not in flight during broadcast"
        fake.broadcast_done.set()

    return broadcast


def assert_all_valid(fake: FakeSGLang) -> None:
    with fake.lock:
        bad = [(r["path"], r["problems"]) for r in fake.requests if r["problems"]]
    assert not bad, bad


# ------------------------------------------------------------------ payload contract


def test_every_payload_validates_against_the_schema_copy(fake, rng):
    client = SGLangWeightClient(fake.url + "/", timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng)
    port = rng.randint(20000, 60000)
    group = f"g{rng.randint(0, 10**6)}"
    label = f"v{rng.randint(0, 10**6)}"

    assert client.init_weights_update_group("10.0.0.1", port, 1, 3, group_name=group)["success"]
    fake.need_broadcast = False
    assert client.update_weights_from_distributed(
        names, dtypes, shapes, group, weight_version=label
    )["success"]
    same = rng.choice(["bfloat16", "float32"])
    assert client.update_weights_from_distributed(
        names, [same] * len(names), shapes, group, load_format="flattened_bucket"
    )["success"]
    blob = os.urandom(rng.randint(1, 64))
    assert client.update_weights_from_tensor(
        [blob, "c3RyaW5n"], load_format="direct", weight_version=label
    )["success"]
    for mode in ("abort", "retract", "in_place"):
        client.pause_generation(mode)
    client.continue_generation()
    client.flush_cache()
    assert client.get_weight_version() == label
    assert client.destroy_weights_update_group(group)["success"]
    assert_all_valid(fake)

    init = fake.of("/init_weights_update_group")[0]["payload"]
    assert init == {
        "master_address": "10.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": group,
        "backend": "nccl",
    }
    plain, bucket = (r["payload"] for r in fake.of(UPDATE))
    assert (plain["names"], plain["dtypes"], plain["shapes"]) == (names, dtypes, shapes)
    assert plain["group_name"] == group and plain["weight_version"] == label
    assert plain["flush_cache"] is True and "load_format" not in plain
    assert bucket["load_format"] == "flattened_bucket" and set(bucket["dtypes"]) == {same}
    tensor = fake.of("/update_weights_from_tensor")[0]["payload"]
    assert base64.b64decode(tensor["serialized_named_tensors"][0]) == blob
    assert [r["payload"]["mode"] for r in fake.of(PAUSE)] == ["abort", "retract", "in_place"]
    assert fake.of("/flush_cache")[0]["payload"] is None
    assert fake.of("/get_weight_version")[0]["method"] == "GET"
    assert all(
        r["content_type"] == "application/json" for r in fake.requests if r["payload"] is not None
    )


def test_torch_style_dtypes_and_shapes_are_normalised(fake, rng):
    torch = pytest.importorskip("torch")
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    fake.need_broadcast = False
    shape = torch.Size([rng.randint(1, 9), rng.randint(1, 9)])
    client.update_weights_from_distributed(["w"], [torch.bfloat16], [shape])
    payload = fake.of(UPDATE)[0]["payload"]
    assert payload["dtypes"] == ["bfloat16"] and payload["shapes"] == [list(shape)]
    assert_all_valid(fake)


def test_the_validator_rejects_what_sglang_would(rng):
    good = {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    assert schema.validate(UPDATE, "POST", good) == []
    assert schema.validate(UPDATE, "POST", {**good, "version": 3})  # unknown field
    assert schema.validate(UPDATE, "POST", {"names": ["a"], "dtypes": ["bf16"]})  # no shapes
    assert schema.validate(UPDATE, "POST", {**good, "shapes": [[2.0, 3]]})  # float dim
    assert schema.validate(UPDATE, "POST", {**good, "flush_cache": 1})  # int, not bool
    assert schema.validate(PAUSE, "POST", {"mode": "pause"})
    assert schema.validate("/get_weight_version", "POST", None)  # wrong method
    assert schema.validate(
        "/init_weights_update_group",
        "POST",
        {"master_address": "h", "master_port": "29500", "rank_offset": 1, "world_size": 2},
    )


# ------------------------------------------------------------------ sync_version


def test_sync_version_pauses_updates_with_the_version_and_continues(fake, rng):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng)
    version = rng.randint(0, 10**6)
    calls: list[float] = []
    reply = client.sync_version(version, names, dtypes, shapes, trainer_broadcast(fake, calls))
    assert reply["success"] is True
    assert fake.paths == [PAUSE, UPDATE, CONTINUE]
    assert len(calls) == 1 and not fake.paused
    update = fake.of(UPDATE)[0]["payload"]
    assert update["weight_version"] == str(version) and update["flush_cache"] is True
    assert (update["names"], update["dtypes"], update["shapes"]) == (names, dtypes, shapes)
    assert fake.of(PAUSE)[0]["payload"] == {"mode": "abort"}
    assert client.get_weight_version() == str(version)
    assert_all_valid(fake)


def test_sync_version_with_a_flattened_bucket(fake, rng):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng, one_dtype="bfloat16")
    version = rng.randint(0, 10**6)
    client.sync_version(
        version,
        names,
        dtypes,
        shapes,
        trainer_broadcast(fake, []),
        pause_mode="retract",
        load_format="flattened_bucket",
    )
    assert fake.paths == [PAUSE, UPDATE, CONTINUE]
    assert fake.of(PAUSE)[0]["payload"] == {"mode": "retract"}
    assert fake.of(UPDATE)[0]["payload"]["load_format"] == "flattened_bucket"
    assert_all_valid(fake)


@pytest.mark.parametrize("status", [400, 200])
def test_success_false_raises_naming_the_endpoint_and_leaves_the_engine_paused(fake, rng, status):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng)
    message = (
        f"Failed to update parameter online: boom-{rng.randint(0, 10**9)}. The full "
        "weights of the ModelRunner are partially updated."
    )
    fake.fail_update = (status, {"success": False, "message": message})
    with pytest.raises(RuntimeError) as info:
        client.sync_version(rng.randint(0, 99), names, dtypes, shapes, lambda: None)
    text = str(info.value)
    assert UPDATE in text and message in text and "\n" not in text
    assert fake.paths == [PAUSE, UPDATE]  # continue_generation never called
    assert fake.paused
    assert_all_valid(fake)


def test_a_failing_broadcast_raises_and_leaves_the_engine_paused(fake, rng):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng)
    fake.need_broadcast = False
    token = f"nccl-{rng.randint(0, 10**9)}"

    def broadcast():
        raise RuntimeError(f"{token}: connection reset")

    with pytest.raises(RuntimeError, match=token) as info:
        client.sync_version(1, names, dtypes, shapes, broadcast)
    assert UPDATE in str(info.value)
    assert fake.paths == [PAUSE, UPDATE] and fake.paused


def test_a_failing_pause_stops_before_the_update(fake, rng):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng)
    called = []
    fake.api_key = "secret"  # the client sends none: 401
    with pytest.raises(RuntimeError, match=f"{PAUSE}.*HTTP 401"):
        client.sync_version(1, names, dtypes, shapes, lambda: called.append(1))
    assert fake.paths == [PAUSE] and not called


def test_a_server_that_never_answers_raises_timeout_within_the_timeout(fake, rng):
    timeout = 0.5
    client = SGLangWeightClient(fake.url, timeout=timeout)
    names, dtypes, shapes = random_specs(rng)
    fake.hang.add(UPDATE)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        client.sync_version(rng.randint(0, 99), names, dtypes, shapes, lambda: None)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 2.0, elapsed
    text = str(info.value)
    assert f"{fake.url}{UPDATE}" in text and "0.5 s" in text and "\n" not in text
    assert fake.paths == [PAUSE, UPDATE] and fake.paused

    fake.hang.add("/get_weight_version")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"/get_weight_version timed out after 0\.5 s"):
        client.get_weight_version()
    assert time.monotonic() - start < timeout + 2.0


def test_arguments_are_checked_before_the_engine_is_paused(fake, rng):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    names, dtypes, shapes = random_specs(rng, min_n=2)
    n = len(names)
    bad = [
        dict(pause_mode="in_place"),
        dict(pause_mode="pause"),
        dict(load_format="flattened_bucket", dtypes=["bfloat16"] + ["float32"] * (n - 1)),
        dict(load_format="direct"),
        dict(names=names[:-1]),
        dict(names=[names[0]] * n),
        dict(names=[], dtypes=[], shapes=[]),
        dict(names="weight"),
        dict(dtypes=["bf 16"] * n),
        dict(shapes=[[1.5]] * n),
        dict(shapes=[[-1]] * n),
        dict(version=-1),
        dict(version=True),
        dict(version="3"),
        dict(group_name=""),
        dict(broadcast="not callable"),
        dict(timeout=0),
    ]
    for case in bad:
        kwargs = (
            dict(version=3, names=names, dtypes=dtypes, shapes=shapes, broadcast=lambda: None)
            | case
        )
        with pytest.raises(ValueError):
            client.sync_version(**kwargs)
    with pytest.raises(ValueError):
        client.pause_generation("pause")
    with pytest.raises(ValueError):
        client.init_weights_update_group("h", 70000, 1, 2)
    with pytest.raises(ValueError):
        client.init_weights_update_group("h", 29500, 2, 2)
    with pytest.raises(ValueError):
        client.update_weights_from_tensor([])
    assert fake.paths == []


# ------------------------------------------------------------------ transport errors


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1:30000",
        "localhost:30000",
        "127.0.0.1:30000",
        "http://",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:x",
        "",
        "http://host name:1",
        "http://u:p@127.0.0.1:1",
        "http://127.0.0.1:1/?a=1",
        None,
    ],
)
def test_a_bad_base_url_raises_value_error(url):
    with pytest.raises(ValueError) as info:
        SGLangWeightClient(url)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "soon"])
def test_a_bad_timeout_raises_value_error(timeout):
    with pytest.raises(ValueError):
        SGLangWeightClient("http://127.0.0.1:30000", timeout=timeout)


def test_an_unreachable_server_raises_runtime_error_naming_the_url():
    with socket.socket() as sock:  # a port nobody listens on any more
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = SGLangWeightClient(f"http://127.0.0.1:{port}", timeout=WAIT_S)
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}/continue_generation"):
        client.continue_generation()


def test_flush_refused_while_busy_names_the_endpoint(fake):
    client = SGLangWeightClient(fake.url, timeout=WAIT_S)
    fake.flush_busy = True
    with pytest.raises(
        RuntimeError,
        match=r"/flush_cache failed with HTTP 400: .*running or "
        r"waiting requests",
    ) as info:
        client.flush_cache()
    assert "\n" not in str(info.value)


def test_the_api_key_is_sent_as_a_bearer_token(rng):
    key = "k" + "".join(rng.choices(string.ascii_letters + string.digits, k=24))
    server = FakeSGLang(api_key=key)
    try:
        client = SGLangWeightClient(server.url, timeout=WAIT_S, api_key=key)
        names, dtypes, shapes = random_specs(rng)
        client.sync_version(7, names, dtypes, shapes, trainer_broadcast(server, []))
        assert {r["auth"] for r in server.requests} == {f"Bearer {key}"}
        assert key not in repr(client)
    finally:
        server.close()


def test_init_runs_the_trainer_rendezvous_while_the_request_is_in_flight(rng):
    server = FakeSGLang()
    try:
        client = SGLangWeightClient(server.url, timeout=WAIT_S)
        joined = []
        client.init_weights_update_group(
            "127.0.0.1", rng.randint(20000, 60000), 1, 2, rendezvous=lambda: joined.append(1)
        )
        assert joined == [1] and server.paths == ["/init_weights_update_group"]
        assert_all_valid(server)
    finally:
        server.close()


# ------------------------------------------------------------------ live SGLang server


def _live_ready() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no GPU"
    if not os.environ.get("AREAL_FAST_SGLANG_MODEL"):
        return "AREAL_FAST_SGLANG_MODEL (a small HF model path) is not set"
    return None


@pytest.mark.skipif(_live_ready() is not None, reason=str(_live_ready()))
def test_live_sglang_server_switches_weights(tmp_path, rng):
    """Launch SGLang on a small model, switch it to perturbed weights twice (per-tensor and
    flattened bucket) with sync_version, and read them back with /get_weights_by_name."""
    import signal
    import subprocess
    import sys
    import urllib.request

    import torch
    import transformers

    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        from sglang.srt.utils.common import init_custom_process_group

    model_path = os.environ["AREAL_FAST_SGLANG_MODEL"]

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, group_port = free_port(), free_port()
    log = open(tmp_path / "sglang.log", "w")
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
            "--tp-size",
            "1",
            "--mem-fraction-static",
            "0.3",
            "--dtype",
            "bfloat16",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    pg = None
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "sglang.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/get_model_info", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "SGLang did not start within 600 s"
            time.sleep(2)

        def post(path, body):
            req = urllib.request.Request(
                base + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        client = SGLangWeightClient(base, timeout=300)
        # NCCL cannot put two ranks on one GPU; gloo broadcasts CUDA tensors too.
        backend = "nccl" if torch.cuda.device_count() > 1 else "gloo"
        device = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(device)
        holder = {}

        def join():
            holder["pg"] = init_custom_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{group_port}",
                world_size=2,
                rank=0,
                group_name="areal_fast",
            )

        client.init_weights_update_group(
            "127.0.0.1", group_port, 1, 2, backend=backend, rendezvous=join
        )
        pg = holder["pg"]

        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=torch.bfloat16
        )
        params = dict(model.named_parameters())
        chosen = [n for n in params if n.endswith("mlp.down_proj.weight")][:2]
        assert chosen, "the live test expects a Llama/Qwen-style model (mlp.down_proj)"

        for version, load_format in ((1, None), (2, "flattened_bucket")):
            offset = rng.uniform(0.5, 1.5) * version
            tensors = [(params[n].detach() + offset).to(device) for n in chosen]

            def broadcast():
                if load_format is None:
                    for t in tensors:
                        torch.distributed.broadcast(t, src=0, group=pg)
                else:
                    torch.distributed.broadcast(
                        torch.cat([t.flatten() for t in tensors]), src=0, group=pg
                    )
                torch.cuda.synchronize(device)

            reply = client.sync_version(
                version,
                chosen,
                ["bfloat16"] * len(chosen),
                [list(t.shape) for t in tensors],
                broadcast,
                load_format=load_format,
            )
            assert reply["success"] is True
            assert client.get_weight_version() == str(version)
            for name, t in zip(chosen, tensors):
                got = post("/get_weights_by_name", {"name": name, "truncate_size": 2})
                want = t[:2].float().cpu()
                assert torch.allclose(
                    torch.tensor(got, dtype=torch.float32).reshape(want.shape), want, atol=1e-2
                ), name
            out = post(
                "/generate",
                {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            )
            assert "text" in out
        client.destroy_weights_update_group()
    finally:
        if pg is not None:
            torch.distributed.destroy_process_group(pg)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
