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


def _stand_in(folder: Path, name: str, out: str, code: int = 0, err: str = "") -> None:
    path = folder / name
    path.write_text(
        f"#!/bin/sh\nprintf %s {shlex.quote(out)}\nprintf %s {shlex.quote(err)} >&2\nexit {code}\n"
    )
    path.chmod(0o755)


@pytest.mark.parametrize(
    "squeue,scontrol,state",
    [
        ("RUNNING|None|1:02|node7\n", "", "job 31: RUNNING on node7 for 1:02"),
        ("PENDING|Priority|0:00|\n", "", "job 31: PENDING (Priority)"),
        (
            "",
            "JobId=31 JobState=CANCELLED Restarts=1 ExitCode=143:0",
            "CANCELLED (exit 143: stopped on SIGTERM, 1 requeues)",
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


def test_status_says_why_slurm_cannot_tell_and_shows_a_failed_job_log(
    tmp_path, monkeypatch, capsys
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    error = "squeue: error: Unable to contact slurm controller (connect failure)\n"
    _stand_in(bin_dir, "squeue", "", code=1, err=error)
    _stand_in(bin_dir, "scontrol", "", code=1, err="scontrol: error: connect failure\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs").write_text("5 2026-12-07T01:00:00+0000 submitted\n")
    assert main(["submit", "--status", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "job 5: unknown: Slurm did not answer (squeue: error: Unable to contact slurm "
        "controller (connect failure))",
        "run: not started",
    ]
    # a job that failed before the run began: its log's last line says why
    _stand_in(bin_dir, "squeue", "")
    _stand_in(bin_dir, "scontrol", "JobId=5 JobState=FAILED ExitCode=1:0")
    (run / "slurm" / "slurm-5.out").write_text("start\n/x/bin/activate: No such file\n")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--status", "run"]) == 0  # a relative directory
    assert capsys.readouterr().out.splitlines() == [
        "job 5: FAILED (exit 1)",
        "run: not started",
        "log's last line: /x/bin/activate: No such file",
        f"log: {run / 'slurm' / 'slurm-5.out'}",
    ]


def test_status_takes_no_overrides(tmp_path, capsys):
    assert main(["submit", "--status", str(tmp_path), "total_steps=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "areal-fast submit: error: --status takes no key=value items: total_steps=3"
    )
