"""Seeded sampling and the request-level (pause / update / resume) API of HFEngine."""

from __future__ import annotations

import functools
import math
import threading
import time

import pytest
import torch

from areal_fast.rollout.config import HF_BATCHING
from areal_fast.rollout.engine import GenRequest, SamplingParams, sample_seed, seeded_uniform
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.rollout.sampling import SeededSampler

# ---------------------------------------------------------------- SeededSampler alone


def _reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """float64 sampling distribution: tempered softmax, then the HF-convention nucleus."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
        kept, mass = [], 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i].item()
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[kept] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def _draw(
    logits: torch.Tensor, seeds: list[int], temperature: float, top_p: float, offset: int = 0
) -> torch.Tensor:
    """One token per seed from the same logits row, through the processor interface."""
    rows = len(seeds)
    sampler = SeededSampler(
        seeds, [offset] * rows, start_len=3, temperature=temperature, top_p=top_p
    )
    scores = logits.float().expand(rows, -1).clone()
    out = sampler(torch.zeros(rows, 3, dtype=torch.long), scores)
    assert out.dtype == torch.float32 and out.shape == scores.shape
    assert torch.equal((out == 0).sum(-1), torch.ones(rows, dtype=torch.long))
    assert bool(torch.isinf(out).sum(-1).eq(logits.numel() - 1).all())
    return out.argmax(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.7), (1.3, 0.7)])
def test_sampler_frequencies_match_reference(temperature, top_p):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, generator=gen, dtype=torch.float64) * 1.5
    logits[[2, 9]] = float("-inf")
    n = 40_000
    tokens = _draw(logits, list(range(1000, 1000 + n)), temperature, top_p)
    freq = torch.bincount(tokens, minlength=12).double() / n
    ref = _reference_probs(logits, temperature, top_p)
    assert freq[2] == 0 and freq[9] == 0  # -inf logits never chosen
    assert bool((freq[ref == 0] == 0).all())  # outside the nucleus never chosen
    tol = 5 * torch.sqrt(ref * (1 - ref) / n) + 1e-12
    assert bool(((freq - ref).abs() <= tol).all()), (freq, ref)
    if top_p < 1:
        # The nucleus is the one transformers' TopPLogitsWarper keeps.
        from transformers import TopPLogitsWarper

        hf = TopPLogitsWarper(top_p)(None, (logits / temperature)[None].float())[0]
        assert torch.equal(torch.isfinite(hf), ref > 0)
        assert 1 <= int((ref > 0).sum()) < 10


def test_sampler_is_inverse_cdf_of_seeded_uniform():
    logits = torch.tensor([0.3, float("-inf"), 1.2, -0.5, 0.0, 2.0], dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    seeds = [sample_seed(5, i) for i in range(200)]
    tokens = _draw(logits, seeds, 1.0, 1.0, offset=4)
    cdf = probs.cumsum(0)
    for seed, token in zip(seeds, tokens.tolist()):
        u = seeded_uniform(seed, 4)
        assert token == int((cdf <= u * cdf[-1]).sum())


def test_sampler_draw_ignores_batch_neighbours():
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(50, generator=gen)
    seed = sample_seed(123, 2)
    # Batch A: the row is third of four, completion position 1 + (7 - 5) = 3.
    others = torch.randn(4, 50, generator=gen)
    others[2] = row
    a = SeededSampler([11, 12, seed, 13], [0, 9, 1, 4], start_len=5, temperature=0.9, top_p=0.8)(
        torch.zeros(4, 7, dtype=torch.long), others
    )
    # Batch B: alone, another width, position 3 + (2 - 2) = 3.
    b = SeededSampler([seed], [3], start_len=2, temperature=0.9, top_p=0.8)(
        torch.zeros(1, 2, dtype=torch.long), row[None].clone()
    )
    assert a[2].argmax() == b[0].argmax()
    assert torch.equal(a[2], b[0])
    # Another position of the same seed is an independent draw: over 200 positions the
    # tokens are not all equal.
    draws = {
        int(
            SeededSampler([seed], [p], 2, 0.9, 0.8)(
                torch.zeros(1, 2, dtype=torch.long), row[None].clone()
            ).argmax()
        )
        for p in range(200)
    }
    assert len(draws) > 1


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="offsets"):
        SeededSampler([1, 2], [0], 3)
    with pytest.raises(ValueError, match="temperature"):
        SeededSampler([1], [0], 3, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SeededSampler([1], [0], 3, top_p=1.5)
    with pytest.raises(ValueError, match="start_len"):
        SeededSampler([1], [0], 3)(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 4))


# ------------------------------------------------------------------ engine fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(params=HF_BATCHING)
def make_engine(request, tiny_model_dir, tokenizer):
    """Factory of fresh engines over the tiny model, once per batching mode (a test that is
    about one mode says so with indirect parametrisation); every engine is closed afterwards."""
    from transformers import AutoModelForCausalLM

    engines = []

    def make(max_batch_size: int = 8) -> HFEngine:
        engine = HFEngine(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            tokenizer,
            max_batch_size,
            request.param,
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def _hook_forward(model, before_call):
    """Replace ``model.forward`` so that ``before_call(n)`` runs before its n-th call."""
    original = model.forward
    calls = [0]

    @functools.wraps(original)
    def forward(*args, **kwargs):
        calls[0] += 1
        before_call(calls[0])
        return original(*args, **kwargs)

    model.forward = forward
    return calls


def _collect(engine: HFEngine, count: int, timeout: float = 20.0) -> dict:
    """Outputs by rid until ``count`` arrived."""
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {count} outputs arrived"
        out.update((o.rid, o) for o in engine.get_outputs(left))
    return out


def _eos_free_seed(
    engine: HFEngine, prompt: list[int], budget: int, temperature=1.0, top_p=1.0
) -> int:
    """A group seed whose sample 0 runs its whole budget without end-of-sequence."""
    params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=budget)
    for seed in range(100):
        if engine.generate([prompt], params, seeds=[seed])[0].stop_reason == "length":
            return seed
    raise AssertionError("no seed without end-of-sequence found")


# ------------------------------------------------------------ batch API, seeded


def test_generate_with_seeds_is_batch_invariant(make_engine, tokenizer):
    engine = make_engine(max_batch_size=3)
    prompts = [tokenizer.encode(t) for t in ("Hi", "What is 12 + 30?", "x = 7 * 6;")]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=12)
    together = engine.generate(prompts, params, seeds=[10, 11, 12])
    alone = engine.generate(prompts[1:2], params, seeds=[11])
    assert [t.group_id for t in together] == [0, 0, 1, 1, 2, 2]
    for a, b in zip(together[2:4], alone):
        assert a.completion_ids == b.completion_ids and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    # Samples within a group differ, as do other seeds.
    assert together[2].completion_ids != together[3].completion_ids
    other = engine.generate(prompts[1:2], params, seeds=[99])
    assert other[0].completion_ids != alone[0].completion_ids
    # Behaviour log-probs are log_softmax(logits / T) of the chosen tokens.
    traj = alone[0]
    ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(traj.prompt_ids) - 1 : -1]
    recomputed = torch.log_softmax(logits.float() / 0.8, -1).gather(
        1, torch.tensor(traj.completion_ids)[:, None]
    )[:, 0]
    assert torch.allclose(recomputed, torch.tensor(traj.logprobs), atol=1e-4)
    # Greedy ignores seeds; unseeded sampling still works.
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    assert (
        engine.generate(prompts, greedy, seeds=[1, 2, 3])[1].completion_ids
        == engine.generate(prompts, greedy)[1].completion_ids
    )
    assert len(engine.generate(prompts, params)) == 6
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, params, seeds=[1])


# ------------------------------------------------------------ request-level API


def test_pause_mid_generation_then_resume_continues_the_same_sample(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Count: 1, 2, 3")
    budget, cut = 20, 6
    seed = sample_seed(_eos_free_seed(engine, prompt, budget), 0)
    engine.start()
    engine.submit([GenRequest(0, prompt, budget, 1.0, 1.0, seed, 0)])
    full = _collect(engine, 1)[0]
    assert full.stop_reason == "length" and len(full.output_ids) == budget
    assert full.versions == [0] * budget

    # The cut-th forward call waits until pause() has raised the abort flag, so exactly
    # `cut` tokens are generated before the stop.
    reached = threading.Event()

    def before_call(n):
        if n == cut:
            reached.set()
            assert engine._abort.wait(5)

    calls = _hook_forward(engine.model, before_call)
    engine.submit([GenRequest(1, prompt, budget, 1.0, 1.0, seed, 0)])
    assert reached.wait(10)
    engine.pause(10)
    first = engine.get_outputs(0)[0]  # pause returns once the aborted output is posted
    assert first.rid == 1 and first.stop_reason == "abort"
    assert first.output_ids == full.output_ids[:cut] and first.versions == [0] * cut
    assert calls[0] == cut

    engine.update_weights(
        [(n, p.detach().clone()) for n, p in engine.model.named_parameters()], version=1
    )
    engine.resume()
    engine.submit(
        [GenRequest(2, prompt + first.output_ids, budget - cut, 1.0, 1.0, seed, offset=cut)]
    )
    second = _collect(engine, 1)[2]
    assert second.stop_reason == "length"
    assert first.output_ids + second.output_ids == full.output_ids
    logprobs = first.logprobs + second.logprobs
    assert max(abs(a - b) for a, b in zip(logprobs, full.logprobs)) <= 1e-5
    assert first.versions + second.versions == [0] * cut + [1] * (budget - cut)


def test_budget_split_resubmission_matches_one_request(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("abc")
    seed = sample_seed(_eos_free_seed(engine, prompt, 15, 0.7, 0.8), 0)
    engine.start()
    engine.submit([GenRequest(0, prompt, 15, 0.7, 0.8, seed)])
    full = _collect(engine, 1)[0]
    engine.submit([GenRequest(1, prompt, 4, 0.7, 0.8, seed)])
    head = _collect(engine, 1)[1]
    engine.submit([GenRequest(2, prompt + head.output_ids, 11, 0.7, 0.8, seed, offset=4)])
    tail = _collect(engine, 1)[2]
    assert (head.stop_reason, tail.stop_reason) == ("length", "length")
    assert head.output_ids + tail.output_ids == full.output_ids
    assert max(abs(a - b) for a, b in zip(head.logprobs + tail.logprobs, full.logprobs)) <= 1e-5


def test_pause_aborts_a_long_running_generate(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Once upon a time")
    budget = 200
    # No end-of-sequence within the first 40 tokens, and >= 10 ms per decoding step from
    # the third on: the pause below lands long before the sample could stop by itself.
    seed = sample_seed(_eos_free_seed(engine, prompt, 40), 0)
    started = threading.Event()

    def before_call(n):
        if n >= 3:
            started.set()
            time.sleep(0.01)

    _hook_forward(engine.model, before_call)
    engine.start()
    engine.submit([GenRequest(7, prompt, budget, 1.0, 1.0, seed)])
    assert started.wait(10)
    t0 = time.monotonic()
    engine.pause(10)
    assert time.monotonic() - t0 < 5
    (out,) = engine.get_outputs(0)
    assert out.rid == 7 and out.stop_reason == "abort"
    assert 3 <= len(out.output_ids) < budget
    assert len(out.logprobs) == len(out.versions) == len(out.output_ids)
    assert all(math.isfinite(x) and x <= 0 for x in out.logprobs)


@pytest.mark.parametrize("make_engine", ["static"], indirect=True)
def test_per_request_budgets_in_one_batch(make_engine, tokenizer):
    engine = make_engine()
    prompts = [tokenizer.encode(t) for t in ("a", "bb + cc", "The answer is")]
    budgets = [3, 9, 17]
    sizes = []
    generate = engine.model.generate

    def counting_generate(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    engine.model.generate = counting_generate
    refs = [
        engine.generate([p], SamplingParams(n=1, max_new_tokens=b), seeds=[40 + i])[0]
        for i, (p, b) in enumerate(zip(prompts, budgets))
    ]
    sizes.clear()
    engine.submit(
        [
            GenRequest(i, p, b, seed=sample_seed(40 + i, 0))
            for i, (p, b) in enumerate(zip(prompts, budgets))
        ]
    )
    engine.start()
    outs = _collect(engine, 3)
    assert sizes == [3]  # one batch
    for i, (ref, budget) in enumerate(zip(refs, budgets)):
        out = outs[i]
        assert out.output_ids == ref.completion_ids and out.stop_reason == ref.stop_reason
        if out.stop_reason == "length":
            assert len(out.output_ids) == budget
        else:
            assert out.stop_reason == "stop" and out.output_ids[-1] == tokenizer.eos_token_id
            assert len(out.output_ids) <= budget
        assert len(out.logprobs) == len(out.versions) == len(out.output_ids)


@pytest.mark.parametrize("make_engine", ["static"], indirect=True)
def test_batches_group_requests_by_sampling_settings(make_engine, tokenizer):
    engine = make_engine(max_batch_size=2)
    seen = []
    generate = engine.model.generate

    def recording_generate(*args, **kwargs):
        sampler = kwargs["logits_processor"][0]
        seen.append((kwargs["input_ids"].shape[0], sampler.temperature, sampler.top_p))
        return generate(*args, **kwargs)

    engine.model.generate = recording_generate
    prompt = tokenizer.encode("hi")
    settings = [(1.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 0.9)]
    engine.submit([GenRequest(i, prompt, 2, t, p, seed=i) for i, (t, p) in enumerate(settings)])
    engine.start()
    assert sorted(_collect(engine, 5)) == [0, 1, 2, 3, 4]
    assert seen == [(2, 1.0, 1.0), (1, 0.5, 1.0), (1, 1.0, 1.0), (1, 1.0, 0.9)]


def test_paused_engine_keeps_requests_queued(make_engine, tokenizer):
    engine = make_engine()
    engine.start()
    engine.pause(5)
    engine.submit([GenRequest(3, tokenizer.encode("hello"), 4, 0.0)])
    assert engine.get_outputs(0.3) == []
    engine.resume()
    out = _collect(engine, 1)[3]
    assert 1 <= len(out.output_ids) <= 4 and out.versions == [0] * len(out.output_ids)


def test_pause_timeout_names_the_engine(make_engine, tokenizer):
    engine = make_engine()
    started = threading.Event()

    def slow(n):
        started.set()
        time.sleep(0.4)

    _hook_forward(engine.model, slow)
    engine.start()
    engine.submit([GenRequest(0, tokenizer.encode("slow"), 50)])
    assert started.wait(10)
    with pytest.raises(TimeoutError, match="HFEngine"):
        engine.pause(0.05)
    with pytest.raises(RuntimeError, match="pause"):  # still generating
        engine.update_weights(list(engine.model.named_parameters()), version=1)
    engine.pause(10)
    (out,) = engine.get_outputs(0)
    assert out.stop_reason == "abort" and 1 <= len(out.output_ids) < 50


def test_update_weights_requires_pause_while_running(make_engine, tokenizer):
    engine = make_engine()
    named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    engine.update_weights(named, version=1)  # no engine thread: allowed
    engine.start()
    with pytest.raises(RuntimeError, match="pause"):
        engine.update_weights(named, version=2)
    assert engine.version == 1
    engine.pause(5)
    engine.update_weights(named, version=2)
    engine.resume()
    engine.submit([GenRequest(0, tokenizer.encode("v"), 3, 0.0)])
    out = _collect(engine, 1)[0]
    assert out.versions == [2] * len(out.output_ids)


def test_engine_thread_exception_surfaces(make_engine, tokenizer):
    engine = make_engine()

    def boom(n):
        raise ValueError("boom in forward")

    _hook_forward(engine.model, boom)
    engine.start()
    engine.submit([GenRequest(0, tokenizer.encode("x"), 3)])
    with pytest.raises(ValueError, match="boom in forward"):
        engine.get_outputs(10)
    with pytest.raises(ValueError, match="boom in forward"):
        engine.pause(1)
    engine.close()


def test_submit_validates_requests(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match=r"requests\[1\].input_ids"):
        engine.submit([GenRequest(0, [5], 2), GenRequest(1, [], 2)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([GenRequest(0, [5], 0)])
    with pytest.raises(ValueError, match="top_p"):
        engine.submit([GenRequest(0, [5], 2, top_p=0.0)])
    with pytest.raises(ValueError, match="offset"):
        engine.submit([GenRequest(0, [5], 2, offset=-1)])
    with pytest.raises(ValueError, match="timeout"):
        engine.get_outputs(-1)
    engine.start()
    with pytest.raises(RuntimeError, match="already running"):
        engine.start()
