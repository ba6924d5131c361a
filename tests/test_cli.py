"""End-to-end `areal-fast train` on a tiny random model, and the CLI's bad-input errors."""

import json
import re
import subprocess
import sys

import pytest

from areal_fast.cli import main


def _args(model_dir, root, *extra, config=None):
    return [
        "train",
        "--config",
        str(config or _EXAMPLE),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        "total_steps=2",
        "batch_size=3",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=8",
        "data.train_size=50",
        *extra,
    ]


from pathlib import Path  # noqa: E402

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arith.yaml"
_GSM8K_EXAMPLE = _EXAMPLE.with_name("gsm8k.yaml")


def test_train_writes_a_complete_run_dir(tiny_model_dir, tmp_path, capsys):
    assert main(_args(tiny_model_dir, tmp_path)) == 0
    run = tmp_path / "grpo-arith" / "trial0"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for key in (
        "reward_mean",
        "accuracy",
        "loss",
        "clip_fraction",
        "entropy_mean",
        "response_length_mean",
        "gen_tokens_per_s_cumulative",
        "train_tokens_per_s",
        "step_seconds",
        "grad_norm",
    ):
        assert key in lines[0], key
    assert lines[1]["step"] == 2
    assert (run / "progress.png").stat().st_size > 1000
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0 and summary["eval_problems"] == 8
    assert len((run / "eval_after.jsonl").read_text().splitlines()) == 8
    assert (run / "checkpoint" / "model.safetensors").exists()
    assert not (run / "FAILED").exists()


def test_kl_to_reference_and_qwen2(tiny_qwen_dir, tmp_path):
    assert (
        main(
            _args(
                tiny_qwen_dir,
                tmp_path,
                "actor.loss.kl_coef=0.05",
                "actor.pack_method=ffd",
                "actor.keep_groups=true",
            )
        )
        == 0
    )
    first = json.loads((tmp_path / "grpo-arith/trial0/metrics.jsonl").read_text().splitlines()[0])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference


