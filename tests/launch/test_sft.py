"""``areal-fast sft`` end to end on the tiny model (in-process): a 2-step job whose model
loads as ``model.path`` for ``areal-fast train``, exact resume after an interruption, and
bad rows refused with one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_fast.cli import main
from areal_fast.launch import sft as sft_driver
from areal_fast.launch.config import load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sft_arith.yaml"


def _rows(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _good_rows(tmp_path: Path) -> Path:
    rows = [
        {"prompt": f"{a}+{b}?", "completion": f"{a}+{b}={a + b}"}
        for a in range(4)
        for b in range(3)
    ]
    return _rows(tmp_path, rows)


def _args(tiny_model_dir, tmp_path, data: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--config",
        str(EXAMPLE),
        "--no-progress",
        f"model.path={tiny_model_dir}",
        f"data.path={data}",
        f"fileroot={tmp_path / 'runs'}",
        "eval.before=false",
        "eval.after=false",
        "batch_size=5",
        "actor.optim.lr=1e-3",
        "actor.max_tokens_per_mb=64",
        "threads=1",
        *extra,
    ]


def test_two_step_job_writes_a_model_for_train(tiny_model_dir, tmp_path):
    assert main(_args(tiny_model_dir, tmp_path, _good_rows(tmp_path), "total_steps=2")) == 0
    run = tmp_path / "runs" / "sft-arith" / "trial0"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(
        r["loss"] > 0 and r["sequences"] == 5 and r["num_micro_batches"] >= 2 for r in records
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rows"] == 12
    assert (run / "progress.png").stat().st_size > 0
    assert summary["final_model"] == str(run / "checkpoint")
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(run / "checkpoint" / "model.safetensors"))
    assert set(before) == set(after)
    assert any(not (before[k] == after[k]).all() for k in before)  # the weights moved
    cfg = load_config(str(REPO / "examples" / "arith.yaml"), [f"model.path={run / 'checkpoint'}"])
    assert cfg.model.path == str(run / "checkpoint")
    from areal_fast.models.loading import load_causal_lm, load_tokenizer

    assert load_causal_lm(cfg.model.path) is not None and load_tokenizer(cfg.model.path) is not None


def test_resume_after_an_interruption_ends_bit_identical(tiny_model_dir, tmp_path, monkeypatch):
    data = _good_rows(tmp_path)
    common = ["total_steps=3", "checkpoint.every_steps=1", "checkpoint.keep=1"]
    assert main(_args(tiny_model_dir, tmp_path, data, *common, "trial_name=straight")) == 0

    real = sft_driver._train_one

    def interrupted_at_step_3(cfg, engine, examples, step, rank):
        if step == 3:
            raise KeyboardInterrupt
        return real(cfg, engine, examples, step, rank)

    monkeypatch.setattr(sft_driver, "_train_one", interrupted_at_step_3)
    assert main(_args(tiny_model_dir, tmp_path, data, *common, "trial_name=cut")) == 130
    cut = tmp_path / "runs" / "sft-arith" / "cut"
    assert "from step 2" in (cut / "INTERRUPTED").read_text()
    assert not (cut / "summary.json").exists()
    monkeypatch.setattr(sft_driver, "_train_one", real)
    assert (
        main(_args(tiny_model_dir, tmp_path, data, *common, "trial_name=cut", "resume=true")) == 0
    )

    straight = tmp_path / "runs" / "sft-arith" / "straight"
    a = load_file(str(straight / "checkpoint" / "model.safetensors"))
    b = load_file(str(cut / "checkpoint" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)  # bitwise
    metrics = [
        [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (straight, cut)
    ]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 3


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"prompt": "1+1?"}, "line 3: missing key 'completion' (keys: prompt)"),
        ({"prompt": "1+1?", "completion": ""}, "line 3: 'completion' is empty"),
        (
            {"prompt": "1+1?" * 30, "completion": "2"},
            "line 3: 'prompt' + 'completion' is 142 tokens, more than actor.max_tokens_per_mb = 64",
        ),
    ],
)
def test_bad_rows_fail_with_one_line_and_write_nothing(tiny_model_dir, tmp_path, capsys, bad, said):
    good = {"prompt": "2+2?", "completion": "4"}
    data = _rows(tmp_path, [good, good, bad, good])
    assert main(_args(tiny_model_dir, tmp_path, data, "total_steps=2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"areal-fast: error: {data} {said}"), err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_held_out_evaluation_during_and_after_training(tiny_model_dir, tmp_path):
    """eval.every_steps writes the train command's eval_step_<k>.jsonl (rollout workers on the
    step's weights); eval.after reuses the last step's evaluation."""
    extra = [
        "total_steps=2",
        "eval.every_steps=2",
        "eval.after=true",
        "eval.data.eval_size=3",
        "eval.max_new_tokens=4",
        "checkpoint.final_model=false",
    ]
    assert main(_args(tiny_model_dir, tmp_path, _good_rows(tmp_path), *extra)) == 0
    run = tmp_path / "runs" / "sft-arith" / "trial0"
    records = [json.loads(x) for x in (run / "eval_step_2.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert {"uid", "answer", "completion", "correct", "reward"} <= set(records[0])
    assert (run / "eval_after.jsonl").read_text() == (run / "eval_step_2.jsonl").read_text()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval_accuracy" not in metrics[0] and metrics[1]["eval_accuracy"] == 0.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_accuracy_by_step"] == {"2": 0.0} and summary["eval_after"] == 0.0
    assert summary["final_model"] is None and not (run / "checkpoint").exists()
    assert (run / "progress.png").is_file()
    assert not (run / ".eval_model").exists()


def test_lora_job_trains_the_adapter_and_saves_the_merged_model(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    extra = ["total_steps=2", "actor.lora.rank=4", "actor.lora.alpha=8"]
    assert main(_args(tiny_model_dir, tmp_path, _good_rows(tmp_path), *extra)) == 0
    final = tmp_path / "runs" / "sft-arith" / "trial0" / "checkpoint"
    assert (final / "adapter" / "adapter_config.json").is_file()
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    merged = load_file(str(final / "model.safetensors"))
    assert set(merged) == set(before)  # plain names: a model.path for train
    changed = [k for k in before if not (before[k] == merged[k]).all()]
    assert changed and all("proj" in k for k in changed)  # the adapted linear layers only


def test_two_trainer_ranks_train_as_one(tiny_model_dir, tmp_path):
    """scheduler.train_world_size=2: a spawned FSDP2 rank trains every second row; the
    losses, gradient norms and final model are those of one rank (to float32 rounding)."""
    data = _good_rows(tmp_path)
    # eps 1e-3: Adam's step of a gradient at float32 rounding noise stays far below lr
    common = ["total_steps=2", "actor.optim.eps=1e-3", "checkpoint.every_steps=2"]
    assert main(_args(tiny_model_dir, tmp_path, data, *common, "trial_name=one")) == 0
    two = [*common, "trial_name=two", "scheduler.train_world_size=2"]
    assert main(_args(tiny_model_dir, tmp_path, data, *two)) == 0
    runs = tmp_path / "runs" / "sft-arith"
    metrics = [
        [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("one", "two")
    ]
    for one, two in zip(*metrics):
        assert (one["trained_tokens"], one["sequences"]) == (two["trained_tokens"], 5)
        for key in ("loss", "grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), key
    # rank 0's 3 rows take 2 micro-batches, rank 1's 2 rows 1: the ranks agree on 2
    assert [r["num_micro_batches"] for r in metrics[1]] == [2.0, 2.0]
    a = load_file(str(runs / "one" / "checkpoint" / "model.safetensors"))
    b = load_file(str(runs / "two" / "checkpoint" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    assert (runs / "two" / "checkpoints" / "step-00000002" / "train_state.json").is_file()


@pytest.mark.parametrize(
    "item, said",
    [
        (
            "actor.optim.lrr=1",
            "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?",
        ),
        ("actor.loss.eps_clip=0.1", "unknown config key 'actor.loss'; did you mean 'actor.lora'?"),
        (
            "scheduler.train_world_size=32",
            "scheduler.train_world_size = 32 is more than batch_size",
        ),
    ],
)
def test_sft_keys_are_checked_as_trains_are(tmp_path, capsys, item, said):
    args = ["sft", "--config", str(EXAMPLE), f"fileroot={tmp_path / 'runs'}", item]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fast: error: ") and said in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_sft_help_lists_the_sft_keys(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert "data: task, path, split, prompt_key, completion_key, messages_key" in out
    assert "actor.loss" not in out


def test_chat_rows_job_logs_to_tensorboard(tiny_model_dir, tmp_path):
    """Rows of chat messages (data.messages_key), each step's loss in TensorBoard."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def chat(a: int) -> list[dict]:
        return [
            {"role": "user", "content": f"{a}+1?"},
            {"role": "assistant", "content": f"{a + 1}"},
            {"role": "user", "content": "and +2?"},
            {"role": "assistant", "content": f"{a + 2}"},
        ]

    rows = [{"messages": chat(a)[:2] if a % 2 else chat(a)} for a in range(6)]
    extra = ["total_steps=2", "data.messages_key=messages", "logging.tensorboard=true"]
    assert main(_args(tiny_model_dir, tmp_path, _rows(tmp_path, rows), *extra)) == 0
    run = tmp_path / "runs" / "sft-arith" / "trial0"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [e.value for e in events.Scalars("loss")]
    assert losses == pytest.approx([r["loss"] for r in metrics], rel=1e-6)
