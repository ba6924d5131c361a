"""``areal-fast train`` end to end (in-process, tiny model) on examples/data/word_arith with
data.task=jsonl and the default math reward."""

from __future__ import annotations

import json
from pathlib import Path

from areal_fast.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_train_on_a_jsonl_folder(tiny_model_dir, tmp_path):
    # examples/custom_data.yaml without its reward line: the default reward scores here
    text = (REPO / "examples" / "custom_data.yaml").read_text()
    config = tmp_path / "custom_data.yaml"
    config.write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("reward:")) + "\n"
    )
    args = [
        "train",
        "--config",
        str(config),
        "--no-progress",
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
    for record in records:
        assert record["uid"].startswith("jsonl/test/")
        assert record["answer"] == test_rows[int(record["uid"].split("/")[-1])]["answer"]
