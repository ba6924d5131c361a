"""Optional packages a config asks for: each missing one ends ``areal-fast train`` with one
line naming the key and the pip command, exit code 2, before anything is written."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

from areal_fast.cli import main
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.packages import check_packages, needed, requirement

ARITH = str(REPO / "examples" / "arith.yaml")


def _train(tmp_path, model_dir, *extra):
    return main(
        [
            "train",
            "--config",
            ARITH,
            "--no-progress",
            f"model.path={model_dir}",
            f"fileroot={tmp_path}",
            "total_steps=1",
            "batch_size=2",
            "rollout.group_size=2",
            "data.eval_size=2",
            "data.train_size=20",
            *extra,
        ]
    )


def test_the_readme_lora_line_without_peft(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """`pip install .` installs no peft: the README's LoRA line says what to install, exit 2,
    and leaves no run directory (no FAILED, no trainer restarts)."""
    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed
    code = _train(tmp_path, tiny_model_dir, "actor.lora.rank=16", "actor.optim.lr=1e-4")
    assert code == 2
    assert capsys.readouterr().err == (
        "areal-fast: error: actor.lora.rank = 16 needs the peft package, which is not "
        "installed: pip install 'peft>=0.21,<0.22' (or pip install 'areal_fast[lora]')\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, module, line",
    [
        (
            ["scheduler.type=ray"],
            "ray",
            "scheduler.type = 'ray' needs the ray package, which is not installed: "
            "pip install 'ray>=2.40' (or pip install 'areal_fast[ray]')",
        ),
        (
            ["logging.tensorboard=true"],
            "tensorboard",
            "logging.tensorboard = true needs the tensorboard package, which is not "
            "installed: pip install 'tensorboard>=2.14' (or pip install "
            "'areal_fast[tensorboard]')",
        ),
        (
            ["logging.wandb.mode=offline"],
            "wandb",
            "logging.wandb.mode = 'offline' needs the wandb package, which is not installed: "
            "pip install 'wandb>=0.17' (or pip install 'areal_fast[wandb]')",
        ),
        (
            ["rollout.engine=vllm"],
            "vllm",
            "rollout.engine = 'vllm' needs vLLM, which is not installed: `pip install vllm`",
        ),
        (
            ["rollout.engine=sglang_server", "rollout.server_url=[http://127.0.0.1:1]"],
            "sglang",
            "rollout.engine = 'sglang_server' needs SGLang in the rollout workers too",
        ),
        (
            ["data.task=hf", "data.path=someone/rows", "data.prompt_key=q", "data.task_kwargs={}"],
            "datasets",
            "data.task = 'hf' needs the datasets package, which is not installed: "
            "pip install 'datasets'",
        ),
        (
            ["data.task=gsm8k", "data.task_kwargs={}"],
            "datasets",
            "data.task = 'gsm8k' with data.path = 'openai/gsm8k' (a Hugging Face dataset id) "
            "needs the datasets package",
        ),
    ],
)
def test_each_missing_package_is_one_line_before_anything_is_written(
    tmp_path, tiny_model_dir, monkeypatch, capsys, overrides, module, line
):
    monkeypatch.setitem(sys.modules, module, None)
    assert _train(tmp_path, tiny_model_dir, *overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"areal-fast: error: {line}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_evaluation_needs_only_what_the_engines_use(monkeypatch):
    """`areal-fast eval` trains nothing and logs to no sink: peft, TensorBoard and wandb are
    not asked for; the engine's and the launcher's packages are."""
    cfg = load_config(
        ARITH,
        ["actor.lora.rank=8", "logging.tensorboard=true", "scheduler.type=ray"],
    )
    assert [n.module for n in needed(cfg)] == ["peft", "ray", "tensorboard"]
    assert [n.module for n in needed(cfg, training=False)] == ["ray"]
    monkeypatch.setitem(sys.modules, "peft", None)
    check_packages(cfg, training=False)
    with pytest.raises(ConfigError, match=r"^actor\.lora\.rank = 8 needs the peft package"):
        check_packages(cfg)


def test_the_pip_command_carries_the_bounds_of_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["lora"] == ["peft>=0.21,<0.22"]
    assert requirement("peft", "lora") == "peft>=0.21,<0.22"
    assert requirement("ray", "ray") == extras["ray"][0]
    assert requirement("datasets", None) == "datasets"
