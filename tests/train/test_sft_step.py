"""The supervised step: packed rows, the fused NLL against a float64 per-sequence
cross-entropy (values and gradients), and one update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from areal_fast.train.config import ActorConfig
from areal_fast.train.sft_step import accumulate_sft_gradients, pack_rows, sft_step
from areal_fast.train.torch_engine import TorchTrainEngine


def _model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _random_rows(vocab: int, lengths: list[int]) -> list[tuple[list[int], list[bool]]]:
    rows = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,)).tolist()
        targets = (torch.rand(n) < 0.6).tolist()
        targets[-1] = True  # at least one trained token per row
        rows.append((ids, targets))
    return rows


def _reference(model, rows):
    """Token-mean cross-entropy of the trained tokens, each row alone, in float64."""
    total = sum(sum(t[1:]) for _, t in rows)
    loss = torch.zeros((), dtype=torch.float64)
    for ids, targets in rows:
        x = torch.tensor(ids)
        logits = model(input_ids=x[None]).logits[0].double()
        per_token = F.cross_entropy(logits[:-1], x[1:], reduction="none")
        loss = loss + (per_token * torch.tensor(targets[1:], dtype=torch.float64)).sum()
    return loss / total


def test_pack_rows_labels_only_trained_next_tokens():
    batch = pack_rows([([5, 6, 7], [False, True, True]), ([8, 9], [False, False])])
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert batch.labels.tolist() == [6, 7, -100, -100, -100]
    assert batch.loss_mask.tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError, match="row 0"):
        pack_rows([([1, 2], [True])])


@pytest.mark.parametrize("max_tokens_per_mb", [64, 23])  # one micro-batch, several
def test_packed_fused_nll_equals_per_sequence_cross_entropy(
    tiny_model_dir, fresh_seed, max_tokens_per_mb
):
    model = _model(tiny_model_dir)
    reference_model = copy.deepcopy(model).double()
    actor = ActorConfig(max_tokens_per_mb=max_tokens_per_mb, use_decoupled_loss=False)
    engine = TorchTrainEngine(model, actor, temperature=1.0)
    rows = _random_rows(model.config.vocab_size, [7, 13, 1 + fresh_seed % 9, 20])
    batch = pack_rows(rows)
    stats = accumulate_sft_gradients(engine, batch)
    loss, micro_batches = stats["loss"], stats["num_micro_batches"]
    assert (micro_batches == 1) if max_tokens_per_mb == 64 else (micro_batches >= 2)

    expected = _reference(reference_model, rows)
    expected.backward()
    expected = expected.detach()
    assert loss == pytest.approx(float(expected), rel=1e-5)
    ref_params = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        ref_grad = ref_params[name].grad
        torch.testing.assert_close(param.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_sft_step_lowers_the_loss_of_its_batch(tiny_model_dir):
    torch.manual_seed(0)
    model = _model(tiny_model_dir)
    actor = ActorConfig(use_decoupled_loss=False)
    actor.optim.lr = 1e-2
    engine = TorchTrainEngine(model, actor, temperature=1.0, total_steps=3)
    batch = pack_rows(_random_rows(model.config.vocab_size, [9, 11]))
    first = sft_step(engine, batch)
    second = sft_step(engine, batch)
    assert engine.version == 2 and second["version"] == 2.0
    assert second["loss"] < first["loss"]
    assert first["trained_tokens"] == float(batch.loss_mask.sum())
    assert first["perplexity"] == pytest.approx(torch.tensor(first["loss"]).exp().item())
    with pytest.raises(ValueError, match="no trained token"):
        sft_step(engine, pack_rows([([1, 2], [False, False])]))