@pytest.mark.parametrize(
    "override,needle",
    [
        ("actor.optim.lrr=1e-5", "actor.optim.lrr"),
        ("actor.optim.lrr=1e-5", "did you mean 'actor.optim.lr'?"),
        ("total_steps=0", "areal-fast eval --config FILE model.path="),
        ("total_steps=abc", "total_steps"),
        ("data.task=no_such_task", "no_such_task"),
        ("actor.loss.aggregation=mean", "aggregation"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("actor.optim.lr=inf", "actor.optim.lr"),
        ("actor.optim.beta1=1.5", "actor.optim.beta1"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens"),
        ("rollout.max_head_offpolicyness=-1", "rollout.max_head_offpolicyness"),
        ("actor.prox_logp_method=exact", "actor.prox_logp_method"),
        ("launcher.timeouts.train_step=0", "launcher.timeouts.train_step"),
        ("model.dtype=float64", "model.dtype"),
        ("model.attn_implementation=fast", "model.attn_implementation"),
        ("actor.ppo_n_minibatches=4", "actor.ppo_n_minibatches"),
        ("threads=0", "threads"),
        ("model.device=foo", "model.device"),
        ("model.path=/no/such/dir", "/no/such/dir"),
        ("actor.max_tokens_per_mb=8", "actor.max_tokens_per_mb"),
        ("rollout.max_new_tokens=100000", "rollout.max_new_tokens"),
    ],
)
def test_bad_config_is_one_line_and_leaves_no_run_dir(
    tiny_model_dir, tmp_path, capsys, override, needle
):
    assert main(_args(tiny_model_dir, tmp_path, override)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fast: error:") and needle in err and "\n" not in err
    assert not (tmp_path / "grpo-arith").exists()


def test_missing_model_and_data_files(tmp_path, tiny_model_dir, capsys):
    assert main(_args(tmp_path / "nope", tmp_path)) == 2
    assert "nope" in capsys.readouterr().err
    assert (
        main(
            _args(
                tiny_model_dir,
                tmp_path,
                f"data.path={tmp_path / 'missing.jsonl'}",
                config=_GSM8K_EXAMPLE,
            )
        )
        == 2
    )
    assert "missing.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "grpo-arith").exists()


def test_bad_gsm8k_row_is_named(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data"
    data.mkdir()
    good = json.dumps({"question": "1+1?", "answer": "2\n#### 2"})
    (data / "train.jsonl").write_text(
        good + "\n" + json.dumps({"question": "q", "answer": "no number here"}) + "\n"
    )
    (data / "test.jsonl").write_text("\n".join([good] * 3) + "\n")
    assert (
        main(
            _args(
                tiny_model_dir,
                tmp_path,
                f"data.path={data}",
                "data.train_size=null",
                "data.eval_size=1",
                config=_GSM8K_EXAMPLE,
            )
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "train.jsonl" in err and "line 2" in err


def test_overwrite_only_replaces_run_dirs(tiny_model_dir, tmp_path, capsys):
    precious = tmp_path / "grpo-arith" / "trial0" / "important.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("keep me")
    assert main(_args(tiny_model_dir, tmp_path, "overwrite=true")) == 2
    assert "not an areal-fast run directory" in capsys.readouterr().err
    assert precious.read_text() == "keep me"
    precious.unlink()
    (precious.parent / "config.yaml").write_text("old: run\n")
    assert main(_args(tiny_model_dir, tmp_path, "overwrite=true")) == 0
    assert (precious.parent / "summary.json").exists()


def test_bad_yaml_files(tmp_path, capsys):
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    for path, needle in ((listing, "mapping"), (broken, "cannot parse"), (tmp_path, "not a file")):
        assert main(["train", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and str(path) in err


def test_existing_run_dir_is_not_overwritten(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "grpo-arith" / "trial0").mkdir(parents=True)
    (tmp_path / "grpo-arith" / "trial0" / "keep.txt").write_text("x")
    assert main(_args(tiny_model_dir, tmp_path)) == 2
    assert "overwrite=true" in capsys.readouterr().err
    assert (tmp_path / "grpo-arith" / "trial0" / "keep.txt").exists()


def test_console_script_help(tmp_path):
    # run outside the checkout: its areal_fast/ would shadow the installed package
    out = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", "train", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and "--config" in out.stdout
    assert "`areal-fast config` prints each" in out.stdout
    assert "  actor.optim: lr, weight_decay," in out.stdout and "max_seconds" in out.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", "config"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert listing.returncode == 0
    assert "  actor.optim.lr  (float) = 1e-05\n" in listing.stdout
    assert "  scheduler.ray_num_cpus  (int | None) = null\n" in listing.stdout


def _accuracy_of(out: str) -> tuple[float, int, int]:
    """(percent, correct, problems) from the ``held-out accuracy: ...`` line."""
    line = next(x for x in out.splitlines() if x.startswith("held-out accuracy: "))
    match = re.match(r"held-out accuracy: ([0-9.]+)% \((\d+)/(\d+)\) of model.path=", line)
    return float(match.group(1)), int(match.group(2)), int(match.group(3))


def test_eval_command_prints_the_accuracy_of_its_jsonl(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """``areal-fast eval`` runs the held-out set on rollout workers alone (no trainer), prints
    the accuracy its eval.jsonl holds and writes nothing into the training run directory."""
    from areal_fast.launch import evaluation

    args = [
        "eval",
        "--config",
        str(_EXAMPLE),
        "--no-progress",
        f"model.path={tiny_model_dir}",
        f"fileroot={tmp_path}",
        "data.eval_size=8",
        "eval.max_new_tokens=6",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "grpo-arith" / "eval-trial0"
    assert f"evaluation directory: {folder}" in out
    records = [json.loads(x) for x in (folder / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({r["uid"] for r in records}) == 8
    percent, correct, problems = _accuracy_of(out)
    assert problems == 8 and correct == sum(r["correct"] for r in records)
    assert percent == pytest.approx(100 * correct / 8, abs=0.05)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["accuracy"] == correct / 8 and summary["problems"] == 8
    assert (folder / "config.yaml").is_file() and not (tmp_path / "grpo-arith/trial0").exists()

    # a second evaluation into the same folder needs overwrite=true; the records the
    # workers return are what is printed (here every other one marked correct)
    assert main(args) == 2
    assert "overwrite=true" in capsys.readouterr().err
    real = evaluation.evaluate_on

    def half_correct(*a, **k):
        return [{**r, "correct": i % 2 == 0} for i, r in enumerate(real(*a, **k))]

    monkeypatch.setattr(evaluation, "evaluate_on", half_correct)
    out_dir = tmp_path / "elsewhere"
    assert main([*args, f"--out={out_dir}"]) == 0
    percent, correct, problems = _accuracy_of(capsys.readouterr().out)
    records = [json.loads(x) for x in (out_dir / "eval.jsonl").read_text().splitlines()]
    assert (percent, correct, problems) == (50.0, 4, 8)
    assert sum(r["correct"] for r in records) / len(records) == 0.5


def test_eval_refuses_a_training_run_directory(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("old: run\n")
    assert (
        main(
            [
                "eval",
                "--config",
                str(_EXAMPLE),
                f"model.path={tiny_model_dir}",
                f"--out={run}",
                "overwrite=true",
            ]
        )
        == 2
    )
    assert "holds no earlier evaluation" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_ray_resources_fail_before_the_run_directory(tmp_path, capsys):
    """The README's Ray line on a machine with 2 CPUs for Ray: exit 2, one line, no run
    directory (so the corrected command runs), and no Ray instance started."""
    from areal_fast.launch.ray import main as ray_main

    assert (
        ray_main(
            [
                "train",
                "--config",
                str(_EXAMPLE),
                f"fileroot={tmp_path}",
                "scheduler.train_world_size=2",
                "checkpoint.every_steps=5",
                "scheduler.ray_num_cpus=2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fast: error: scheduler: the Ray workers need 3 CPUs")
    assert "\n" not in err and "scheduler.cpus_per_trainer_rank" in err
    assert not (tmp_path / "grpo-arith").exists()


def test_failure_while_running_is_one_line(tiny_model_dir, tmp_path, capsys):
    """A worker that misses its deadline ends the run with one line naming it and the key,
    exit code 1, FAILED in the run directory and no weight files left in /dev/shm."""
    before = set(Path("/dev/shm").glob("areal_fast-weights-*"))
    assert (
        main(
            _args(
                tiny_model_dir, tmp_path, "launcher.timeouts.train_step=0.001", "eval.before=false"
            )
        )
        == 1
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("areal-fast: error:")
    assert "'trainer'" in last and "timeouts.train_step" in last
    assert (tmp_path / "grpo-arith" / "trial0" / "FAILED").exists()
    assert set(Path("/dev/shm").glob("areal_fast-weights-*")) <= before


def test_train_and_eval_need_a_config(tmp_path, monkeypatch, capsys):
    """No --config: the usage and one argparse error naming --config, exit 2; nothing is
    written (a job on built-in defaults would take another run's directory)."""
    monkeypatch.chdir(tmp_path)
    for command in ("train", "eval"):
        with pytest.raises(SystemExit) as info:
            main([command, "total_steps=1"])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith(f"usage: areal-fast {command} [-h] --config FILE")
        assert err[-1] == (
            f"areal-fast {command}: error: the following arguments are required: --config"
        )
    assert list(tmp_path.iterdir()) == []


def test_version_and_train_description(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"areal-fast {version('areal_fast')}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("Train a policy with fully asynchronous GRPO")


def test_eval_names_a_missing_model_folder_and_a_run_directory(tiny_model_dir, tmp_path, capsys):
    """model.path: a folder that is not there, a run directory instead of its checkpoint/, a
    run directory without a final model and a folder without a model are one line each,
    exit 2, and no evaluation directory is written."""
    run = tmp_path / "runs" / "grpo-arith" / "trial0"
    (run / "checkpoint").mkdir(parents=True)
    (run / "config.yaml").write_text("old: run\n")

    def evaluate(path):
        args = ["eval", "--config", str(_EXAMPLE), f"model.path={path}", f"fileroot={tmp_path}"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not (tmp_path / "grpo-arith").exists()
        return err.removeprefix("areal-fast: error: ").strip()

    missing = run.parent / "trial9" / "checkpoint"
    assert evaluate(missing) == f"model.path = '{missing}': the folder {missing} does not exist"
    relative = "runs/grpo-arith/trial9/checkpoint"  # not a hub id: two slashes
    assert evaluate(relative) == f"model.path = '{relative}': the folder {relative} does not exist"
    assert evaluate(run) == (
        f"model.path = '{run}' is a run directory without a trained model (checkpoint/ is "
        f"written when a run finishes, unless checkpoint.final_model=false)"
    )
    for name in ("config.json", "model.safetensors"):
        (run / "checkpoint" / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert evaluate(run) == (
        f"model.path = '{run}' is a run directory, not a model; its trained model is in "
        f"checkpoint/: model.path={run}/checkpoint"
    )
    assert (
        evaluate(run.parent)
        == f"model.path = '{run.parent}': the folder holds no model (no config.json)"
    )


def test_a_batch_larger_than_the_training_set_is_refused(tiny_model_dir, tmp_path, capsys):
    """20 generated one-digit additions (some also held out) cannot fill a batch of 40: one
    line with both numbers and both keys, exit 2, no run directory."""
    assert main(_args(tiny_model_dir, tmp_path, "data.train_size=20", "batch_size=40")) == 2
    err = capsys.readouterr().err
    match = re.fullmatch(
        r"areal-fast: error: batch_size = 40 is more than the (\d+) training problems "
        r"\(data.train_size = 20(, less (\d+) also held out)?\): a step would train some of "
        r"them twice; lower batch_size or raise data.train_size\n",
        err,
    )
    assert match, err
    assert int(match.group(1)) + int(match.group(3) or 0) == 20
    assert not (tmp_path / "grpo-arith").exists()
    custom = _EXAMPLE.with_name("custom_data.yaml")  # 200 rows of examples/data/word_arith
    args = ["train", "--config", str(custom), f"model.path={tiny_model_dir}"]
    assert main([*args, f"fileroot={tmp_path}", "batch_size=201", "data.eval_size=4"]) == 2
    assert capsys.readouterr().err == (
        "areal-fast: error: batch_size = 201 is more than the 200 training problems (the "
        "training rows of data.path = 'examples/data/word_arith', data.train_size = null): a "
        "step would train some of them twice; lower batch_size\n"
    )
