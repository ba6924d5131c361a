"""Slow tests on the real demo model (SmolLM2-135M-Instruct from the PyPI GGUF wheel)."""

import json

import pytest
import torch

from areal_fast.cli import main
from areal_fast.models.loading import DEMO_MODEL, demo_model_dir, load_causal_lm

pytestmark = pytest.mark.slow


def test_demo_model_facts():
    model = load_causal_lm(DEMO_MODEL)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (49152, 576, 30)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.get_input_embeddings().weight.data_ptr() == \
        model.get_output_embeddings().weight.data_ptr()
    assert (demo_model_dir() / "chat_template.jinja").exists() or \
        "chat_template" in (demo_model_dir() / "tokenizer_config.json").read_text()


def test_one_grpo_step_on_demo_model(tmp_path):
    """One real step: engine samples, trainer updates, engine receives the new weights."""
    args = ["train", "--no-progress", f"fileroot={tmp_path}", "total_steps=1", "batch_size=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.before=false",
            "data.eval_size=4", "eval.max_new_tokens=8", "data.train_size=20",
            "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"]
    assert main(args) == 0
    run = tmp_path / "grpo-arith" / "trial0"
    record = json.loads((run / "metrics.jsonl").read_text())
    assert record["policy_version"] == 1 and record["num_micro_batches"] >= 1
    assert record["behav_logprob_abs_diff"] < 1e-3  # engine and trainer agree on log-probs
    trained = load_causal_lm(str(run / "checkpoint"))
    base = load_causal_lm(DEMO_MODEL)
    moved = sum((a - b).abs().sum().item() for a, b in
                zip(trained.parameters(), base.parameters()))
    assert moved > 0 or record["grad_norm"] == 0.0
    assert json.loads((run / "summary.json").read_text())["eval_problems"] == 4


@pytest.mark.parametrize("attn", ["sdpa", "areal_packed"])
def test_packed_equals_unpadded_demo_model(attn, fresh_seed):
    """Acceptance: packed and per-sequence unpadded log-probs agree to 1e-4 (fp32)."""
    from test_packed_forward import _max_error, load_with_attention

    model = load_with_attention(DEMO_MODEL, attn)
    err = _max_error(model, [40, 3, 77, 12, 25])
    assert err <= 1e-4, f"packed vs unpadded max abs error {err:.2e}"
