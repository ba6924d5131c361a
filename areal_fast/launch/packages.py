"""The optional packages a config asks for, checked before anything is written.

``pip install areal_fast`` installs what the default job needs; a setting that needs more
(peft for ``actor.lora.rank > 0``, vLLM or SGLang for ``rollout.engine``, Ray for
``scheduler.type=ray``, TensorBoard or wandb for ``logging.*``, ``datasets`` for a Hugging
Face dataset) names its package here. :func:`check_packages` runs first in ``areal-fast
train`` and ``areal-fast eval``: a missing package ends the command with one line naming the
key and the pip command, exit code 2, before a run directory exists, rather than in a worker
process after the job has started.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from areal_fast.launch.config import ConfigError, ExperimentConfig


@dataclass(frozen=True)
class Need:
    """One optional package a setting needs.

    Attributes
    ----------
    setting : str
        The key and its value as the message shows them (``"actor.lora.rank = 16"``).
    module : str
        The import name looked for (``"peft"``).
    extra : str or None
        The extra of areal_fast that installs it (``pip install 'areal_fast[lora]'``).
    install : str or None
        The whole sentence on what to install, where pip alone does not say it (vLLM on a
        CPU machine); None: the pip command built from the extra's bounds.
    """

    setting: str
    module: str
    extra: str | None = None
    install: str | None = None


def needed(cfg: ExperimentConfig, training: bool = True) -> list[Need]:
    """Every optional package ``cfg`` needs; ``training`` False (``areal-fast eval``) leaves
    out what only the trainer and the run's logging sinks use."""
    r, needs = cfg.rollout, []
    if training and cfg.actor.lora.enabled:
        needs.append(Need(f"actor.lora.rank = {cfg.actor.lora.rank}", "peft", "lora"))
    if r.engine == "vllm" or (r.engine == "vllm_server" and not r.server_url):
        from areal_fast.rollout.vllm_async import VLLM_MISSING

        needs.append(Need("", "vllm", "vllm", VLLM_MISSING.format(engine=r.engine)))
    if r.engine == "sglang_server":
        needs.append(
            Need(
                "",
                "sglang",
                install="rollout.engine = 'sglang_server' needs SGLang in the rollout workers "
                "too (its serializer packs the weight updates), which is not installed: "
                "pip install sglang",
            )
        )
    if cfg.scheduler.type == "ray":
        needs.append(Need("scheduler.type = 'ray'", "ray", "ray"))
    if training and cfg.logging.tensorboard:
        needs.append(Need("logging.tensorboard = true", "tensorboard", "tensorboard"))
    if training and cfg.logging.wandb.mode != "disabled":
        needs.append(Need(f"logging.wandb.mode = {cfg.logging.wandb.mode!r}", "wandb", "wandb"))
    needs += _data_needs(cfg)
    return needs


def _data_needs(cfg: ExperimentConfig) -> list[Need]:
    """``datasets`` for ``data.task=hf`` and for GSM8K read from the hub by its id."""
    from areal_fast.data.gsm8k import is_dataset_id
    from areal_fast.data.tasks import GSM8K_DEFAULT_SOURCE

    d = cfg.data
    if d.task == "hf":
        return [Need("data.task = 'hf'", "datasets")]
    source = d.path or GSM8K_DEFAULT_SOURCE
    if d.task == "gsm8k" and is_dataset_id(source):
        what = f"data.task = 'gsm8k' with data.path = {source!r} (a Hugging Face dataset id)"
        return [Need(what, "datasets")]
    return []


def check_packages(cfg: ExperimentConfig, training: bool = True) -> None:
    """Fail on the first optional package ``cfg`` needs (see :func:`needed`) that is not
    installed; changes nothing.

    Raises
    ------
    ConfigError
        One line: the key and value, the package and the pip command, e.g. ``actor.lora.rank
        = 16 needs the peft package, which is not installed: pip install 'peft>=0.21,<0.22'
        (or pip install 'areal_fast[lora]')``.
    """
    for need in needed(cfg, training):
        if importlib.util.find_spec(need.module) is not None:
            continue
        if need.install:
            raise ConfigError(need.install)
        command = f"pip install '{requirement(need.module, need.extra)}'"
        if need.extra:
            command += f" (or pip install 'areal_fast[{need.extra}]')"
        raise ConfigError(
            f"{need.setting} needs the {need.module} package, which is not installed: {command}"
        )


def requirement(name: str, extra: str | None) -> str:
    """``name`` with the version bounds the extra ``extra`` of areal_fast gives it
    (``peft>=0.21,<0.22``), read from the installed package's metadata; ``name`` alone
    without an extra or metadata."""
    from importlib.metadata import PackageNotFoundError, requires

    if extra is None:
        return name
    try:
        declared = requires("areal_fast") or []
    except PackageNotFoundError:
        return name
    for line in declared:
        spec, _, marker = line.partition(";")
        found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", spec)
        if found and found.group(1) == name and re.search(rf"extra == ['\"]{extra}['\"]", marker):
            bounds = sorted(found.group(2).replace(" ", "").split(","), key=_lower_bound_first)
            return name + ",".join(b for b in bounds if b)
    return name


def _lower_bound_first(bound: str) -> tuple[bool, str]:
    """Sort key: ``>=`` / ``>`` bounds before the others (``peft>=0.21,<0.22``)."""
    return (not bound.startswith(">"), bound)
