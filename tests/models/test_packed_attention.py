"""Packed-sequence forward through HF models: equal to per-sequence unpadded log-probs."""

import inspect

import pytest
import torch

from areal_fast.models.loading import load_causal_lm, load_tokenizer
from areal_fast.models.packed_attention import PACKED_ATTENTION, register_packed_attention
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.rollout.engine import SamplingParams
from areal_fast.rollout.hf_engine import HFEngine
from areal_fast.train.torch_engine import packed_forward_logprobs


def _random_batch(vocab, lengths, prompt_len=3):
    trajs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,)).tolist()
        p = min(prompt_len, n - 1) if n > 1 else 1
        trajs.append(Trajectory(ids[:p], ids[p:], [0.0] * (n - p), [0] * (n - p), "stop", i))
    return pack_trajectories(trajs, torch.zeros(len(trajs)))


def _unpadded_reference(model, batch, temperature=1.0):
    """Each sequence alone (no packing, no mask), sdpa attention, float64 log-softmax."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return _unpadded(model, batch, temperature)
    finally:
        model.set_attn_implementation(impl)


def _unpadded(model, batch, temperature):
    out = []
    bounds = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for s in range(batch.num_seqs):
            ids = batch.input_ids[bounds[s] : bounds[s + 1]]
            logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
            logp = torch.log_softmax(logits / temperature, -1)
            labels = batch.labels[bounds[s] : bounds[s + 1]]
            picked = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
            out.append(torch.where(labels == -100, 0.0, picked))
    return torch.cat(out)


def _max_error(model, lengths, temperature=1.0):
    vocab = model.config.vocab_size
    batch = _random_batch(vocab, lengths)
    with torch.no_grad():
        packed, _ = packed_forward_logprobs(model, batch, temperature, with_entropy=False)
    return (packed.double() - _unpadded_reference(model, batch, temperature)).abs().max().item()


def load_with_attention(path, attn):
    """Load a model with a transformers attention backend or the packed attention."""
    if attn == PACKED_ATTENTION:
        model = load_causal_lm(str(path))
        model.set_attn_implementation(register_packed_attention())
        return model
    return load_causal_lm(str(path), attn_implementation=attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager", PACKED_ATTENTION])
def test_packed_equals_unpadded_tiny(tiny_model_dir, attn, fresh_seed):
    model = load_with_attention(tiny_model_dir, attn)
    assert _max_error(model, [7, 1, 19, 4, 12], temperature=0.7) <= 1e-4


@pytest.mark.parametrize("attn", ["sdpa", PACKED_ATTENTION])
def test_packed_equals_unpadded_qwen2(tiny_qwen_dir, attn, fresh_seed):
    model = load_with_attention(tiny_qwen_dir, attn)
    assert _max_error(model, [5, 11, 2]) <= 1e-4


def test_packed_attention_needs_boundaries(tiny_model_dir):
    model = load_with_attention(tiny_model_dir, PACKED_ATTENTION)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_a_kv_cache_breaks_packing(tiny_model_dir, fresh_seed):
    """Guard: with a cache object, later sequences attend to earlier ones (wrong)."""
    from transformers import DynamicCache

    model = load_causal_lm(str(tiny_model_dir))
    batch = _random_batch(model.config.vocab_size, [9, 9, 9])
    with torch.no_grad():
        hidden_ok = model.get_decoder()(
            input_ids=batch.input_ids[None],
            position_ids=batch.position_ids[None],
            attention_mask=None,
            use_cache=False,
        ).last_hidden_state
        decoder = model.get_decoder()
        cache_key = (
            "cache"
            if "cache" in inspect.signature(decoder.forward).parameters
            else "past_key_values"
        )  # renamed in recent transformers
        hidden_bad = decoder(
            input_ids=batch.input_ids[None],
            position_ids=batch.position_ids[None],
            use_cache=True,
            **{cache_key: DynamicCache()},
        ).last_hidden_state
    first = slice(0, 9)  # the first sequence is unaffected either way
    assert torch.allclose(hidden_ok[0, first], hidden_bad[0, first], atol=1e-5)
    assert (hidden_ok[0, 9:] - hidden_bad[0, 9:]).abs().max() > 1e-3


def test_behaviour_logprobs_match_trainer_recompute(tiny_model_dir, fresh_seed):
    """Engine log-probs (padded, KV-cached generation) equal packed recomputation."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir))
    engine = HFEngine(model, tok, max_batch_size=4)
    prompts = [tok.encode("Calculate 3 + 4."), tok.encode("Hi"), tok.encode("7 + 1 =")]
    trajs = engine.generate(prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=9))
    assert len(trajs) == 9 and [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(t.versions == [0] * len(t.completion_ids) for t in trajs)
    batch = pack_trajectories(trajs, torch.zeros(9))
    with torch.no_grad():
        logp, _ = packed_forward_logprobs(model, batch, temperature=0.8, with_entropy=False)
    mask = batch.loss_mask
    assert mask.sum() == sum(len(t.completion_ids) for t in trajs)
    assert (logp[mask] - batch.behav_logprobs[mask]).abs().max() <= 1e-4


def test_update_weights_checks_and_keeps_ties(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    engine = HFEngine(load_causal_lm(str(tiny_model_dir)), tok)
    source = load_causal_lm(str(tiny_model_dir))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    named = list(source.named_parameters())
    before = engine.model.get_input_embeddings().weight.clone()
    with pytest.raises(ValueError, match="no parameter named 'bogus'"):
        engine.update_weights(named + [("bogus", torch.zeros(1))], version=1)
    name0, p0 = named[0]
    with pytest.raises(ValueError, match=name0):
        engine.update_weights([(name0, p0[:1])] + named[1:], version=1)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(named[1:], version=1)
    assert torch.equal(engine.model.get_input_embeddings().weight, before) and engine.version == 0
    engine.update_weights(((n, p.detach()) for n, p in named), version=3)
    assert engine.version == 3
    emb, head = engine.model.get_input_embeddings(), engine.model.get_output_embeddings()
    assert emb.weight.data_ptr() == head.weight.data_ptr()
    assert torch.equal(emb.weight, source.get_input_embeddings().weight)


def test_behaviour_logprobs_ignore_model_generation_config_and_top_p(
    tiny_model_dir, tmp_path, fresh_seed
):
    """A model's repetition penalty or a top-p nucleus must not skew behaviour log-probs."""
    import json
    import shutil

    model_dir = tmp_path / "penalised"
    shutil.copytree(tiny_model_dir, model_dir)
    gen_cfg = model_dir / "generation_config.json"
    cfg = json.loads(gen_cfg.read_text()) if gen_cfg.exists() else {}
    cfg.update(repetition_penalty=1.5, no_repeat_ngram_size=2, top_k=5)
    gen_cfg.write_text(json.dumps(cfg))
    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir))
    engine = HFEngine(model, tok)
    trajs = engine.generate(
        [tok.encode("2 + 2 = ")], SamplingParams(n=6, temperature=1.0, top_p=0.8, max_new_tokens=12)
    )
    batch = pack_trajectories(trajs, torch.zeros(6))
    with torch.no_grad():
        logp, _ = packed_forward_logprobs(model, batch, temperature=1.0, with_entropy=False)
    mask = batch.loss_mask
    assert (logp[mask] - batch.behav_logprobs[mask]).abs().max() <= 1e-4


