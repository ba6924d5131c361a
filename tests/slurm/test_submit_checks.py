"""``areal-fast submit`` without a cluster: the ``slurm.*`` checks, the batch script it writes
(quoting, both launch paths valid bash), what it leaves on disk when sbatch takes or refuses
the job (a stand-in ``sbatch`` script), and the one-line errors for a misspelt key and a
missing sbatch, with nothing written."""

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
from areal_fast.launch.run_dir import check_run_dir, prepare_run_dir
from areal_fast.launch.slurm.config import SlurmConfig
from areal_fast.launch.slurm.script import render_script

REPO = Path(__file__).resolve().parents[2]
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


def test_the_script_quotes_every_value_and_is_valid_bash(tmp_path):
    hostile = "$(touch /tmp/pwned); `id` 'q' \"d\""
    slurm = SlurmConfig(
        partition="gpu",
        account="proj-1",
        time="1-02:00:00",
        gpus_per_node=2,
        venv=str(tmp_path / "my venv"),
        modules=["cuda/12.4"],
        env={"HF_HOME": hostile},
        extra_sbatch=["--constraint=h100"],
    )
    text = render_script(slurm, tmp_path / "run", tmp_path, "t1")
    assert "#SBATCH --partition=gpu\n#SBATCH --account=proj-1\n#SBATCH --time=1-02:00:00" in text
    assert "#SBATCH --gpus-per-node=2" in text and "#SBATCH --signal=B:TERM@180" in text
    assert "#SBATCH --constraint=h100" in text and "#SBATCH --requeue" in text
    assert f"export HF_HOME={shlex.quote(hostile)}" in text
    assert f"source {shlex.quote(str(tmp_path / 'my venv' / 'bin' / 'activate'))}" in text
    for nodes in (1, 3):
        script = tmp_path / f"job{nodes}.sbatch"
        slurm.nodes = nodes
        script.write_text(render_script(slurm, tmp_path / "run", tmp_path, "t1"))
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert "areal_fast.launch.ray" in script.read_text()  # several nodes: the Ray launcher


def test_the_script_runs_the_launcher_and_resumes_a_started_run(tmp_path):
    """The one-node script, run by bash with a stand-in python: the first start trains, a
    start after config.yaml exists passes resume=true; the values reach it as arguments."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(SlurmConfig(python=str(python)), run_dir, tmp_path, "t"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    first = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    expected = ["-m", "areal_fast.cli", "train", "--config", f"{run_dir}/slurm/config.yaml"]
    assert first.stdout.splitlines()[1:] == [*expected, "--no-progress"], first
    (run_dir / "config.yaml").write_text("{}")
    again = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert again.stdout.splitlines()[1:] == [*expected, "--no-progress", "resume=true"], again


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


def test_status_needs_a_submitted_run(tmp_path, capsys):
    assert main(["submit", "--status", str(tmp_path)]) == 2
    assert "holds no job submitted by areal-fast submit" in capsys.readouterr().err


def test_cli_help_lists_submit():
    out = subprocess.run(
        [sys.executable, "-m", "areal_fast.cli", "submit", "--help"],
        capture_output=True,
        text=True,
        cwd=str(Path("/")),
    ).stdout
    assert "--status RUN_DIR" in out and "slurm." in out
