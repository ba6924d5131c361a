"""A run directory's jobs file (``slurm/jobs``) and what ``squeue`` says of a job: the newest
job id whatever the file's junk lines, a live state only while the job is queued, and a
failing or missing Slurm command reported rather than raised."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from areal_fast.launch.slurm.jobs import last_job, live_state, query, record_job


def _squeue(folder: Path, out: str, monkeypatch, code: int = 0) -> None:
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / "squeue"
    path.write_text(
        f"#!/bin/sh\nprintf %s {shlex.quote(out)}\necho 'squeue: error: no answer' >&2\n"
        f"exit {code}\n"
    )
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_the_newest_job_id_survives_junk_lines(tmp_path):
    assert last_job(tmp_path) is None
    (tmp_path / "slurm").mkdir()
    record_job(tmp_path, "41")
    record_job(tmp_path, "42", "started")
    lines = (tmp_path / "slurm" / "jobs").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["41", "42"]
    assert lines[1].split()[2] == "started"
    assert last_job(tmp_path) == "42"
    with open(tmp_path / "slurm" / "jobs", "a") as jobs:
        jobs.write("\n   \ngarbage line\n")
    assert last_job(tmp_path) == "42"
    (tmp_path / "slurm" / "jobs").write_text("")
    assert last_job(tmp_path) is None


def test_live_state_only_while_queued(tmp_path, monkeypatch):
    for out, state in [("RUNNING\n", "RUNNING"), ("PENDING", "PENDING"), ("", None)]:
        _squeue(tmp_path, out, monkeypatch)
        assert live_state("7") == state
    _squeue(tmp_path, "", monkeypatch, code=1)  # an old job: squeue refuses its id
    assert live_state("7") is None
    assert query(["squeue", "-j", "7"]) == (False, "squeue: error: no answer")
    assert query(["no-such-slurm-command"]) == (False, "no-such-slurm-command is not on PATH")
