"""AsyncVLLMEngine (``rollout.engine: vllm``) against a real vLLM on the demo model.

Run in the vLLM venv of .ci/vllm_lane: ``pytest -m vllm tests/rollout/test_vllm_async.py``.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from areal_fast.rollout.engine import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = list(range(100, 130))


def _collect(engine, n, timeout=300.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} outputs"
        out += engine.get_outputs(1.0)
    return {o.rid: o for o in out}


@pytest.fixture(scope="module")
def model():
    from areal_fast.models.loading import demo_model_dir, load_causal_lm

    return load_causal_lm(str(demo_model_dir()), "float32", "sdpa", "cpu")


@pytest.fixture(scope="module")
def slot(model):
    from areal_fast.sync.shared_memory import SharedWeightBuffer

    with torch.no_grad():  # new weights the engine can tell apart from the checkpoint's
        for p in model.parameters():
            p.mul_(1.01)
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    buffer = SharedWeightBuffer.create(iter(weights))
    buffer.write(iter(weights))
    yield buffer
    buffer.close()


@pytest.fixture(scope="module")
def engine():
    from areal_fast.models.loading import demo_model_dir
    from areal_fast.rollout.config import VLLMConfig
    from areal_fast.rollout.vllm_async import AsyncVLLMEngine

    config = VLLMConfig(dtype="float32", max_model_len=1024)
    eng = AsyncVLLMEngine(str(demo_model_dir()), config, max_running=64)
    eng.start()
    yield eng
    eng.close()


def test_many_seeded_requests_with_long_prompts_all_finish(engine):
    """More prompt tokens than a step's budget, every request with its own seed: vLLM's CPU
    worker kills its engine core on a partial prefill of a seeded request, so the engine
    runs with chunked prefill off on a CPU (cpu_scheduling). 16 prompts of 300-315 tokens
    that share no prefix (a shared one would come from the prefix cache, not the budget):
    4,920 tokens against cpu_scheduling's 2,048. With chunked prefill on, the engine core
    dies here ("CPU Generator does not use offset")."""
    requests = [
        GenRequest(i, list(range(1000 * (i + 1), 1000 * (i + 1) + 300 + i)), 24, 0.7, 1.0, seed=i)
        for i in range(16)
    ]
    assert sum(len(r.input_ids) for r in requests) > 2 * 2048
    engine.submit(requests)
    outs = _collect(engine, 16)
    assert all(len(o.output_ids) == len(o.logprobs) == len(o.versions) > 0 for o in outs.values())
    assert {v for o in outs.values() for v in o.versions} == {0}


def test_abort_pause_update_and_keep_pause(engine, model, slot):
    engine.pause_mode = "abort"
    engine.submit([GenRequest(1000 + i, PROMPT, 200, 0.7, 1.0, seed=i) for i in range(4)])
    time.sleep(2.0)
    engine.pause(60.0)
    aborted = _collect(engine, 4)
    assert all(o.stop_reason == "abort" and len(o.output_ids) < 200 for o in aborted.values())
    engine.update_weights_from_buffer(slot.spec, 1)
    engine.resume()
    engine.submit([GenRequest(2000, PROMPT, 16, 0.8, 1.0, seed=5)])
    fresh = _collect(engine, 1)[2000]
    assert fresh.versions == [1] * len(fresh.output_ids)
    # the behaviour log-probs are the new weights' at the temperature (fp32)
    ids = torch.tensor([PROMPT + fresh.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double() / 0.8
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(fresh.output_ids)[:, None])[:, 0]
    got = torch.tensor(fresh.logprobs, dtype=torch.float64)
    assert (want - got).abs().mean().item() < 1e-4

    engine.pause_mode = "keep"
    engine.submit([GenRequest(3000 + i, PROMPT, 150, 0.7, 1.0, seed=i) for i in range(2)])
    time.sleep(2.0)
    engine.pause(60.0)
    assert engine.get_outputs(0.5) == []  # frozen inside the engine, not aborted
    engine.update_weights_from_buffer(slot.spec, 2)
    engine.resume()
    for o in _collect(engine, 2).values():
        assert o.stop_reason == "length" and len(o.output_ids) == 150
        seam = o.versions.index(2)
        assert 0 < seam < 150 and o.versions == [1] * seam + [2] * (150 - seam)
