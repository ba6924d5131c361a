"""The progress plot: one line where reward and accuracy coincide, a title, labelled
held-out points."""

from __future__ import annotations

import json

import pytest

from areal_fast.controller.metrics import MetricsLog, plot_progress


def _records(reward_offset: float = 0.0) -> list[dict]:
    accuracy = [0.25, 0.5, 0.375, 0.625]
    return [
        {
            "step": i + 1,
            "accuracy": a,
            "reward_mean": a + reward_offset,
            "solve_rate": min(1.0, 2 * a),
        }
        for i, a in enumerate(accuracy)
    ]


def _labels(fig) -> list[str]:
    return [line.get_label() for line in fig.axes[0].get_lines()]


def test_equal_reward_and_accuracy_draw_one_line(tmp_path):
    path = tmp_path / "progress.png"
    fig = plot_progress(
        _records(),
        {"before": (0, 0.205), "after": (4, 0.3125)},
        path,
        title="grpo-arith/trial0 (demo:SmolLM2-135M-Instruct)",
    )
    assert path.stat().st_size > 0
    assert _labels(fig) == [
        "train reward mean = sample accuracy",
        "train solve rate (≥1 correct per group)",
    ]
    ax = fig.axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == [0.25, 0.5, 0.375, 0.625]
    assert ax.get_title() == "grpo-arith/trial0 (demo:SmolLM2-135M-Instruct)"
    notes = {t.get_text(): t.xy for t in ax.texts}
    assert notes == {"before: 20.5%": (0, 0.205), "after: 31.2%": (4, 0.3125)}


def test_a_reward_that_differs_gets_its_own_line(tmp_path):
    fig = plot_progress(_records(reward_offset=0.1), {}, tmp_path / "p.png")
    assert _labels(fig) == [
        "train reward mean",
        "train sample accuracy",
        "train solve rate (≥1 correct per group)",
    ]
    ydata = list(fig.axes[0].get_lines()[0].get_ydata())
    assert ydata == pytest.approx([0.35, 0.6, 0.475, 0.725])
    assert fig.axes[0].get_title() == "" and len(fig.axes[0].texts) == 0


def test_metrics_log_resume_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4')
    log = MetricsLog.resume(path, up_to_step=2)
    assert [r["step"] for r in log.records] == [1, 2]
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 2}']
