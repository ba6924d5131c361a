"""On-policy distillation end to end on the tiny model (in-process CLI): a 2-step job with a
perturbed copy of the student as teacher, and the settings refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import swapped_vocab_copy
from linked_job import tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main

STEPS = 2


def _args(model_dir, root, *extra):
    return tiny_job_args(
        model_dir,
        root,
        "distill",
        STEPS,
        "batch_size=2",
        "data.eval_size=2",
        "data.train_size=20",
        "rollout.max_head_offpolicyness=0",
        "actor.optim.lr=1e-2",
        "checkpoint.final_model=false",
        "eval.before=false",
        "eval.after=false",
        *extra,
    )


def _teacher_dir(model_dir: Path, out: Path, seed: int = 7) -> Path:
    """A copy of the tiny student with every weight moved by N(0, 0.05²) noise."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(out)
    return out


def test_a_two_step_distillation_job_writes_distill_kl(tiny_model_dir, tmp_path):
    teacher = _teacher_dir(tiny_model_dir, tmp_path / "teacher")
    args = _args(
        tiny_model_dir,
        tmp_path,
        f"actor.distill.teacher_path={teacher}",
        "actor.distill.coef=0.5",
        "actor.distill.task_reward=false",
    )
    assert main(args) == 0
    run = tmp_path / "grpo-arith" / "distill"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the student's sampled tokens are likelier under the student than under the
        # noisy teacher: a positive mean reverse KL, of the size the noise gives
        assert 0.01 < r["distill_kl"] < 5.0, r["distill_kl"]
        assert r["grad_norm"] > 0
    assert not (run / "FAILED").exists()


def _adapter_dir(out: Path) -> Path:
    out.mkdir()
    (out / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    return out


def _other_vocab_dir(model_dir: Path, out: Path) -> Path:
    """The tiny model with two token ids swapped in its tokenizer."""
    swapped_vocab_copy(model_dir, out, "a", "b")
    return out


def _bad_overrides(case: str, model_dir: Path, tmp_path: Path) -> list[str]:
    teacher = "actor.distill.teacher_path="
    if case == "coef":
        return [f"{teacher}x", "actor.distill.coef=0"]
    if case == "alone":
        return ["actor.distill.task_reward=false"]
    if case == "missing":
        return [f"{teacher}{tmp_path / 'no' / 'such'}"]
    if case == "adapter":
        return [f"{teacher}{_adapter_dir(tmp_path / 'adapter')}"]
    if case == "vocab":
        return [f"{teacher}{_other_vocab_dir(model_dir, tmp_path / 'v')}"]
    assert case == "filter"
    return [
        f"{teacher}{model_dir}",
        "actor.distill.task_reward=false",
        "rollout.dynamic_filter=true",
    ]


@pytest.mark.parametrize(
    "case,needles",
    [
        ("coef", ["actor.distill.coef = 0.0 must be a finite number > 0"]),
        ("alone", ["actor.distill.task_reward = false needs actor.distill.teacher_path"]),
        ("missing", ["actor.distill.teacher_path = ", "does not exist"]),
        ("adapter", ["actor.distill.teacher_path = ", "is a LoRA adapter, not a model"]),
        ("vocab", ["has another vocabulary than model.path = ", "in the teacher, "]),
        ("filter", ["rollout.dynamic_filter = true with actor.distill.task_reward = false"]),
    ],
)
def test_bad_distill_settings_are_one_line(tiny_model_dir, tmp_path, capsys, case, needles):
    overrides = _bad_overrides(case, tiny_model_dir, tmp_path)
    assert main(_args(tiny_model_dir, tmp_path / "runs", *overrides)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fast: error:") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    if case == "vocab":
        assert str(tiny_model_dir) in err and str(tmp_path / "v") in err
    assert not (tmp_path / "runs").exists()
