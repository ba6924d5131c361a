"""Agents as the rollout workload of `areal-fast train` (tiny model, real worker processes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from areal_fast.agent.session import Session
from areal_fast.agent.store import read_trajectories
from areal_fast.cli import main
from areal_fast.rl.batch import IGNORE_INDEX, pack_trajectories

ROOT = Path(__file__).resolve().parents[2]
MULTITURN = ROOT / "examples" / "agent_multiturn.yaml"
CALCULATOR = ROOT / "examples" / "agent_calculator.yaml"


def _args(model_dir, root, config, *extra):
    return [
        "train",
        "--config",
        str(config),
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
        "eval.before=false",
        f"agent.path={ROOT / 'examples' / 'agents' / config_agent(config)}",
        *extra,
    ]


def config_agent(config: Path) -> str:
    return {
        "agent_multiturn.yaml": "multiturn_math.py:MultiTurnMathAgent",
        "agent_calculator.yaml": "calculator.py:CalculatorAgent",
    }[config.name]


def documented_step_keys() -> list[str]:
    """The agent/* and trajectory/* keys docs/agents.md says every step record carries."""
    from areal_fast.agent.session import DROP_REASONS

    text = (ROOT / "docs" / "agents.md").read_text()
    section = text[text.index("## Metrics") :].split("\n## ")[0]
    keys = re.findall(r"`((?:agent|trajectory)/[a-z_<>]+)`", section)
    expanded = [k.replace("<reason>", r) for k in keys for r in DROP_REASONS] + keys
    return sorted({k for k in expanded if "<" not in k})


def _sessions(run: Path) -> list[Session]:
    return [Session.from_dict(r) for r in read_trajectories(run / "trajectories")]


def test_multiturn_agent_trains_and_stores_sessions(tiny_model_dir, tmp_path):
    assert main(_args(tiny_model_dir, tmp_path, MULTITURN)) == 0
    run = tmp_path / "agent-multiturn" / "trial0"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    keys = documented_step_keys()
    assert len(keys) == 21 and "agent/sessions_dropped" in keys
    for record in records:  # every documented key, also those of nothing that happened
        assert [k for k in keys if k not in record] == []
    assert records[-1]["agent/sessions_dropped"] == records[-1]["agent/dropped_timeout"] == 0
    last = records[-1]
    assert last["agent/sessions"] >= 12 and last["agent/model_calls"] >= last["agent/sessions"]
    assert last["trajectory/errors"] == 0
    sessions = _sessions(run)
    # the writer works behind the metrics; closing the worker flushed everything
    assert last["trajectory/records_written"] <= last["agent/sessions"] <= len(sessions)
    for s in sessions:
        assert s.status == "done" and 1 <= len(s.calls) <= 3
        # a right answer at turn k earns 0.9^k; no right answer earns 0
        assert s.reward in [0.0] + [0.9**k for k in range(len(s.calls))]
        for parent, child in zip(s.calls, s.calls[1:]):
            assert child.parent == parent.call_id
            assert child.input_ids[: len(parent.full_ids)] == parent.full_ids
        [traj] = s.export("concat")
        packed = pack_trajectories([traj], torch.tensor([1.0]))
        trained = (packed.labels != IGNORE_INDEX).sum().item()
        assert trained == sum(len(c.output_ids) for c in s.calls)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollouts_trained"] == 6


def test_http_mode_with_the_openai_client(tiny_model_dir, tmp_path):
    """The calculator agent talks to the local endpoint through openai.AsyncOpenAI."""
    assert main(_args(tiny_model_dir, tmp_path, CALCULATOR, "total_steps=1")) == 0
    run = tmp_path / "agent-calculator" / "trial0"
    sessions = _sessions(run)
    assert sessions and all(s.status == "done" for s in sessions)
    for s in sessions:
        assert all(c.tools and c.tools[0]["function"]["name"] == "calculator" for c in s.calls)
        assert all(len(c.output_ids) == len(c.logprobs) == len(c.versions) for c in s.calls)


def test_a_store_directory_that_cannot_exist_fails_before_any_work(
    tiny_model_dir, tmp_path, capsys
):
    """(A store that fails while running stops the worker: see test_runner.py.)"""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code = main(
        _args(tiny_model_dir, tmp_path, MULTITURN, f"trajectory.directory={blocker / 'store'}")
    )
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("areal-fast: error: trajectory.directory = ") and "a_file" in last
    assert not (tmp_path / "agent-multiturn").exists()


def test_bad_agent_path_fails_before_any_work(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, MULTITURN)
    args[-1] = "agent.path=examples/agents/no_such_file.py:Agent"
    assert main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "agent.path" in last and "no_such_file.py" in last
    assert not (tmp_path / "agent-multiturn").exists()


async def _always_fails(data, client):
    raise KeyError("missing_field")


def test_an_agent_that_always_fails_ends_the_run(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, MULTITURN)
    args[-1] = f"agent.path={Path(__file__)}:_always_fails"
    assert main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "every session of the last 32 groups was dropped" in last
    assert "agent_error: KeyError" in last


@pytest.mark.parametrize(
    "override,key",
    [
        ("agent.export=tree", "agent.export"),
        ("agent.turn_discount=1.5", "agent.turn_discount"),
        ("agent.dropped_reward=nan", "agent.dropped_reward"),
        ("trajectory.compression=gzip", "trajectory.compression"),
        # every call without max_tokens would be refused
        ("agent.max_tokens_cap=4", "rollout.max_new_tokens"),
        # a group of sessions cannot fit a micro-batch
        ("agent.max_prompt_tokens=2100", "agent.max_prompt_tokens"),
        # a group's sequences are unbounded
        ("agent.export=per_turn", "agent.export"),
    ],
)
def test_config_errors_name_the_key(tiny_model_dir, tmp_path, capsys, override, key):
    assert main(_args(tiny_model_dir, tmp_path, MULTITURN, override)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{key} = " in last and f"{key.split('.')[0]}.{key}" not in last


def test_agent_lengths_must_fit_a_micro_batch():
    from areal_fast.launch.config import ConfigError, load_config

    ok = load_config(str(MULTITURN))  # 4 · (512 + 32) tokens ≤ 4096
    assert ok.agent.max_tokens_cap is None and ok.agent.max_prompt_tokens == 512
    assert load_config(str(CALCULATOR)).agent.max_prompt_tokens == 768
    with pytest.raises(ConfigError) as exc:
        load_config(str(MULTITURN), ["agent.max_prompt_tokens=1000"])
    assert str(exc.value) == (
        "agent.max_prompt_tokens = 1000: with max_tokens up to 32 (agent.max_tokens_cap, "
        "default rollout.max_new_tokens) a group of rollout.group_size = 4 sessions "
        "(actor.keep_groups) can reach 4128 tokens, more than actor.max_tokens_per_mb = 4096"
    )
    # one session's sequence is what must fit without keep_groups; the cap counts when set
    load_config(str(MULTITURN), ["agent.max_prompt_tokens=1000", "actor.keep_groups=false"])
    with pytest.raises(ConfigError, match="can reach 4112 tokens"):
        load_config(str(MULTITURN), ["agent.max_tokens_cap=3600", "actor.keep_groups=false"])
    with pytest.raises(ConfigError, match="agent.export = 'per_turn' with actor.keep_groups"):
        load_config(str(MULTITURN), ["agent.export=per_turn"])
    assert load_config(str(MULTITURN), ["agent.export=per_turn", "actor.keep_groups=false"])


@pytest.mark.slow
def test_multiturn_example_trains_the_demo_model(tmp_path):
    """The example config itself, shortened, on SmolLM2-135M."""
    args = [
        "train",
        "--config",
        str(MULTITURN),
        "--no-progress",
        f"fileroot={tmp_path}",
        "total_steps=1",
        "batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=16",
        "eval.before=false",
        "data.eval_size=4",
        "eval.max_new_tokens=8",
        "data.train_size=20",
        f"agent.path={ROOT / 'examples' / 'agents' / config_agent(MULTITURN)}",
    ]
    assert main(args) == 0
    run = tmp_path / "agent-multiturn" / "trial0"
    [record] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["agent/sessions"] >= 4
    sessions = _sessions(run)
    assert sessions and all(1 <= len(s.calls) <= 3 for s in sessions)
    # a session that got a right answer stopped there; one that never did used all 3 turns
    assert all(len(s.calls) == 3 for s in sessions if s.reward == 0.0)
