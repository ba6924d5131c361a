"""AsyncVLLMEngine with LoRA (``actor.lora`` + ``rollout.engine: vllm``) against a real vLLM
on the demo model: adapter-only updates loaded through vLLM's LoRA API, one per version.

Run in the vLLM venv of .ci/vllm_lane: ``pytest -m vllm tests/rollout/test_vllm_lora.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from areal_fast.rollout.engine import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = list(range(100, 130))
TEMPERATURE = 0.8


def _collect(engine, n, timeout=300.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} outputs"
        out += engine.get_outputs(1.0)
    return {o.rid: o for o in out}


@pytest.fixture(scope="module")
def trainer():
    from areal_fast.models.loading import demo_model_dir, load_causal_lm
    from areal_fast.train.config import ActorConfig
    from areal_fast.train.lora import LoraConfig
    from areal_fast.train.torch_engine import TorchTrainEngine

    lora = LoraConfig(rank=8, alpha=16.0)  # every linear layer but the LM head
    model = load_causal_lm(str(demo_model_dir()), "float32", "sdpa", "cpu")
    return TorchTrainEngine(model, ActorConfig(lora=lora), temperature=TEMPERATURE)


@pytest.fixture(scope="module")
def engine():
    from areal_fast.models.loading import demo_model_dir
    from areal_fast.rollout.config import VLLMConfig
    from areal_fast.rollout.vllm_async import AsyncVLLMEngine

    config = VLLMConfig(dtype="float32", max_model_len=512)
    eng = AsyncVLLMEngine(str(demo_model_dir()), config, max_running=8, lora_rank=8)
    eng.start()
    yield eng
    eng.close()


def _random_adapter(trainer, seed: int) -> None:
    from areal_fast.train.lora import lora_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(trainer.model):
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _publish(trainer, engine, version: int) -> int:
    """The trainer's weight update (adapter only) through a shared-memory slot; its bytes."""
    from areal_fast.sync.shared_memory import SharedWeightBuffer

    weights = list(trainer.named_weights())
    buffer = SharedWeightBuffer.create(iter(weights))
    try:
        buffer.write(iter(weights))
        engine.pause(60.0)
        engine.update_weights_from_buffer(buffer.spec, version)
        engine.resume()
    finally:
        buffer.close()
    return sum(t.numel() * t.element_size() for _, t in weights)


@pytest.fixture(scope="module")
def merged():
    """A plain model that takes the trainer's adapter merged into its weights (the HF
    engine's merge, which tests/rollout/test_lora_merge.py holds to peft's)."""
    from areal_fast.models.loading import demo_model_dir, load_causal_lm
    from areal_fast.rollout.lora_merge import AdapterMerger

    return AdapterMerger(load_causal_lm(str(demo_model_dir()), "float32", "sdpa", "cpu"))


def _reference_logprobs(merged, trainer, prompt, output_ids) -> torch.Tensor:
    """Log-probs of ``output_ids`` at the temperature under the trainer's adapter merged into
    the base (``trainer`` None: the base model itself)."""
    merged.install(trainer.named_weights() if trainer else [])
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = merged.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp.gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def test_each_adapter_version_is_served_as_the_trainer_computes_it(engine, trainer, merged):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for version in (1, 2):
        _random_adapter(trainer, seed + version)
        sent = _publish(trainer, engine, version)
        full = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        assert sent < full / 10  # only the adapter travels
        engine.submit([GenRequest(100 * version + i, PROMPT, 16, TEMPERATURE, 1.0, seed=i)
                       for i in range(2)])  # fmt: skip
        for out in _collect(engine, 2).values():
            assert out.versions == [version] * len(out.output_ids)
            want = _reference_logprobs(merged, trainer, PROMPT, out.output_ids)
            got = torch.tensor(out.logprobs, dtype=torch.float64)
            assert (want - got).abs().max().item() < 1e-3, f"v{version}, seed {seed}"
            # and the adapter matters: the base model's log-probs are far from them
            base = _reference_logprobs(merged, None, PROMPT, out.output_ids)
            assert (base - got).abs().max().item() > 1e-2, f"v{version}, seed {seed}"
        # the served adapter is named by its version; the previous one is gone
        assert engine._adapters.current.lora_name == f"v{version}"
        assert [p.name for p in engine._adapters.root.iterdir()] == [f"v{version}"]


def test_an_adapter_update_to_an_engine_without_lora_is_refused():
    from areal_fast.models.loading import demo_model_dir
    from areal_fast.rollout.config import VLLMConfig
    from areal_fast.rollout.loop_engine import EngineError
    from areal_fast.rollout.vllm_async import AsyncVLLMEngine

    config = VLLMConfig(dtype="float32")
    plain = AsyncVLLMEngine(str(demo_model_dir()), config, max_running=1)  # not started
    update = [("model.layers.0.mlp.up_proj.lora_A", torch.zeros(8, 576))]
    with pytest.raises(EngineError, match=r"adapter-only update \(v3\).*without LoRA"):
        asyncio.run(plain._load_adapter(update, 3))


def test_lora_with_a_kept_pause_is_refused():
    from areal_fast.models.loading import demo_model_dir
    from areal_fast.rollout.config import VLLMConfig
    from areal_fast.rollout.vllm_async import AsyncVLLMEngine

    with pytest.raises(ValueError, match=r"lora_rank > 0 needs pause_mode = 'abort'"):
        AsyncVLLMEngine(
            str(demo_model_dir()), VLLMConfig(), max_running=1, pause_mode="keep", lora_rank=8
        )
