"""``areal-fast submit`` without a cluster (a stand-in ``sbatch``): the ``slurm.*`` checks and
the one-line errors for a misspelt key, a missing sbatch or Slurm's refusal, with nothing left
written; the files it writes and the run directory the job then starts in."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.launch.config import load_config
from areal_fast.launch.run_dir import check_run_dir, prepare_run_dir, release_run_dir

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "examples" / "arith.yaml")


def _fake_sbatch(folder: Path, stdout: str, stderr: str = "", code: int = 0) -> Path:
    """An ``sbatch`` stand-in that records its arguments and the folder of the script it was
    given (``seen``: what the job would find when it starts at once), and answers as told."""
    path = folder / "sbatch"
    seen = shlex.quote(str(folder / "seen"))
    path.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {shlex.quote(str(folder / "args"))}\n'
        f'rm -rf {seen}; cp -r "$(dirname "$2")" {seen}\n'
        f"printf %s {shlex.quote(stdout)}\n"
        f"printf %s {shlex.quote(stderr)} >&2\n"
        f"exit {code}\n"
    )
    path.chmod(0o755)
    return path


def _fake_squeue(folder: Path, state: str, monkeypatch) -> None:
    """A ``squeue`` stand-in on PATH that says every job is in ``state`` ("" : gone)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / "squeue"
    path.write_text(f"#!/bin/sh\nprintf %s {shlex.quote(state)}\n")
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_a_misspelt_slurm_key_gets_did_you_mean_and_writes_nothing(tmp_path, capsys):
    code = main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", "slurm.partiton=gpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "unknown config key 'slurm.partiton'; did you mean 'slurm.partition'?" in err
    assert list(tmp_path.iterdir()) == []


def test_missing_sbatch_is_one_line_naming_the_key(tmp_path, capsys):
    code = main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", "slurm.sbatch=no-sbatch"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("areal-fast: error: slurm.sbatch: 'no-sbatch' is not found on PATH")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "item,message",
    [
        ("slurm.time=2h", "slurm.time = '2h' is not a Slurm time limit"),
        ("slurm.partition='a b'", "slurm.partition = 'a b' must be one word"),
        ("slurm.nodes=0", "slurm.nodes = 0 must be >= 1"),
        ("slurm.mem=lots", "slurm.mem = 'lots' is not a size"),
        ("slurm.extra_sbatch=[constraint]", "slurm.extra_sbatch[0] = 'constraint' is not one"),
        ("slurm.extra_sbatch=[--array=0-3]", "'--array=0-3': not here (one run per job)"),
        ("slurm.extra_sbatch=[-pgpu]", "'-pgpu': not here (set slurm.partition)"),
        (("slurm.placement=local", "slurm.nodes=2"), "placement = 'local' starts every worker"),
        ("slurm.env={'A-B': x}", "slurm.env: 'A-B' is not an environment variable name"),
    ],
)
def test_bad_slurm_values_are_refused_naming_the_key(tmp_path, item, message):
    with pytest.raises(ValueError) as info:
        load_config(
            CONFIG, [f"fileroot={tmp_path}", *(item if isinstance(item, tuple) else [item])]
        )
    assert message in str(info.value)


