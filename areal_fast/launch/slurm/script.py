"""The batch script ``areal-fast submit`` writes into ``<run dir>/slurm/job.sbatch``.

A plain bash script a user can read and submit again by hand (``sbatch job.sbatch``). It
``exec``s the launcher, so the launcher is the batch step's main process: Slurm's SIGTERM
(``scancel``, the time limit's ``--signal=B:TERM@<lead>``, a requeue or a preemption) reaches
it directly and the run stops as on Ctrl-C; the job's exit code is the launcher's (143).
A first start trains from step 0; every later start of the job (a requeue) or a start in a
run directory that already holds a run passes ``resume=true``.

With one node the launcher starts the workers as local processes. With several it starts a
Ray cluster over the allocation first (head on this node, the others joined with ``srun``;
:mod:`areal_fast.launch.slurm.ray_nodes` waits for them) and runs the Ray launcher there.

Every value in the script comes from a checked :class:`~.config.SlurmConfig` field and is
quoted with :func:`shlex.quote`; the script evaluates no string built from user data.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from areal_fast.launch.slurm.config import SlurmConfig

SLURM_DIR = "slurm"  # folder of the run directory with the script, its config and the logs
SCRIPT_NAME = "job.sbatch"
CONFIG_NAME = "config.yaml"  # the run's config, as the job reads it
LOG_PATTERN = "slurm-%j.out"  # Slurm's log of each job (%j: the job id), appended on requeue


def render_script(slurm: SlurmConfig, run_dir: Path, workdir: Path, trial_name: str) -> str:
    """The batch script's text.

    Parameters
    ----------
    slurm : SlurmConfig
        The checked ``slurm.*`` section.
    run_dir : Path
        Absolute run directory (no whitespace or quotes: ``#SBATCH`` values are not quoted).
    workdir : Path
        Absolute working directory of the job (``--chdir``), where relative paths of the
        config resolve: the directory ``areal-fast submit`` ran in.
    trial_name : str
        Names the job when ``slurm.job_name`` is None.
    """
    folder = run_dir / SLURM_DIR
    options = [
        *slurm.sbatch_options(trial_name),
        f"--output={folder / LOG_PATTERN}",
        "--open-mode=append",
        f"--chdir={workdir}",
    ]
    lines = [
        "#!/bin/bash",
        f"# areal-fast run {run_dir}: written by `areal-fast submit`; resubmit with",
        f"#   sbatch {folder / SCRIPT_NAME}",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        *_environment_lines(slurm),
        f"python={shlex.quote(_python(slurm))}",
        f"run_dir={shlex.quote(str(run_dir))}",
        'echo "areal-fast: Slurm job ${SLURM_JOB_ID:-?} on $(hostname),'
        ' start ${SLURM_RESTART_COUNT:-0}, $(date -Is)"',
        "# a job requeued after its run finished has nothing left to do",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$run_dir/summary.json" ]; then',
        '  echo "areal-fast: the run has finished (summary.json): nothing to do"; exit 0',
        "fi",
        "# a requeued job, or a run directory that holds a run already, resumes the run",
        'if [ -f "$run_dir/config.yaml" ]; then resume=(resume=true); else resume=(); fi',
        f'args=(train --config "$run_dir/{SLURM_DIR}/{CONFIG_NAME}" --no-progress)',
        *_launch_lines(slurm),
    ]
    return "\n".join(lines) + "\n"


def _python(slurm: SlurmConfig) -> str:
    """The job's interpreter: ``slurm.python``, the venv's, or the submitting one."""
    import sys

    if slurm.python:
        return slurm.python
    if slurm.venv:
        return str(Path(slurm.venv) / "bin" / "python")
    return sys.executable


def _environment_lines(slurm: SlurmConfig) -> list[str]:
    """``module load``, the venv's activation and the exports, each value quoted."""
    lines = [f"module load {shlex.quote(name)}" for name in slurm.modules]
    if slurm.venv:
        activate = shlex.quote(str(Path(slurm.venv) / "bin" / "activate"))
        lines += ["set +u", f"source {activate}", "set -u"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in slurm.env.items()]
    return lines


def _launch_lines(slurm: SlurmConfig) -> list[str]:
    """One node: ``exec`` the local launcher. Several: a Ray cluster, then the Ray launcher."""
    if slurm.nodes == 1:
        return ['exec "$python" -m areal_fast.cli "${args[@]}" ${resume[@]+"${resume[@]}"}']
    gpus = slurm.gpus_per_node
    return [
        "# a Ray cluster over the allocation: head here, srun joins the other nodes",
        "head_ip=$(hostname --ip-address | cut -d' ' -f1)",
        "cpus=${SLURM_CPUS_ON_NODE:-1}",
        'port=$("$python" -m areal_fast.launch.slurm.ray_nodes --free-port)',
        f'"$python" -m ray.scripts.scripts start --head --node-ip-address="$head_ip" '
        f'--port="$port" --num-cpus="$cpus" --num-gpus={gpus} --disable-usage-stats',
        f'srun --nodes=$((SLURM_JOB_NUM_NODES - 1)) --ntasks-per-node=1 --exclude="$(hostname)" '
        f'--overlap "$python" -m ray.scripts.scripts start --address="$head_ip:$port" '
        f'--num-cpus="$cpus" --num-gpus={gpus} --block --disable-usage-stats &',
        '"$python" -m areal_fast.launch.slurm.ray_nodes --address "$head_ip:$port" '
        '--wait "$SLURM_JOB_NUM_NODES"',
        'export RAY_ADDRESS="$head_ip:$port"',
        'exec "$python" -m areal_fast.launch.ray "${args[@]}" scheduler.ray_address=auto '
        '${resume[@]+"${resume[@]}"}',
    ]
