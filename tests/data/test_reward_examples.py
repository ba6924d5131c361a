"""The shipped reward examples: examples/custom_reward.py (answer or an accepted spelling) and
examples/code_reward.py (code run in a limited child process), their data and configs; and a
short job on the tiny model with a user reward that fails for some prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.data.user_reward import load_reward

REPO = Path(__file__).resolve().parents[2]
CODE_TASKS = REPO / "examples" / "data" / "code_tasks.jsonl"


@pytest.fixture(scope="module")
def code():
    return load_reward(f"{REPO}/examples/code_reward.py:reward").__globals__


@pytest.fixture(scope="module")
def custom():
    return load_reward(f"{REPO}/examples/custom_reward.py:reward")


def _block(source: str) -> str:
    return f"Here is my solution:\n```python\n{source}\n```\nIt works."


# ------------------------------------------------------------------ custom_reward.py


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("56", 1.0),
        ("The answer is 56.", 1.0),
        (r"so \boxed{56}", 1.0),
        ("Eight times seven is fifty-six", 1.0),
        ("FIFTY-SIX", 1.0),
        ("55", 0.0),
        ("fifty-seven", 0.0),
        ("fifty-six is not it, the answer is 57", 0.0),
        ("", 0.0),
    ],
)
def test_custom_reward_takes_the_answer_or_an_accepted_spelling(custom, completion, expected):
    sample = {"uid": "u", "answer": "56", "accept": ["fifty-six"]}
    assert custom(completion, sample) == expected


def test_custom_reward_without_accept(custom):
    assert custom("1,234", {"answer": "1234"}) == 1.0
    assert custom("twelve", {"answer": "12"}) == 0.0


# ------------------------------------------------------------------ code_reward.py


def test_code_reward_scores_a_correct_and_a_wrong_solution(code):
    sample = {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
    assert code["reward"](_block("def add(a, b):\n    return a + b"), sample) == 1.0
    assert code["reward"](_block("def add(a, b):\n    return a - b"), sample) == 0.0
    assert code["reward"]("def add(a, b): return a + b", sample) == 0.0  # no code block
    assert code["reward"](_block("def add(a, b) return"), sample) == 0.0  # syntax error


def test_every_code_task_passes_with_its_reference_solution_only(code):
    rows = [json.loads(line) for line in CODE_TASKS.read_text().splitlines()]
    assert len(rows) == 12 and all({"prompt", "answer", "tests"} <= set(r) for r in rows)
    for row in rows:
        assert code["reward"](_block(row["answer"]), row) == 1.0, row["prompt"]
        assert code["reward"](_block("pass"), row) == 0.0, row["prompt"]


def test_an_infinite_loop_is_stopped_by_the_time_limit(code):
    start = time.monotonic()
    result = code["run_program"]("while True:\n    pass\n", time_limit=1.0)
    assert result.timed_out and not result.passed and result.returncode < 0
    assert time.monotonic() - start < 3.0


def test_a_sleeping_program_is_stopped_by_the_wall_time_limit(code):
    start = time.monotonic()
    result = code["run_program"]("import time\ntime.sleep(60)\n", time_limit=1.0)
    assert result.timed_out and time.monotonic() - start < 3.0


def test_a_memory_hog_is_stopped_by_the_memory_limit(code):
    result = code["run_program"]("x = bytearray(2 * 1024**3)\n", memory_limit=256 * 2**20)
    assert not result.passed and not result.timed_out
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize(
    "source",
    [
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n",
        "import socket\nsocket.create_connection(('127.0.0.1', 9))\n",
        "import _socket\n_socket.socket()\n",
    ],
)
def test_socket_use_fails(code, source):
    result = code["run_program"](source)
    assert not result.passed
    assert "PermissionError: network access is disabled for this program" in result.stderr


def test_the_child_gets_an_empty_environment_and_its_own_folder(code):
    probe = (
        "import os, sys\n"
        "assert 'HOME' not in os.environ and 'PATH' not in os.environ, dict(os.environ)\n"
        "assert sys.flags.isolated == 1\n"
        "assert os.path.basename(os.getcwd()).startswith('code_reward_')\n"
    )
    assert code["run_program"](probe).passed


# ------------------------------------------------------------------ the configs


def _user_data_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("areal_fast.data.user_data") is not None


@pytest.mark.skipif(not _user_data_available(), reason="needs data.task jsonl")
@pytest.mark.parametrize("name", ["code_exec.yaml", "custom_data.yaml"])
def test_example_configs_load_and_their_rewards_check(name, monkeypatch):
    from areal_fast.launch.config import load_config
    from areal_fast.launch.worker_specs import check_reward

    monkeypatch.chdir(REPO)
    cfg = load_config(str(REPO / "examples" / name))
    assert cfg.reward.path and cfg.data.task == "jsonl"
    check_reward(cfg)


# ------------------------------------------------------------------ a job on the tiny model

FLAKY = """
import zlib

def reward(completion, sample):
    # about a third of the prompts: an exception (the group is dropped as reward_error)
    if zlib.crc32(sample["uid"].encode()) % 3 == 0:
        raise RuntimeError("verifier offline for " + sample["uid"])
    return 1.0 if len(completion) % 2 else 0.0
"""


def test_a_job_with_a_failing_user_reward_counts_its_drops(tiny_model_dir, tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    args = [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={tiny_model_dir}",
        f"fileroot={tmp_path}",
        "trial_name=flaky",
        "total_steps=2",
        "batch_size=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "eval.max_new_tokens=4",
        "eval.before=false",
        "data.eval_size=6",
        "data.train_size=60",
        "rollout.max_head_offpolicyness=0",
        "threads=1",
        "checkpoint.final_model=false",
        f"reward.path={tmp_path / 'flaky.py'}:reward",
        "reward.workers=2",
        "launcher.startup_timeout=120",
    ]
    assert main(args) == 0
    run_dir = tmp_path / "grpo-arith" / "flaky"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    dropped = summary["rollouts_dropped"]
    assert dropped.get("reward_error", 0) >= 1
    assert summary["rollouts_trained"] == 8
    records = [json.loads(x) for x in (run_dir / "eval_after.jsonl").read_text().splitlines()]
    assert len(records) == 6
    for r in records:
        assert r["correct"] == (r["reward"] >= 1.0)
        if "error" in r:  # a failed held-out reward scores 0 and says why
            assert r["reward"] == 0.0 and "verifier offline for" in r["error"]
