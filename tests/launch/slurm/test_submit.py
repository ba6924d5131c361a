"""``areal-fast submit`` without a cluster (a stand-in ``sbatch``): the ``slurm.*`` checks and
the one-line errors for a misspelt key, a missing sbatch or Slurm's refusal, with nothing left
written; the files it writes and the run directory the job then starts in."""

from __future__ import annotations

import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.launch.config import load_config
from areal_fast.launch.run_dir import check_run_dir, prepare_run_dir

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "examples" / "arith.yaml")


def _fake_sbatch(folder: Path, stdout: str, stderr: str = "", code: int = 0) -> Path:
    """An ``sbatch`` stand-in that records its arguments and answers as told."""
    path = folder / "sbatch"
    path.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {shlex.quote(str(folder / "args"))}\n'
        f"printf %s {shlex.quote(stdout)}\n"
        f"printf %s {shlex.quote(stderr)} >&2\n"
        f"exit {code}\n"
    )
    path.chmod(0o755)
    return path


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
        ("slurm.env={'A-B': x}", "slurm.env: 'A-B' is not an environment variable name"),
    ],
)
def test_bad_slurm_values_are_refused_naming_the_key(tmp_path, item, message):
    with pytest.raises(ValueError) as info:
        load_config(CONFIG, [f"fileroot={tmp_path}", item])
    assert message in str(info.value)


def test_submit_writes_the_script_and_config_then_sbatch_takes_it(tmp_path, capsys):
    sbatch = _fake_sbatch(tmp_path, "4242;cluster\n")
    args = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", "trial_name=t"]
    assert main([*args, f"slurm.sbatch={sbatch}", "slurm.partition=debug"]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "grpo-arith" / "t"
    assert out.splitlines()[0] == f"submitted Slurm job 4242: {run_dir / 'slurm' / 'job.sbatch'}"
    assert f"log: {run_dir / 'slurm' / 'slurm-4242.out'}" in out
    assert sorted(p.name for p in (run_dir / "slurm").iterdir()) == [
        "config.yaml",
        "job.sbatch",
        "jobs",
    ]
    assert (tmp_path / "args").read_text().split() == [
        "--parsable",
        str(run_dir / "slurm" / ".job.sbatch.new"),
    ]
    assert stat.S_IMODE((run_dir / "slurm").stat().st_mode) == 0o700
    job_cfg = load_config(str(run_dir / "slurm" / "config.yaml"))
    assert job_cfg.slurm.partition == "debug" and job_cfg.run_dir == run_dir
    # the job starts in the submitted directory (it holds only slurm/) as in a new one
    check_run_dir(job_cfg)
    assert prepare_run_dir(job_cfg) == run_dir and (run_dir / "slurm" / "jobs").is_file()


def test_a_second_submission_before_the_first_started_is_refused(tmp_path, capsys):
    sbatch = _fake_sbatch(tmp_path, "7\n")
    args = ["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "job 7 was submitted into run directory" in err and "scancel 7" in err
    assert main([*args, "overwrite=true"]) == 0  # the user cancelled it: replaced


def test_sbatch_refusal_is_one_line_and_leaves_nothing(tmp_path, capsys):
    refusal = (
        "sbatch: error: invalid partition specified: nosuch\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    )
    sbatch = _fake_sbatch(tmp_path, "", refusal, code=1)
    code = main(["submit", "--config", CONFIG, f"fileroot={tmp_path}", f"slurm.sbatch={sbatch}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "areal-fast: error: Slurm refused the job: Batch job submission failed: "
        "Invalid partition name specified"
    )
    assert not (tmp_path / "grpo-arith").exists()


def test_cli_help_lists_submit():
    out = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", "submit", "--help"],
        capture_output=True,
        text=True,
        cwd=str(Path("/")),
    ).stdout
    assert "--status RUN_DIR" in out and "slurm." in out
