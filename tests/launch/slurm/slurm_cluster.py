"""A one-node Slurm cluster for tests/launch/slurm: munged, slurmctld and slurmd started on this
machine from ``slurm.conf.in`` (beside this file) in a scratch folder, stopped afterwards.

Needs Debian's ``slurmctld slurmd slurm-client munge`` packages and root (slurmd runs jobs
as their users); :class:`Unavailable` says which is missing. Clients reach the cluster
through :attr:`SlurmCluster.env` (``SLURM_CONF``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).with_name("slurm.conf.in")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
START_TIMEOUT = 60.0  # seconds for the node to come up idle


class Unavailable(RuntimeError):
    """Slurm cannot run here; ``str()`` says why."""


@dataclass
class SlurmCluster:
    """A running cluster: its scratch folder and the environment its clients need."""

    root: Path
    env: dict

    def run(self, *command: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (output captured as text)."""
        return subprocess.run(
            list(command), capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def job_ids(self) -> list[str]:
        """Ids of the jobs pending or running."""
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return out.split()

    def job_field(self, job_id: str, name: str) -> str:
        """One field of ``scontrol show job`` (e.g. JobState, Restarts), "" if absent."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        return fields.get(name, "")

    def logs(self) -> str:
        """The last lines of slurmctld's and slurmd's logs (for a failure message)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.is_file():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(f.readline().split()[1])
    return int(total_kb / 1024 * 0.9)


def start(root: Path) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root``; wait for the node to be idle.

    Raises
    ------
    Unavailable
        A command is missing, this is not root, or a daemon did not come up (its log).
    """
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise Unavailable(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            f"apt-get install slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        raise Unavailable("slurmd must run as root to start jobs")
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o711)  # munged wants its socket folder reachable by all
    key = root / "munge" / "key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(
        TEMPLATE.read_text().format(
            root=root,
            host=socket.gethostname().split(".")[0],
            user=getpass.getuser(),
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            cpus=os.cpu_count(),
            memory_mb=_memory_mb(),
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root, env)
    munge = root / "munge"
    daemons = [
        ["munged", "--force", f"--socket={munge}/socket", f"--key-file={key}",
         f"--pid-file={munge}/pid", f"--seed-file={munge}/seed",
         f"--log-file={root}/log/munged.log"],
        ["slurmctld", "-f", str(conf)],
        ["slurmd", "-f", str(conf)],
    ]  # fmt: skip
    for command in daemons:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        if done.returncode != 0:
            raise Unavailable(f"{command[0]} did not start: {done.stderr.strip()[-500:]}")
    _wait_idle(cluster)
    return cluster


def _wait_idle(cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    state = ""
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "-h", "-o", "%T").stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise Unavailable(
        f"the node is {state or 'unknown'} after {START_TIMEOUT:g} s\n{cluster.logs()}"
    )


def stop(cluster: SlurmCluster) -> None:
    """Cancel every job, stop the daemons (their pid files), remove nothing else."""
    cluster.run("scancel", "--full", "--user", getpass.getuser())
    for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/pid"):
        path = cluster.root / pid_file
        try:
            os.kill(int(path.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
