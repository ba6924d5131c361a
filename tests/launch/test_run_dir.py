"""The run directory's claim: one process at a time runs in a run directory (a second one,
such as ``resume=true`` while the first still runs, is refused in one line naming the
holder's process id); the holder may claim it again; a released or ended holder frees it;
a directory holding only what ``areal-fast submit`` wrote is started in place."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.run_dir import (
    LOCK_FILE,
    check_run_dir,
    claim_run_dir,
    prepare_run_dir,
    release_run_dir,
)

REPO = Path(__file__).resolve().parents[2]


def _hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    """A second process that claims ``run_dir`` and waits for its standard input to close."""
    code = textwrap.dedent(
        f"""
        import sys
        from areal_fast.launch.run_dir import claim_run_dir
        claim_run_dir({str(run_dir)!r})
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_directory_another_process_runs_in_is_refused(tmp_path):
    holder = _hold_in_another_process(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            claim_run_dir(tmp_path)
        assert f"(pid {holder.pid})" in str(info.value)
        assert "in use by another areal-fast process" in str(info.value)
    finally:
        holder.communicate("", timeout=30)
    claim_run_dir(tmp_path)  # its holder ended: free
    claim_run_dir(tmp_path)  # claimed by this process already: still fine
    release_run_dir(tmp_path)
    holder = _hold_in_another_process(tmp_path)  # released: another may claim it
    holder.communicate("", timeout=30)


def test_resume_while_the_run_goes_on_is_refused_before_anything_changes(tmp_path):
    cfg = load_config(str(REPO / "examples" / "arith.yaml"), [f"fileroot={tmp_path}"])
    run_dir = prepare_run_dir(cfg)
    (run_dir / "INTERRUPTED").write_text("interrupted at step 3\n")
    release_run_dir(run_dir)
    holder = _hold_in_another_process(run_dir)
    try:
        resumed = load_config(
            str(REPO / "examples" / "arith.yaml"), [f"fileroot={tmp_path}", "resume=true"]
        )
        with pytest.raises(ConfigError, match="in use by another areal-fast process"):
            prepare_run_dir(resumed)
        assert (run_dir / "INTERRUPTED").is_file()  # nothing of the run was touched
        assert not (run_dir / "config.resumed.yaml").exists()
    finally:
        holder.communicate("", timeout=30)


def test_a_submitted_directory_is_started_in_place(tmp_path):
    cfg = load_config(str(REPO / "examples" / "arith.yaml"), [f"fileroot={tmp_path}"])
    (cfg.run_dir / "slurm").mkdir(parents=True)
    (cfg.run_dir / "slurm" / "job.sbatch").write_text("#!/bin/bash\n")
    check_run_dir(cfg)
    assert prepare_run_dir(cfg) == cfg.run_dir
    assert (cfg.run_dir / "slurm" / "job.sbatch").is_file()
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == [LOCK_FILE, "config.yaml", "slurm"]
    release_run_dir(cfg.run_dir)
