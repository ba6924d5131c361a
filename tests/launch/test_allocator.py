"""The trainer processes' allocator (``launcher.allocator``): which environment each choice
gives, that a process started with it really has mimalloc loaded while the launcher's own
environment is left as it was, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from areal_fast.launch import allocator
from areal_fast.launch.allocator import loaded_allocator, mimalloc_library, trainer_environment
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.wire.handles import spawn_worker

REPO = Path(__file__).resolve().parents[2]

needs_mimalloc = pytest.mark.skipif(
    mimalloc_library() is None, reason="cmeel-mimalloc is not installed (Linux only)"
)


def report_allocator(conn, name, spec, authkey) -> None:
    """Worker target: send back the allocator loaded in this process and one variable."""
    conn.send({"allocator": loaded_allocator(), "purge": os.environ.get("MIMALLOC_PURGE_DELAY")})


@needs_mimalloc
def test_auto_preloads_mimalloc_and_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("MIMALLOC_PURGE_DELAY", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = trainer_environment("auto")
    assert env == {"LD_PRELOAD": mimalloc_library(), "MIMALLOC_PURGE_DELAY": "-1"}
    assert os.path.isfile(env["LD_PRELOAD"])
    assert trainer_environment("mimalloc") == env
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "100")
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    env = trainer_environment("auto")
    assert env["MIMALLOC_PURGE_DELAY"] == "100"
    assert env["LD_PRELOAD"] == f"{mimalloc_library()} /opt/mine.so"


def test_system_sets_nothing_and_missing_mimalloc_is_refused(monkeypatch):
    assert trainer_environment("system") == {}
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    assert trainer_environment("auto") == {}
    with pytest.raises(ValueError, match=r"launcher.allocator = 'mimalloc'.*cmeel-mimalloc"):
        trainer_environment("mimalloc")
    with pytest.raises(ValueError, match=r"launcher.allocator = 'jemalloc' is not one of"):
        trainer_environment("jemalloc")


def test_config_key_is_checked_before_anything_runs(monkeypatch):
    assert load_config(None, []).launcher.allocator == "auto"
    with pytest.raises((ConfigError, ValueError), match="launcher.allocator"):
        load_config(None, ["launcher.allocator=tcmalloc"])
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    with pytest.raises((ConfigError, ValueError), match="libmimalloc.so not found"):
        load_config(None, ["launcher.allocator=mimalloc"])


@needs_mimalloc
@pytest.mark.parametrize("choice", ["auto", "system"])
def test_a_spawned_worker_runs_with_the_chosen_allocator(choice, monkeypatch):
    monkeypatch.delenv("MIMALLOC_PURGE_DELAY", raising=False)
    before = dict(os.environ)
    handle = spawn_worker("w", report_allocator, None, b"key", trainer_environment(choice))
    assert dict(os.environ) == before  # the launcher's environment is restored at once
    try:
        assert handle.conn.poll(60), "the worker sent nothing within 60 s"
        reply = handle.conn.recv()
    finally:
        handle.process.join(30)
    expected = "mimalloc" if choice == "auto" else "system"
    assert reply == {"allocator": expected, "purge": "-1" if choice == "auto" else None}
    assert loaded_allocator() == "system"  # this process is untouched
    # nor is multiprocessing's resource tracker, which the first spawn starts
    assert loaded_allocator(resource_tracker._resource_tracker._pid) == "system"


@needs_mimalloc
@pytest.mark.parametrize("choice", ["auto", "system"])
def test_the_sft_command_starts_itself_again_on_mimalloc(choice, tiny_model_dir, tmp_path):
    """``areal-fast sft`` trains in its own process: with ``auto`` it execs itself with
    mimalloc preloaded (once), and its ``summary.json`` says which allocator trained."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1?", "completion": "ok"}) + "\n"
                            for a in range(4)))  # fmt: skip
    args = [
        "sft", "--config", str(REPO / "examples" / "sft_arith.yaml"), "--no-progress",
        f"model.path={tiny_model_dir}", f"data.path={rows}", f"fileroot={tmp_path}",
        "trial_name=t", "eval.before=false", "eval.after=false", "batch_size=2",
        "total_steps=1", "threads=1", "checkpoint.final_model=false",
        f"launcher.allocator={choice}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY")}
    script = Path(sys.executable).parent / "areal-fast"  # the installed command, run elsewhere
    done = subprocess.run(
        [str(script), *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "sft-arith" / "t" / "summary.json").read_text())
    assert summary["allocator"] == ("mimalloc" if choice == "auto" else "system")
    assert done.stderr.count("finished 1 supervised steps") == 1  # it ran once
