"""The ``slurm.*`` section of an experiment config: what ``areal-fast submit`` asks Slurm for.

Each field becomes one ``#SBATCH`` option of the batch script
(:mod:`areal_fast.launch.slurm.script`) or one line of its set-up; ``areal-fast train``
ignores the section. Every value is checked here, before anything is written or submitted:
a value that would break the script (whitespace or a control character in an option, an
environment name that is no shell identifier) is refused with one line naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from areal_fast._checks import at_least

# Slurm's --time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
_TIME = re.compile(r"^((\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|unlimited|INFINITE|infinite)$")
_MEMORY = re.compile(r"^\d+([KMGTkmgt][Bb]?)?$")
# options the script sets itself or that have a key of their own: not in extra_sbatch
_SCRIPT = "the script sets it"
_OWN_OPTIONS = {
    "--output": _SCRIPT, "-o": _SCRIPT, "--error": _SCRIPT, "-e": _SCRIPT,
    "--open-mode": _SCRIPT, "--chdir": _SCRIPT, "-D": _SCRIPT,
    "--ntasks": "one task per node", "-n": "one task per node",
    "--ntasks-per-node": "one task per node", "--array": "one run per job", "-a": "one run per job",
    "--signal": "set slurm.signal_lead", "--requeue": "set slurm.requeue",
    "--no-requeue": "set slurm.requeue", "--nodes": "set slurm.nodes", "-N": "set slurm.nodes",
    "--partition": "set slurm.partition", "-p": "set slurm.partition",
    "--account": "set slurm.account", "-A": "set slurm.account", "--qos": "set slurm.qos",
    "-q": "set slurm.qos", "--time": "set slurm.time", "-t": "set slurm.time",
    "--mem": "set slurm.mem", "--gpus-per-node": "set slurm.gpus_per_node",
    "--cpus-per-task": "set slurm.cpus_per_task", "-c": "set slurm.cpus_per_task",
    "--job-name": "set slurm.job_name", "-J": "set slurm.job_name",
}  # fmt: skip
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# a value of an #SBATCH line: no whitespace, quote, backslash or control character
_PLAIN = re.compile(r"^[^\s'\"\\\x00-\x1f\x7f]+$")


@dataclass
class SlurmConfig:
    """A Slurm batch job running the experiment (``areal-fast submit``).

    Mirrors sbatch's options of the same names (slurm.schedmd.com/sbatch.html); None leaves
    an option to the cluster's defaults. Raises ``ValueError`` naming the key for a value
    that is out of range or would not be one plain word in the script.
    """

    partition: Optional[str] = None  # sbatch --partition; None: the cluster's default
    account: Optional[str] = None  # sbatch --account (the allocation charged)
    qos: Optional[str] = None  # sbatch --qos
    nodes: int = 1  # nodes of the allocation (sbatch --nodes)
    # how the job places its workers: "local" processes on the one node, or "ray": a Ray
    # cluster over the allocation (head on the first node, `srun` joins the others) and the
    # Ray launcher; None: local with one node, ray with more (docs/scale-out.md, Slurm)
    placement: Optional[str] = None
    gpus_per_node: int = 0  # sbatch --gpus-per-node (0: none asked for)
    cpus_per_task: Optional[int] = None  # sbatch --cpus-per-task (one task per node)
    mem: Optional[str] = None  # sbatch --mem per node, e.g. "64G"; "0": all of it
    time: Optional[str] = None  # sbatch --time: "MM", "HH:MM:SS" or "D-HH:MM:SS"
    job_name: Optional[str] = None  # sbatch --job-name; None: areal-fast-<trial_name>
    # seconds before the time limit at which Slurm sends SIGTERM to the job, which then
    # stops cleanly (checkpoint in progress finished, INTERRUPTED, exit 143); 0: none
    signal_lead: int = 180
    # requeue the job on preemption or node failure (sbatch --requeue): the requeued job
    # resumes from the run's newest complete checkpoint
    requeue: bool = True
    # further options, one #SBATCH line each, e.g. ["--constraint=a100", "--exclusive"]
    extra_sbatch: List[str] = field(default_factory=list)
    venv: Optional[str] = None  # virtual environment the job activates (its bin/activate)
    modules: List[str] = field(default_factory=list)  # `module load` names, in order
    env: Dict[str, str] = field(default_factory=dict)  # variables the job exports
    # Python of the job; None: python of slurm.venv, else the interpreter that submits
    python: Optional[str] = None
    sbatch: str = "sbatch"  # the sbatch command (a name on PATH or a path)

    def __post_init__(self):
        """Check every field (see the class docstring)."""
        for name in ("partition", "account", "qos", "job_name", "mem"):
            _check_plain(name, getattr(self, name))
        at_least("nodes", self.nodes, 1)
        if self.placement not in (None, "local", "ray"):
            raise ValueError(f"placement = {self.placement!r} is not 'local', 'ray' or null")
        if self.placement == "local" and self.nodes > 1:
            raise ValueError(
                f"placement = 'local' starts every worker on the first node, so nodes = "
                f"{self.nodes} would leave {self.nodes - 1} idle; use placement = ray"
            )
        at_least("gpus_per_node", self.gpus_per_node, 0)
        if self.cpus_per_task is not None:
            at_least("cpus_per_task", self.cpus_per_task, 1)
        if self.mem is not None and not _MEMORY.match(self.mem):
            raise ValueError(f"mem = {self.mem!r} is not a size such as 64G, 512MB or 0")
        if self.time is not None and not _TIME.match(self.time):
            raise ValueError(
                f"time = {self.time!r} is not a Slurm time limit (MM, HH:MM:SS or D-HH:MM:SS)"
            )
        if not 0 <= self.signal_lead <= 65535:
            raise ValueError(f"signal_lead = {self.signal_lead} must be 0 to 65535 seconds")
        for i, line in enumerate(self.extra_sbatch):
            _check_extra(i, line)
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"env: {name!r} is not an environment variable name")
        for i, module in enumerate(self.modules):
            _check_plain(f"modules[{i}]", module)

    @property
    def on_ray(self) -> bool:
        """Whether the job starts a Ray cluster and the Ray launcher."""
        return self.placement == "ray" or (self.placement is None and self.nodes > 1)

    def sbatch_options(self, trial_name: str) -> List[str]:
        """The ``--name=value`` options of the script's ``#SBATCH`` lines, in order (the
        log, the working directory and the signal are the script's own)."""
        options = [f"--job-name={self.job_name or f'areal-fast-{trial_name}'}"]
        for name in ("partition", "account", "qos", "time", "mem"):
            if getattr(self, name) is not None:
                options.append(f"--{name}={getattr(self, name)}")
        options += [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        if self.cpus_per_task is not None:
            options.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.gpus_per_node:
            options.append(f"--gpus-per-node={self.gpus_per_node}")
        options.append("--requeue" if self.requeue else "--no-requeue")
        if self.signal_lead:
            options.append(f"--signal=B:TERM@{self.signal_lead}")
        return options + list(self.extra_sbatch)


def _check_plain(name: str, value: Optional[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is None or one plain word."""
    if value is not None and not _PLAIN.match(value):
        raise ValueError(
            f"{name} = {value!r} must be one word without spaces, quotes or control characters"
        )


def _check_extra(index: int, option: str) -> None:
    """Raise ``ValueError`` unless ``option`` is one sbatch option the script leaves open."""
    if not (option.startswith("-") and _PLAIN.match(option.replace('"', ""))):
        raise ValueError(
            f"extra_sbatch[{index}] = {option!r} is not one sbatch option such as "
            f"--constraint=a100 (one option per entry, no spaces)"
        )
    name = option.split("=", 1)[0]
    if not name.startswith("--"):
        name = name[:2]  # a short option with its value attached: -pdebug
    if name in _OWN_OPTIONS:
        raise ValueError(f"extra_sbatch[{index}] = {option!r}: not here ({_OWN_OPTIONS[name]})")
