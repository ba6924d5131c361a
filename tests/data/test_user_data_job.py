"""``areal-fast train`` end to end (in-process, tiny model): examples/custom_data.yaml, its
jsonl rows (examples/data/word_arith) scored by its own reward (examples/custom_reward.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.data.user_reward import load_reward

REPO = Path(__file__).resolve().parents[2]


def test_custom_data_and_reward_example(tiny_model_dir, tmp_path):
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "custom_data.yaml"),
        "--no-progress",
        f"reward.path={_tagged_reward(tmp_path)}:reward",
        f"model.path={tiny_model_dir}",
        f"fileroot={tmp_path / 'runs'}",
        f"data.path={REPO / 'examples' / 'data' / 'word_arith'}",
        "data.train_size=20",
        "data.eval_size=4",
        "total_steps=2",
        "batch_size=3",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "threads=1",
        "eval.before=false",
        "checkpoint.final_model=false",
    ]
    assert main(args) == 0
    run = tmp_path / "runs" / "grpo-custom-data" / "trial0"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["train_problems"], summary["eval_problems"]) == (20, 4)
    assert summary["steps"] == 2
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    test_rows = [json.loads(x) for x in (REPO / "examples/data/word_arith/test.jsonl").open()]
    records = [json.loads(x) for x in (run / "eval_after.jsonl").read_text().splitlines()]
    assert len(records) == 4
    custom = _custom_reward()
    for record in records:
        assert record["uid"].startswith("jsonl/test/")
        row = test_rows[int(record["uid"].split("/")[-1])]
        assert record["answer"] == row["answer"]
        # the example's reward scored it in the worker's pool, given the row's own columns
        tag = 0.25 * len(row["accept"])
        assert record["reward"] == custom(record["completion"], row) + tag


def _tagged_reward(tmp_path: Path) -> Path:
    """A reward file: the example's reward plus 0.25 per accepted spelling of the sample, so
    the records show that the row's columns reached it (the tiny model scores 0)."""
    path = tmp_path / "tagged_reward.py"
    path.write_text(
        "from areal_fast.data.user_reward import load_reward\n\n"
        f"example = load_reward({str(REPO / 'examples' / 'custom_reward.py') + ':reward'!r})\n\n\n"
        "def reward(completion, sample):\n"
        "    return example(completion, sample) + 0.25 * len(sample['accept'])\n"
    )
    return path


def _custom_reward():
    return load_reward(f"{REPO / 'examples' / 'custom_reward.py'}:reward")


@pytest.mark.slow
def test_custom_data_example_on_the_demo_model(tmp_path):
    """examples/custom_data.yaml as shipped (demo model, its reward in a thread pool), 2 steps
    of a small batch: held-out records scored by the example's reward, every step trained."""
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "custom_data.yaml"),
        "--no-progress",
        f"reward.path={REPO / 'examples' / 'custom_reward.py'}:reward",
        f"data.path={REPO / 'examples' / 'data' / 'word_arith'}",
        f"fileroot={tmp_path}",
        "total_steps=2",
        "batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "eval.before=false",
        "data.eval_size=4",
        "eval.max_new_tokens=8",
        "checkpoint.final_model=false",
    ]
    assert main(args) == 0
    run = tmp_path / "grpo-custom-data" / "trial0"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").open()] == [1, 2]
    custom = _custom_reward()
    test_rows = [json.loads(x) for x in (REPO / "examples/data/word_arith/test.jsonl").open()]
    records = [json.loads(x) for x in (run / "eval_after.jsonl").open()]
    assert len(records) == 4
    for record in records:
        row = test_rows[int(record["uid"].split("/")[-1])]
        assert record["reward"] == custom(record["completion"], row)
        assert record["correct"] == (record["reward"] >= 1.0)
