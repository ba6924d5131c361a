"""``areal-fast compare``: fake run directories (a few metrics lines, eval files, a tiny
safetensors checkpoint) compared through the command line; no training runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_fast.launch import compare
from areal_fast.launch.command_line import main

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
TIMINGS = {"train_seconds": 1.5, "step_seconds": 2.0, "train_tokens_per_s": 100.0}


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=generator),
        "layer.bias": torch.randn(4, generator=generator),
        "layer.weight": torch.randn(4, 4, generator=generator),
    }


def make_run(path: Path) -> Path:
    """A finished run directory of 3 steps, two eval files and a one-file checkpoint."""
    (path / "checkpoint").mkdir(parents=True)
    (path / "config.yaml").write_text("total_steps: 3\n")
    metrics = [
        {"step": s, "reward_mean": 0.25 * s, "loss": 0.5 / s, "staleness_hist": [s, 1], **TIMINGS}
        for s in range(1, STEPS + 1)
    ]
    _write_jsonl(path / "metrics.jsonl", metrics)
    problems = [
        {"uid": f"p/{i}", "answer": str(i), "completion": f"= {i}", "correct": True, "reward": 1.0}
        for i in range(4)
    ]
    _write_jsonl(path / "eval_before.jsonl", problems)
    _write_jsonl(path / "eval_after.jsonl", problems)
    save_file(_weights(), str(path / "checkpoint" / "model.safetensors"))
    return path


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    run_a = make_run(tmp_path / "a")
    return run_a, Path(shutil.copytree(run_a, tmp_path / "b"))


def _edit_metrics(run: Path, step: int, **changes) -> None:
    records = _read_jsonl(run / "metrics.jsonl")
    records[step - 1].update(changes)
    _write_jsonl(run / "metrics.jsonl", records)


def _compare(capsys, *args) -> tuple[int, list[str], str]:
    code = main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_identical_runs(runs, capsys):
    code, lines, _ = _compare(capsys, *runs)
    assert code == 0
    assert lines == [
        "metrics.jsonl: identical (3 steps)",
        "eval_before.jsonl: identical (4 problems)",
        "eval_after.jsonl: identical (4 problems)",
        "weights: identical (3 tensors)",
    ]


def test_a_run_against_itself_is_warned_about(runs, capsys):
    code, lines, err = _compare(capsys, runs[0], runs[0])
    assert code == 0 and lines[0] == "metrics.jsonl: identical (3 steps)"
    assert err == f"warning: {runs[0]} and {runs[0]} are the same directory\n"


def test_changed_field_names_step_and_field(runs, capsys):
    _edit_metrics(runs[1], 2, loss=0.3)
    _edit_metrics(runs[1], 3, reward_mean=0.0)  # a later difference is not the first
    code, lines, _ = _compare(capsys, *runs)
    assert code == 1
    assert lines[0] == "metrics.jsonl: step 2: loss 0.25 != 0.3"
    assert all("identical" in line for line in lines[1:])


def test_timing_fields_and_ignored_fields_are_skipped(runs, capsys):
    _edit_metrics(runs[1], 2, **{name: 123.0 for name in compare.TIMING_FIELDS})
    _edit_metrics(runs[0], 3, fetch_seconds=0.1)  # a timing field one side lacks
    assert _compare(capsys, *runs)[0] == 0
    _edit_metrics(runs[1], 1, loss=9.0)
    assert _compare(capsys, *runs, "--ignore", "loss")[0] == 0
    assert _compare(capsys, *runs, "--ignore", "staleness_hist")[0] == 1


def test_metrics_field_sets_lists_and_missing_steps(runs, capsys):
    _edit_metrics(runs[1], 1, kl=0.0)
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[0]) == (1, "metrics.jsonl: step 1: fields only in run B: kl")
    shutil.copy(runs[0] / "metrics.jsonl", runs[1] / "metrics.jsonl")
    _edit_metrics(runs[1], 2, staleness_hist=[2, 0])
    assert _compare(capsys, *runs)[1][0] == "metrics.jsonl: step 2: staleness_hist [2, 1] != [2, 0]"
    _write_jsonl(runs[1] / "metrics.jsonl", _read_jsonl(runs[0] / "metrics.jsonl")[:2])
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[0]) == (1, "metrics.jsonl: step 3: only in run A")
    (runs[1] / "metrics.jsonl").unlink()
    assert _compare(capsys, *runs)[1][0] == "metrics.jsonl: only in run A"
    (runs[0] / "metrics.jsonl").unlink()  # a run stopped before its first step: no difference
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[0]) == (0, "metrics.jsonl: absent in both runs")


def test_same_value_is_type_and_nan_aware():
    assert compare.same_value(float("nan"), float("nan"))
    assert compare.same_value([1, {"x": float("nan")}], [1, {"x": float("nan")}])
    assert not compare.same_value(1, 1.0)
    assert not compare.same_value(1, True)
    assert not compare.same_value([1, 2], [1, 2, 3])


def test_eval_file_differing_at_a_uid(runs, capsys):
    problems = _read_jsonl(runs[1] / "eval_after.jsonl")
    problems[2].update(completion="= 7", correct=False)
    _write_jsonl(runs[1] / "eval_after.jsonl", problems)
    code, lines, _ = _compare(capsys, *runs)
    assert code == 1
    assert lines[1] == "eval_before.jsonl: identical (4 problems)"
    assert lines[2] == 'eval_after.jsonl: uid p/2: completion "= 2" != "= 7"'
    _write_jsonl(runs[1] / "eval_after.jsonl", problems[::-1])  # same problems, another order
    assert _compare(capsys, *runs)[1][2] == "eval_after.jsonl: line 1: uid p/0 != p/3"
    _write_jsonl(runs[1] / "eval_after.jsonl", _read_jsonl(runs[0] / "eval_after.jsonl")[:3])
    assert _compare(capsys, *runs)[1][2] == (
        "eval_after.jsonl: 4 problems in run A, 3 in run B; first extra uid p/3"
    )


def test_eval_file_in_one_run_only(runs, capsys):
    shutil.copy(runs[1] / "eval_before.jsonl", runs[1] / "eval_step_10.jsonl")
    shutil.copy(runs[1] / "eval_before.jsonl", runs[1] / "eval_step_2.jsonl")
    shutil.copy(runs[1] / "eval_before.jsonl", runs[0] / "eval_step_2.jsonl")
    code, lines, _ = _compare(capsys, *runs)
    assert code == 1
    assert lines[1:4] == [
        "eval_before.jsonl: identical (4 problems)",
        "eval_step_2.jsonl: identical (4 problems)",
        "eval_step_10.jsonl: only in run B",
    ]


def test_perturbed_tensor_is_named_with_its_max_abs_diff(runs, capsys):
    tensors = _weights()
    tensors["layer.weight"][1, 2] += 1e-3
    save_file(tensors, str(runs[1] / "checkpoint" / "model.safetensors"))
    code, lines, _ = _compare(capsys, *runs)
    assert code == 1
    assert lines[-1].startswith("weights: 1 of 3 tensors differ, max |a-b|: layer.weight 0.001")
    code, out, _ = _compare(capsys, *runs, "--json")
    (differing,) = json.loads("\n".join(out))["weights"]["differing"]
    assert differing["name"] == "layer.weight"
    assert differing["max_abs_diff"] == pytest.approx(1e-3, abs=1e-6)


def test_sharded_checkpoint_equals_one_file(runs, capsys):
    tensors = _weights()
    (runs[1] / "checkpoint" / "model.safetensors").unlink()
    save_file(
        {"embed.weight": tensors["embed.weight"]},
        str(runs[1] / "checkpoint" / "model-00001-of-00002.safetensors"),
    )
    rest = {k: v for k, v in tensors.items() if k != "embed.weight"}
    save_file(rest, str(runs[1] / "checkpoint" / "model-00002-of-00002.safetensors"))
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[-1]) == (0, "weights: identical (3 tensors)")


def test_tensor_names_shapes_and_dtypes(runs, capsys):
    tensors = _weights()
    tensors["extra.weight"] = torch.zeros(2)
    tensors["layer.bias"] = tensors["layer.bias"].double()
    tensors["embed.weight"] = tensors["embed.weight"].T.contiguous()
    save_file(tensors, str(runs[1] / "checkpoint" / "model.safetensors"))
    code, out, _ = _compare(capsys, *runs, "--json")
    weights = json.loads("\n".join(out))["weights"]
    assert code == 1 and not weights["identical"]
    assert weights["only_in_b"] == ["extra.weight"] and weights["only_in_a"] == []
    assert weights["mismatched"] == [
        {"name": "embed.weight", "a": "float32 [8, 4]", "b": "float32 [4, 8]"},
        {"name": "layer.bias", "a": "float32 [4]", "b": "float64 [4]"},
    ]
    assert weights["summary"].startswith("1 tensors only in run B (extra.weight); 2 differ in")


def test_checkpoint_absent(runs, capsys):
    shutil.rmtree(runs[1] / "checkpoint")
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[-1]) == (1, "weights: checkpoint only in run A")
    shutil.rmtree(runs[0] / "checkpoint")  # checkpoint.final_model=false in both
    code, lines, _ = _compare(capsys, *runs)
    assert (code, lines[-1]) == (0, "weights: no checkpoint in either run")


def test_max_abs_diff_goes_by_chunks(monkeypatch):
    monkeypatch.setattr(compare, "_CHUNK", 3)
    a = torch.zeros(4, 5, dtype=torch.bfloat16)
    b = a.clone()
    b[3, 4] = -0.5
    b[0, 1] = 0.25
    assert compare.max_abs_diff(a, b) == 0.5
    b[2, 2] = float("nan")
    assert math.isnan(compare.max_abs_diff(a, b))


def test_json_report(runs, capsys):
    _edit_metrics(runs[1], 2, reward_mean=0.75)
    code, out, _ = _compare(capsys, *runs, "--json")
    report = json.loads("\n".join(out))
    assert code == 1
    assert set(report) == {"run_a", "run_b", "identical", "metrics", "evals", "weights"}
    assert report["identical"] is False
    assert report["metrics"] == {
        "identical": False,
        "summary": "step 2: reward_mean 0.5 != 0.75",
        "step": 2,
        "field": "reward_mean",
        "a": 0.5,
        "b": 0.75,
    }
    assert list(report["evals"]) == ["eval_before.jsonl", "eval_after.jsonl"]
    assert report["evals"]["eval_after.jsonl"] == {
        "identical": True,
        "summary": "identical (4 problems)",
    }
    assert report["weights"]["identical"] and report["weights"]["differing"] == []


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such directory"),
        ("a file", "is a file, not a run directory (give the folder)"),
        ("misspelt --ignore", "--ignore los: no such field in metrics.jsonl of either run"),
        ("not a run", "is not an areal-fast run directory (no config.yaml)"),
        ("bad json", "metrics.jsonl line 2: not valid JSON"),
        ("no step", "metrics.jsonl line 1: not a JSON object with 'step'"),
        ("repeated step", "metrics.jsonl line 3: step 2 appears twice"),
        ("no uid", "eval_after.jsonl line 5: not a JSON object with 'uid'"),
        ("bad weights", "model.safetensors: not a readable safetensors file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs, capsys, case, message):
    run_a, run_b = runs
    metrics = run_b / "metrics.jsonl"
    extra = ()
    if case == "missing":
        run_b = run_b / "nowhere"
    elif case == "a file":
        run_b = metrics
    elif case == "misspelt --ignore":
        extra = ("--ignore", "los")
    elif case == "not a run":
        (run_b / "config.yaml").unlink()
    elif case == "bad json":
        metrics.write_text('{"step": 1}\n{"step": 2,\n')
    elif case == "no step":
        metrics.write_text("[1, 2]\n")
    elif case == "repeated step":
        metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 2}\n')
    elif case == "no uid":
        with open(run_b / "eval_after.jsonl", "a") as file:
            file.write('{"id": 5}\n')
    else:
        (run_b / "checkpoint" / "model.safetensors").write_bytes(b"not safetensors")
    code, out, err = _compare(capsys, run_a, run_b, *extra)
    assert (code, out) == (2, [])
    assert len(err.splitlines()) == 1 and err.startswith("areal-fast: error: ")
    assert message in err


def test_command_exit_codes_through_a_subprocess(runs):
    def run(*args) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "areal_fast.cli", "compare", *map(str, args)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    assert run(*runs).returncode == 0
    tensors = load_file(str(runs[1] / "checkpoint" / "model.safetensors"))
    tensors["layer.bias"][0] += 1.0
    save_file(tensors, str(runs[1] / "checkpoint" / "model.safetensors"))
    different = run(*runs)
    assert different.returncode == 1 and "layer.bias 1" in different.stdout
    bad = run(runs[0], runs[0].parent)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.splitlines()) == 1


def test_timing_fields_are_step_metrics_keys():
    from areal_fast.controller.step_record import STEP_METRICS

    keys = {name.strip() for entry in STEP_METRICS for name in entry.split("/ ")}
    assert compare.TIMING_FIELDS - keys == {"agent/finish_seconds"}