def test_trainer_turns_dropout_off(tmp_path, fresh_seed):
    """With dropout in the model config, trainer log-probs still equal the engine's."""
    import copy

    from conftest import make_tiny_model_dir

    from areal_fast.rl.config import LossConfig
    from areal_fast.train.config import ActorConfig
    from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine

    path = make_tiny_model_dir(tmp_path / "dropout")
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_dropout"] = 0.5
    (path / "config.json").write_text(json.dumps(cfg))
    tok, policy = load_tokenizer(str(path)), load_causal_lm(str(path))
    engine = HFEngine(copy.deepcopy(policy), tok)
    actor = ActorConfig(
        loss=LossConfig(), optim=OptimizerConfig(), keep_groups=False, use_decoupled_loss=False
    )
    trainer = TorchTrainEngine(policy, actor, temperature=1.0)
    trajs = engine.generate([tok.encode("hello")], SamplingParams(n=4, max_new_tokens=8))
    stats = trainer.accumulate_gradients(pack_trajectories(trajs, torch.randn(4)))
    assert stats["behav_logprob_abs_diff"] < 1e-5


def test_packed_attention_refuses_short_sliding_window(tiny_model_dir):
    from areal_fast.models.packed_attention import packed_attention_forward

    q = torch.randn(1, 2, 10, 4)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    module = torch.nn.Module()
    out, _ = packed_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, sliding_window=8)
    assert out.shape == (1, 10, 2, 4)
    with pytest.raises(ValueError, match="sliding window"):
        packed_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, sliding_window=5)
    with pytest.raises(ValueError, match="soft-capping"):
        packed_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, softcap=30.0)