def test_submit_writes_the_script_and_config_then_sbatch_takes_it(tmp_path, capsys):
    sbatch = _fake_sbatch(tmp_path, "4242;cluster\n")
    args = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", "trial_name=t"]
    assert main([*args, f"slurm.sbatch={sbatch}", "slurm.partition=debug"]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "grpo-arith" / "t"
    script = run_dir / "slurm" / "job.sbatch"
    assert out.splitlines()[0] == f"submitted Slurm job 4242: {script}"
    assert f"log: {run_dir / 'slurm' / 'slurm-4242.out'}" in out
    assert sorted(p.name for p in (run_dir / "slurm").iterdir()) == [
        "config.yaml",
        "job.sbatch",
        "jobs",
    ]
    assert (tmp_path / "args").read_text().split() == ["--parsable", str(script)]
    # the config and the script were in place when sbatch ran: a job may start at once
    seen = tmp_path / "seen"
    assert (seen / "config.yaml").read_text() == (run_dir / "slurm" / "config.yaml").read_text()
    assert (seen / "job.sbatch").read_text() == script.read_text()
    assert stat.S_IMODE((run_dir / "slurm").stat().st_mode) == 0o700
    assert (run_dir / "slurm" / "jobs").read_text().split()[::2] == ["4242", "submitted"]
    job_cfg = load_config(str(run_dir / "slurm" / "config.yaml"))
    assert job_cfg.slurm.partition == "debug" and job_cfg.run_dir == run_dir
    # the job starts in the submitted directory (it holds only slurm/) as in a new one
    check_run_dir(job_cfg)
    assert prepare_run_dir(job_cfg) == run_dir and (run_dir / "slurm" / "jobs").is_file()
    release_run_dir(run_dir)


def test_a_job_still_queued_keeps_its_run_directory(tmp_path, capsys, monkeypatch):
    sbatch = _fake_sbatch(tmp_path, "7\n")
    args = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"]
    assert main(args) == 0
    capsys.readouterr()
    for state in ("PENDING", "RUNNING"):
        _fake_squeue(tmp_path, state, monkeypatch)
        for extra in ([], ["overwrite=true"]):
            assert main([*args, *extra]) == 2
            err = capsys.readouterr().err
            assert f"job 7 ({state}) still uses run directory" in err and "scancel 7" in err
    _fake_squeue(tmp_path, "", monkeypatch)  # it has left the queue: submitted again
    assert main(args) == 0
    jobs = (tmp_path / "grpo-arith" / "trial0" / "slurm" / "jobs").read_text().splitlines()
    assert [line.split()[0] for line in jobs] == ["7", "7"]


def test_sbatch_refusal_is_one_line_and_leaves_nothing(tmp_path, capsys):
    refusal = (
        "sbatch: error: invalid partition specified: nosuch\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    )
    sbatch = _fake_sbatch(tmp_path, "", refusal, code=1)
    code = main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "areal-fast: error: sbatch failed: Batch job submission failed: "
        "Invalid partition name specified"
    )
    assert not (tmp_path / "grpo-arith").exists()


@pytest.mark.parametrize(
    "stderr,line",
    [
        ("sbatch: unrecognized option '--bogus'\nTry \"sbatch --help\" for more information\n",
         "unrecognized option '--bogus'"),
        ("sbatch: error: _establish_config_source: failed to fetch config\n"
         "sbatch: fatal: Could not establish a configuration source\n",
         "Could not establish a configuration source"),
    ],
)  # fmt: skip
def test_the_telling_line_of_sbatch_is_shown(tmp_path, capsys, stderr, line):
    sbatch = _fake_sbatch(tmp_path, "", stderr, code=1)
    code = main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"areal-fast: error: sbatch failed: {line}"


def test_a_refused_overwrite_keeps_the_old_run(tmp_path, capsys):
    run_dir = tmp_path / "grpo-arith" / "trial0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("{}")
    (run_dir / "summary.json").write_text('{"steps": 300}')
    sbatch = _fake_sbatch(tmp_path, "", "sbatch: error: Invalid partition name specified\n", 1)
    args = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"]
    assert main([*args, "overwrite=true"]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "summary.json"]
    assert [p.name for p in run_dir.parent.iterdir()] == ["trial0"]  # nothing moved aside
    taken = _fake_sbatch(tmp_path, "8\n")
    assert main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={taken}",
                 "overwrite=true"]) == 0  # fmt: skip
    assert sorted(p.name for p in run_dir.iterdir()) == ["slurm"]  # the old run is replaced
    assert [p.name for p in run_dir.parent.iterdir()] == ["trial0"]


def test_paths_an_sbatch_line_cannot_hold_and_missing_environments_are_refused(
    tmp_path, capsys, monkeypatch
):
    sbatch = str(_fake_sbatch(tmp_path, "9\n"))
    base = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"]
    cases = [
        ([f"slurm.venv={tmp_path}/nowhere"], f"slurm.venv: {tmp_path}/nowhere/bin/activate"),
        (["slurm.python=/no/python"], "slurm.python: '/no/python' is not an executable here"),
        ([f"fileroot={tmp_path}/a b"], "fileroot: run directory"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    spaced = tmp_path / "a dir"
    spaced.mkdir()
    monkeypatch.chdir(spaced)
    assert main(base) == 2
    assert f"the working directory {spaced} has whitespace" in capsys.readouterr().err
    assert not (tmp_path / "grpo-arith").exists()


def test_cli_help_lists_submit():
    out = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", "submit", "--help"],
        capture_output=True,
        text=True,
        cwd=str(Path("/")),
    ).stdout
    assert "--status RUN_DIR" in out and "slurm." in out
