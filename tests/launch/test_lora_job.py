"""The default job with ``actor.lora`` end to end on the tiny model (in-process CLI): adapter-only
updates, the summary's counts, the exported merged model, resume equality (η = 0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from linked_job import tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
RANK = 4
TARGETS = "[q_proj,v_proj]"


def _args(model_dir, root, trial, *extra):
    return tiny_job_args(
        model_dir,
        root,
        trial,
        STEPS,
        "batch_size=4",
        "data.eval_size=4",
        "data.train_size=40",
        "rollout.max_head_offpolicyness=0",
        "actor.loss.entropy_coef=0.5",
        "actor.optim.lr=5e-2",
        f"actor.lora.rank={RANK}",
        f"actor.lora.target_modules={TARGETS}",
        "checkpoint.every_steps=2",
        "launcher.startup_timeout=120",
        "launcher.timeouts.train_step=120",
        *extra,
    )


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"])
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runs")
    assert main(_args(tiny_model_dir, root, "ref")) == 0
    return root / "grpo-arith" / "ref"


def test_lora_job_sends_the_adapter_and_exports_a_merged_model(tiny_model_dir, lora_run):
    import transformers

    summary = json.loads((lora_run / "summary.json").read_text())
    config = transformers.AutoConfig.from_pretrained(str(tiny_model_dir))
    hidden, layers = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    # q_proj [hidden, hidden] and v_proj [kv, hidden]: A [r, in] + B [out, r] each
    per_layer = RANK * (hidden + hidden) + RANK * (hidden + kv)
    assert summary["trainable_parameters"] == layers * per_layer
    assert summary["weight_update_bytes"] == 4 * layers * per_layer  # float32, adapter only
    records = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["weight_update_bytes"] == summary["weight_update_bytes"] for r in records)
    assert summary["trainer_peak_rss_mb"] > 100  # torch and a model at least
    assert any(r["grad_norm"] > 0 for r in records)
    # the final model: plain HF weights, and the adapter beside them
    model = transformers.AutoModelForCausalLM.from_pretrained(str(lora_run / "checkpoint"))
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert (lora_run / "checkpoint" / "adapter" / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    merged, plain = dict(model.named_parameters()), dict(base.named_parameters())
    changed = {n for n in merged if not (merged[n] == plain[n]).all()}
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)


def test_lora_resume_from_middle_checkpoint_equals_uninterrupted(
    tiny_model_dir, lora_run, tmp_path
):
    run_dir = tmp_path / "grpo-arith" / "ref"
    shutil.copytree(lora_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    assert main(_args(tiny_model_dir, tmp_path, "ref", "resume=true")) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] == STEPS - 2
    assert _losses(run_dir) == _losses(lora_run)  # bit-identical on CPU


def test_lora_target_naming_no_module_fails_at_once(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, "bad", "actor.lora.target_modules=[qproj]")
    assert main(args) != 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "actor.lora.target_modules" in x)
    assert "'qproj' names no module of the model" in line and "q_proj" in line
    assert not (tmp_path / "grpo-arith" / "bad" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, start",
    [
        (["rollout.engine=vllm_server"], "actor.lora with rollout.engine = 'vllm_server' is not"),
        (
            ["rollout.engine=vllm", "rollout.pause_mode=keep"],
            "actor.lora with rollout.engine = 'vllm' needs rollout.pause_mode = 'abort'",
        ),
        (["rollout.engine=vllm", "actor.lora.rank=600"], "vLLM serves LoRA ranks 1..512"),
    ],
)
def test_lora_with_an_engine_that_cannot_serve_it_is_refused_in_one_line(overrides, start):
    from areal_fast.launch.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(str(REPO / "examples" / "arith.yaml"), ["actor.lora.rank=16", *overrides])
    message = str(info.value)
    assert "\n" not in message
    assert start in message


def test_lora_with_the_vllm_engine_is_accepted():
    from areal_fast.launch.config import load_config

    cfg = load_config(
        str(REPO / "examples" / "arith.yaml"), ["actor.lora.rank=16", "rollout.engine=vllm"]
    )
    assert cfg.actor.lora.rank == 16 and cfg.rollout.engine == "vllm"
