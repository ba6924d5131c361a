"""The batch script ``areal-fast submit`` writes into ``<run dir>/slurm/job.sbatch``.

A plain bash script a user can read and submit again by hand (``sbatch job.sbatch``). It
``exec``s the launcher, so the launcher is the batch step's main process: Slurm's SIGTERM
(``scancel``, the time limit's ``--signal=B:TERM@<lead>``, a requeue or a preemption) reaches
it directly and the run stops as on Ctrl-C; the job's exit code is the launcher's (143).
A first start trains from step 0; every later start of the job (a requeue) or a start in a
run directory that already holds a run passes ``resume=true``.

With ``slurm.placement = local`` (the default on one node) the launcher starts the workers as
local processes. With ``ray`` (the default on several nodes) the script starts a Ray cluster
over the allocation first (head on this node, the others joined with ``srun``;
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
        "# a job submitted by hand (sbatch job.sbatch) is recorded as it starts",
        f'jobs="$run_dir/{SLURM_DIR}/jobs"',
        'if [ -n "${SLURM_JOB_ID:-}" ] && ! grep -qs "^$SLURM_JOB_ID " "$jobs"; then',
        '  echo "$SLURM_JOB_ID $(date +%Y-%m-%dT%H:%M:%S%z) started" >> "$jobs"',
        "fi",
        "# a run that finished after this config was written has nothing left to do",
        f'if [ "$run_dir/summary.json" -nt "$run_dir/{SLURM_DIR}/{CONFIG_NAME}" ]; then',
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
    lines = []
    if slurm.modules:  # a batch shell is no login shell: `module` may need the profile
        lines.append("type module > /dev/null 2>&1 || { set +u; source /etc/profile; set -u; }")
    lines += [f"module load {shlex.quote(name)}" for name in slurm.modules]
    if slurm.venv:
        activate = shlex.quote(str(Path(slurm.venv) / "bin" / "activate"))
        lines += ["set +u", f"source {activate}", "set -u"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in slurm.env.items()]
    return lines


def _launch_lines(slurm: SlurmConfig) -> list[str]:
    """Local processes: ``exec`` the launcher. Ray: a Ray cluster, then the Ray launcher."""
    if not slurm.on_ray:
        return ['exec "$python" -m areal_fast.cli "${args[@]}" ${resume[@]+"${resume[@]}"}']
    gpus = slurm.gpus_per_node
    ray = '"$python" -m ray.scripts.scripts start'
    sizes = (
        f'--num-cpus="$cpus" --num-gpus={gpus} --temp-dir="$ray_dir" --disable-usage-stats --block'
    )
    return [
        "# a Ray cluster over the allocation: its head on this node, srun joins the others;",
        "# Ray's token authentication, the token made here and passed in the environment only",
        "export RAY_AUTH_MODE=token",
        'RAY_AUTH_TOKEN=$("$python" -c "import secrets; print(secrets.token_hex(32))")',
        "export RAY_AUTH_TOKEN",
        "head_ip=$(hostname -I 2> /dev/null | cut -d' ' -f1)",
        "[ -n \"$head_ip\" ] || head_ip=$(hostname --ip-address | cut -d' ' -f1)",
        "cpus=${SLURM_CPUS_ON_NODE:-1}",
        'ray_dir="/tmp/ray-areal-fast-${SLURM_JOB_ID:-$$}"',
        'port=$("$python" -m areal_fast.launch.slurm.ray_nodes --free-port)',
        f'{ray} --head --node-ip-address="$head_ip" --port="$port" {sizes} &',
        'if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then',
        '  srun --nodes=$((SLURM_JOB_NUM_NODES - 1)) --ntasks-per-node=1 --exclude="${SLURMD_NODENAME:-$(hostname)}" '
        f'--overlap {ray} --address="$head_ip:$port" {sizes} &',
        "fi",
        "# Ray's daemons leave the job's process tree: this job's are ended by their folder",
        "# (killed: on SIGTERM a Ray node drains for up to 30 s first)",
        """trap 'pkill -KILL -f -- "$ray_dir([ /]|\\$)" || true' EXIT""",
        '"$python" -m areal_fast.launch.slurm.ray_nodes --address "$head_ip:$port" '
        '--wait "${SLURM_JOB_NUM_NODES:-1}"',
        "# the launcher as a child, so that the trap runs: it gets the job's SIGTERM from here",
        '"$python" -m areal_fast.launch.ray "${args[@]}" "scheduler.ray_address=$head_ip:$port" '
        '${resume[@]+"${resume[@]}"} &',
        "launcher=$!",
        """trap 'kill -TERM "$launcher" 2> /dev/null || true' TERM INT""",
        "code=0",
        'while kill -0 "$launcher" 2> /dev/null; do wait "$launcher" || code=$?; done',
        'exit "$code"',
    ]
