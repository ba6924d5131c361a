"""``areal-fast submit --status RUN_DIR``: Slurm's state (stand-in ``squeue`` and ``scontrol``
on PATH), the run's state by its files and its last metrics line."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from areal_fast.cli import main

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "examples" / "arith.yaml")


def test_status_needs_a_submitted_run(tmp_path, capsys):
    assert main(["submit", "--status", str(tmp_path)]) == 2
    assert "holds no job submitted by areal-fast submit" in capsys.readouterr().err


def _stand_in(folder: Path, name: str, out: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\nprintf %s {shlex.quote(out)}\n")
    path.chmod(0o755)


@pytest.mark.parametrize(
    "squeue,scontrol,state",
    [
        ("RUNNING|None|1:02|node7\n", "", "job 31: RUNNING on node7 for 1:02"),
        ("PENDING|Priority|0:00|\n", "", "job 31: PENDING (Priority)"),
        (
            "",
            "JobId=31 JobState=CANCELLED Restarts=1 ExitCode=143:0",
            "CANCELLED (exit 143, 1 requeues)",
        ),
        ("", "JobId=31 JobState=FAILED ExitCode=0:9", "job 31: FAILED (exit 0, signal 9)"),
        ("", "", "job 31: not known to Slurm now"),
    ],
)
def test_status_shows_slurm_state_run_state_and_last_step(
    tmp_path, monkeypatch, capsys, squeue, scontrol, state
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "squeue", squeue)
    _stand_in(bin_dir, "scontrol", scontrol)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs").write_text(
        "30 2026-12-07T01:00:00+0000\n31 2026-12-07T02:00:00+0000\n"
    )
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "reward_mean": 0.25, "loss": 0.5}\n{"step": 2, "reward_mean": 0.375, "loss"'
    )  # the second line is being written
    (run / "INTERRUPTED").write_text(
        "interrupted at step 3 (2 of 9 trained); ...\nsignal: SIGTERM\n"
    )
    assert main(["submit", "--status", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert state in lines[0]
    assert lines[1:] == [
        "run: INTERRUPTED: interrupted at step 3 (2 of 9 trained); ...",
        "last step: step 1: reward_mean 0.25, loss 0.5",
        f"log: {run / 'slurm' / 'slurm-31.out'}",
    ]
