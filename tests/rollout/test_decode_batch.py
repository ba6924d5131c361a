"""Continuous batching (DecodeBatch, KVSlots) against the model's own forward and the static engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_hf_engine import _collect, _hook_forward  # noqa: E402 - beside this file

from areal_fast.rollout.decode_batch import DecodeBatch, Sequence, sample_rows
from areal_fast.rollout.engine import GenRequest, SamplingParams, sample_seed
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.rollout.kv_slots import KVSlots


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _model(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()


def _random_prompts(vocab: int, lengths: list[int], gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_step_logits_equal_the_full_forward_in_float64(tiny_model_dir):
    """Sequences joining at different steps, two sharing a prompt: every sampled row's
    log-probs equal a plain forward over the whole sequence (float64, 1e-10)."""
    model = _model(tiny_model_dir, torch.float64)
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    prompts = _random_prompts(model.config.vocab_size, [5, 11, 3, 11], gen)
    prompts[3] = list(prompts[1])  # prefilled once, copied to the other slot
    budgets = [3, 6, 6, 6]
    seqs = [Sequence(i, p, budgets[i], 1.0, 1.0, seed=i + 7) for i, p in enumerate(prompts)]
    batch = DecodeBatch(model, 3, eos_id=None)
    batch.add([seqs[0], seqs[1], seqs[3]])  # 1 and 3: one prefill, copied
    steps = 0
    while batch.running or batch.pending:
        if batch.free and seqs[2].slot < 0:
            batch.add([seqs[2]])  # joins the running batch when sequence 0 has left
        batch.step(0)
        steps += 1
    assert steps == 3 + 6  # sequence 2 started right after sequence 0 ended
    assert batch.cache_bytes > 0  # ended sequences' slots keep their tokens until needed
    batch.abort()
    assert batch.cache_bytes == 0
    for seq in seqs:
        assert seq.stop_reason == "length" and len(seq.tokens) == seq.budget
        ids = torch.tensor([seq.input_ids + seq.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(seq.input_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.tokens)[:, None])
        assert torch.allclose(torch.tensor(seq.logprobs, dtype=torch.float64), expected[:, 0],
                              rtol=0, atol=1e-10)  # fmt: skip
    assert model.config._attn_implementation != "areal_slots"  # restored after each step


def _assert_matches_full_forward(model, seq, atol=1e-10):
    ids = torch.tensor([seq.input_ids + seq.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(seq.input_ids) - 1 : -1]
    expected = torch.log_softmax(logits / (seq.temperature or 1.0), -1)
    expected = expected.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0]
    got = torch.tensor(seq.logprobs, dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=0, atol=atol), (seq.key, got - expected)


def test_shared_prefixes_and_kept_slots_equal_the_full_forward(tiny_model_dir):
    """Prefixes computed once (shared within a step, or kept in a finished sequence's slot
    and continued by a later one) give the log-probs of a plain forward (float64)."""
    from areal_fast.rollout.decode_batch import PREFIX_MIN

    model = _model(tiny_model_dir, torch.float64)
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    vocab = model.config.vocab_size
    base = _random_prompts(vocab, [PREFIX_MIN + 5], gen)[0]
    tails = _random_prompts(vocab, [4, 7, 1], gen)
    # 5 repeats 1, which itself copied its prefix from 0: it samples from 1's logits
    prompts = [base, base + tails[0], base + tails[1], base[: PREFIX_MIN + 2], base + tails[2]]
    prompts.append(list(prompts[1]))
    seqs = [Sequence(i, p, 5, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]
    batch = DecodeBatch(model, 7, eos_id=None)
    batch.add(seqs)
    assert all(s.past == 0 for s in seqs)
    batch.step(0)
    whole = PREFIX_MIN + 5
    assert [s.past for s in seqs] == [0, whole, whole, PREFIX_MIN + 1, whole, 0]
    assert seqs[5].tokens != seqs[1].tokens  # same logits, its own seed
    while batch.running:
        batch.step(0)
    # an agent's next call: the whole first exchange plus new tokens
    first = seqs[2]
    follow = Sequence(9, first.input_ids + first.tokens + tails[0], 5, 0.7, 1.0, seed=9)
    batch.add([follow])
    assert follow.slot == first.slot and follow.past == len(first.input_ids) + 4
    batch.step(0)
    while batch.running:
        batch.step(0)
    for seq in seqs + [follow]:
        _assert_matches_full_forward(model, seq)
    # new weights: nothing kept is reused
    again = Sequence(10, follow.input_ids + follow.tokens, 3, 1.0, 1.0, seed=10)
    batch.add([again])
    assert again.past > 0
    batch.step(1)
    assert again.past == 0
    while batch.running:
        batch.step(1)
    _assert_matches_full_forward(model, again)


def test_steps_padded_to_sixteen_rows_equal_the_full_forward(tiny_model_dir):
    """Steps of 6 to 15 tokens run padded (scratch slot, repeated output rows): the
    sequences' log-probs are a plain forward's (float64)."""
    from areal_fast.rollout.decode_batch import PAD_ROWS

    model = _model(tiny_model_dir, torch.float64)
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    rows = PAD_ROWS[0] + 1
    prompts = _random_prompts(model.config.vocab_size, [1] * rows, gen)
    seqs = [Sequence(i, p, 4, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]
    batch = DecodeBatch(model, rows, eos_id=None)
    batch.add(seqs)
    while batch.running or batch.pending:
        batch.step(0)
    for seq in seqs:
        _assert_matches_full_forward(model, seq)


def test_few_sequences_over_many_slots_equal_the_full_forward(tiny_model_dir):
    """Two sequences left in slots 0 and 5 of 8 decode through copies of their slots
    (``decode_gather``), and their log-probs are a plain forward's (float64)."""
    model = _model(tiny_model_dir, torch.float64)
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    prompts = _random_prompts(model.config.vocab_size, [3, 4, 2, 5, 3, 9, 2, 4], gen)
    budgets = [6, 1, 1, 1, 1, 7, 1, 1]
    seqs = [Sequence(i, p, budgets[i], 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]
    batch = DecodeBatch(model, 8, eos_id=None)
    batch.add(seqs)
    batch.step(0)
    assert sorted(s.slot for s in batch.running) == [0, 5]
    plans = []
    forward = batch._forward
    batch._forward = lambda ids, plan, keep: plans.append(plan) or forward(ids, plan, keep)
    while batch.running:
        batch.step(0)
    assert plans[0].decode_gather and plans[0].decode_mask.shape[0] == 2
    for seq in seqs:
        _assert_matches_full_forward(model, seq)


def test_kv_slots_grow_and_copy_keep_the_cached_tokens():
    cache = KVSlots(2, 3, 2, 4, torch.float64, torch.device("cpu"), capacity=4)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn_like(buf))
    before = [b.clone() for b in cache.keys + cache.values]
    cache.reserve(5)
    assert cache.capacity == 8 and cache.keys[0].shape == (3, 2, 8, 4)
    for old, new in zip(before, cache.keys + cache.values):
        assert torch.equal(new[:, :, :4], old) and not new[:, :, 4:].any()
    cache.copy_slot(0, 2, 3)
    assert torch.equal(cache.values[1][2, :, :3], cache.values[1][0, :, :3])
    assert cache.nbytes == 2 * 2 * 3 * 2 * 8 * 4 * 8
    with pytest.raises(ValueError, match="slots"):
        KVSlots(1, 0, 1, 1, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_engine_outputs_equal_the_static_engine(tiny_model_dir, tokenizer, temperature, top_p):
    """Seeded and greedy outputs of the batch API, with more samples than slots."""
    prompts = [tokenizer.encode(t) for t in ("Hi", "What is 12 + 30?", "x = 7 * 6;", "abc")]
    params = SamplingParams(n=3, temperature=temperature, top_p=top_p, max_new_tokens=10)
    seeds = [5, 6, 7, 8]
    ref = HFEngine(_model(tiny_model_dir), tokenizer, 4, "static").generate(prompts, params, seeds)
    out = HFEngine(_model(tiny_model_dir), tokenizer, 5).generate(prompts, params, seeds)
    assert [t.group_id for t in out] == [t.group_id for t in ref]
    for a, b in zip(out, ref):
        assert a.completion_ids == b.completion_ids and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_mixed_sampling_settings_share_a_batch(tiny_model_dir, tokenizer):
    """Rows of different temperatures and top-p in one step draw as they would alone."""
    model = _model(tiny_model_dir)
    prompt = tokenizer.encode("The answer is")
    settings = [(0.0, 1.0, None), (0.5, 1.0, 3), (1.0, 0.9, 4), (1.3, 1.0, 5)]
    batch = DecodeBatch(model, 4, tokenizer.eos_token_id)
    seqs = [Sequence(i, prompt, 5, t, p, s) for i, (t, p, s) in enumerate(settings)]
    batch.add(seqs)
    steps = 0
    while batch.running or batch.pending:
        batch.step(0)
        steps += 1
    assert steps <= 5
    for seq, (t, p, s) in zip(seqs, settings):
        solo = Sequence(0, prompt, 5, t, p, s)
        single = DecodeBatch(model, 1, tokenizer.eos_token_id)
        single.add([solo])
        while single.running or single.pending:
            single.step(0)
        assert seq.tokens == solo.tokens
        assert max(abs(a - b) for a, b in zip(seq.logprobs, solo.logprobs)) <= 1e-5


def test_sample_rows_logprob_is_the_tempered_log_softmax():
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    logits = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    seqs = [Sequence(0, [1], 4, 0.0), Sequence(1, [1], 4, 0.6, 1.0, 9), Sequence(2, [1], 4, 2.0)]
    tokens, logprobs = sample_rows(logits, seqs)
    assert tokens[0] == int(logits[0].argmax())
    for row, temp in ((0, 1.0), (1, 0.6), (2, 2.0)):
        expected = torch.log_softmax(logits[row].float() / temp, -1)[tokens[row]]
        assert abs(logprobs[row] - float(expected)) < 1e-6


def test_request_submitted_mid_batch_starts_before_the_batch_ends(tiny_model_dir, tokenizer):
    engine = HFEngine(_model(tiny_model_dir), tokenizer, 4)
    _hook_forward(engine.model, lambda n: time.sleep(0.01))
    prompt = tokenizer.encode("Once upon a time")
    seeds = [sample_seed(s, 0) for s in range(3)]
    engine.start()
    try:
        engine.submit([GenRequest(i, prompt, 60, 0.0, 1.0, seeds[i]) for i in range(2)])
        time.sleep(0.1)  # the two are decoding
        engine.submit([GenRequest(9, tokenizer.encode("Hi"), 3, 0.0)])
        outs = _collect(engine, 3, timeout=30.0)
    finally:
        engine.close()
    late = outs[9]
    long_done = [outs[i] for i in range(2) if len(outs[i].output_ids) >= 20]
    assert long_done, "the long requests ended early; the test needs one that runs on"
    assert late.first_token_time < min(o.first_token_time for o in long_done) + 0.6 * 60 * 0.01
    assert all(late.first_token_time > o.first_token_time for o in outs.values() if o is not late)


def test_pause_update_resume_mid_batch_keeps_versions_and_counts(tiny_model_dir, tokenizer):
    """Requests aborted mid-batch and resubmitted with their partial tokens: every token
    is accounted once, versions never go down, and the result equals an uninterrupted run."""
    engine = HFEngine(_model(tiny_model_dir), tokenizer, 3)
    prompts = [tokenizer.encode(t) for t in ("a b c", "Count: 1, 2", "x", "Hello there", "7")]
    budget = 24
    seeds = [sample_seed(40 + i, 0) for i in range(len(prompts))]
    reference = {
        o.rid: o
        for o in _run_all(
            engine, [GenRequest(i, p, budget, 1.0, 1.0, seeds[i]) for i, p in enumerate(prompts)]
        )  # fmt: skip
    }
    _hook_forward(engine.model, lambda n: time.sleep(0.005))
    engine.start()
    got = {i: ([], [], []) for i in range(len(prompts))}
    pending = [GenRequest(i, p, budget, 1.0, 1.0, seeds[i]) for i, p in enumerate(prompts)]
    engine.submit(pending)
    version, rid = 0, 100
    rids = {i: i for i in range(len(prompts))}
    finished = set()
    try:
        while len(finished) < len(prompts):
            time.sleep(0.03)
            engine.pause(10)
            version += 1
            named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
            engine.update_weights(named, version)
            resubmit = []
            for out in engine.get_outputs(0):
                i = next(k for k, r in rids.items() if r == out.rid)
                toks, lps, vers = got[i]
                toks += out.output_ids
                lps += out.logprobs
                vers += out.versions
                if out.stop_reason == "abort":
                    rid += 1
                    rids[i] = rid
                    resubmit.append(GenRequest(rid, prompts[i] + toks, budget - len(toks), 1.0,
                                               1.0, seeds[i], offset=len(toks)))  # fmt: skip
                else:
                    finished.add(i)
            engine.resume()
            engine.submit(resubmit, front=True)
    finally:
        engine.close()
    for i, (toks, lps, vers) in got.items():
        ref = reference[i]
        assert toks == ref.output_ids  # nothing lost, nothing twice
        assert max(abs(a - b) for a, b in zip(lps, ref.logprobs)) <= 1e-5
        assert vers == sorted(vers) and len(vers) == len(toks)
    assert max(max(v) for _, _, v in got.values()) >= 1  # some tokens came after an update


def _run_all(engine, requests):
    engine.start()
    try:
        engine.submit(requests)
        return list(_collect(engine, len(requests), timeout=30.0).values())
    finally:
        engine.close()


def test_cache_memory_is_bounded_by_max_batch_size_sequences(tiny_model_dir, tokenizer):
    """max_batch_size requests of the maximum length: the cache holds at most that many
    sequences of that length (capacity rounded to 64 tokens) plus one scratch slot, and is
    freed by an abort."""
    model = _model(tiny_model_dir)
    cfg = model.config
    slots, prompt_len, budget = 3, 40, 30
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
    per_token *= cfg.hidden_size // cfg.num_attention_heads * 4
    batch = DecodeBatch(model, slots, eos_id=None)
    gen = torch.Generator().manual_seed(0)
    prompts = _random_prompts(cfg.vocab_size, [prompt_len] * (2 * slots), gen)
    waiting = [Sequence(i, p, budget, 1.0, 1.0, i) for i, p in enumerate(prompts)]
    peak = 0
    while waiting or batch.running or batch.pending:
        take = min(batch.free, len(waiting))
        batch.add(waiting[:take])
        waiting = waiting[take:]
        batch.step(0)
        peak = max(peak, batch.cache_bytes)
    longest = -(-(prompt_len + budget) // 64) * 64
    assert 0 < peak <= (slots + 1) * longest * per_token
    batch.abort()  # what a pause does
    assert batch.cache_bytes == 0


def test_batch_api_and_engine_thread_take_turns(tiny_model_dir, tokenizer):
    """The batch API runs while the engine thread serves requests; both finish."""
    engine = HFEngine(_model(tiny_model_dir), tokenizer, 4)
    engine.start()
    prompt = tokenizer.encode("hello")
    try:
        engine.submit([GenRequest(i, prompt, 8, 0.7, 1.0, i) for i in range(6)])
        box = {}
        thread = threading.Thread(
            target=lambda: box.update(out=engine.generate([prompt], SamplingParams(n=2)))
        )
        thread.start()
        outs = _collect(engine, 6, timeout=30.0)
        thread.join(30)
    finally:
        engine.close()
    assert len(outs) == 6 and len(box["out"]) == 2


def test_models_the_slot_attention_cannot_run_are_refused(tiny_model_dir, tokenizer):
    model = _model(tiny_model_dir)
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="hf_batching=static"):
        HFEngine(model, tokenizer, 2)
    HFEngine(model, tokenizer, 2, "static")  # the static engine runs it


def test_a_mistral_window_is_refused_at_start(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    assert config.sliding_window  # its default
    with pytest.raises(ValueError, match="sliding-window"):
        HFEngine(MistralForCausalLM(config), tokenizer, 2)
    config.sliding_window = None
    HFEngine(MistralForCausalLM(config), tokenizer, 2)
