"""LoRA adapter updates for vLLM: one PEFT adapter folder per weight version.

A LoRA trainer publishes, per adapted linear module ``m``, ``m.lora_A`` = A [r, in] and
``m.lora_B`` = B' = s · B [out, r] (:mod:`areal_fast.sync.adapter`).
:class:`VersionedAdapters` writes such an update as a PEFT adapter folder
(``adapter_config.json`` with ``lora_alpha = r``, so vLLM's scale alpha / r is 1 and B' is
used as it is; ``adapter_model.safetensors`` under peft's names
``base_model.model.<m>.lora_{A,B}.weight``) and names it by version: ``LoRARequest("v<k>",
k + 1, <folder>)``. The engine loads it with vLLM's ``add_lora`` and every request after it
carries that ``LoRARequest``; the base weights never change.

Source: vLLM 0.32 ``vllm/lora/request.py`` (``LoRARequest``), ``vllm/lora/peft_helper.py``
(the adapter config it reads), ``vllm/lora/utils.py`` (``parse_fine_tuned_lora_name``),
``vllm/config/lora.py`` (``MaxLoRARanks``); peft's adapter folder format.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from areal_fast.sync.adapter import LORA_A, group_adapter, split_adapter_name

# vLLM 0.32 accepts these max_lora_rank values only (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PEFT_PREFIX = "base_model.model."


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``.

    Raises
    ------
    ValueError
        ``rank`` < 1 or above vLLM's largest (512).
    """
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(
            f"actor.lora.rank = {rank}: vLLM serves LoRA ranks 1..{VLLM_LORA_RANKS[-1]}"
        )
    return fits[0]


def vllm_lora_args(rank: int) -> dict[str, Any]:
    """``AsyncEngineArgs`` fields that let vLLM serve adapters of rank ``rank``: LoRA on,
    ``max_lora_rank`` the smallest rank vLLM accepts that holds ``rank``, one adapter at a
    time in the batch (every request runs the newest version) and two kept loaded (the old
    one is removed right after the new one is in).

    Raises
    ------
    ValueError
        ``rank`` < 1 or above vLLM's largest (512).
    """
    return {
        "enable_lora": True,
        "max_lora_rank": vllm_lora_rank(rank),
        "max_loras": 1,
        "max_cpu_loras": 2,
    }


def _peft_names(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Adapter tensor name → peft's name, and the sorted short names of the adapted modules
    (peft's ``target_modules``)."""
    mapping, targets = {}, set()
    for name in names:
        module, suffix = split_adapter_name(name)
        mapping[name] = f"{PEFT_PREFIX}{module}{suffix}.weight"
        targets.add(module.rsplit(".", 1)[-1])
    return mapping, sorted(targets)


class VersionedAdapters:
    """The adapter folders of one vLLM engine: each version's folder is kept until the next
    version is installed.

    Parameters
    ----------
    base_model : str
        The served model's path (recorded as ``base_model_name_or_path``).
    root : str, optional
        Where the folders go (default: a new temporary folder made at the first
        :meth:`write`); removed by :meth:`close`.
    """

    def __init__(self, base_model: str, root: Optional[str] = None):
        self.base_model = base_model
        self._root = Path(root) if root else None
        self.current = None  # the LoRARequest of the served version, None: the base model

    @property
    def root(self) -> Path:
        """The folder that holds the version folders (made on first use)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="areal_fast_lora_"))
        return self._root

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        """Write an adapter update as the folder of ``version`` (``<root>/v<version>``, a
        folder peft's ``PeftModel.from_pretrained`` loads too); returns the folder.

        Raises
        ------
        ValueError
            A tensor that is not an adapter tensor, or a module without both A [r, in] and
            B' [out, r] of one rank (names the module); nothing is written then.
        """
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous() for name, t in named_tensors}
        reason = check_adapter(tensors)
        if reason:
            raise ValueError(f"adapter update v{version}: {reason}")
        mapping, targets = _peft_names(tensors)
        rank = next(t.shape[0] for n, t in tensors.items() if n.endswith(LORA_A))
        folder = self.root / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        save_file({mapping[n]: t for n, t in tensors.items()}, folder / "adapter_model.safetensors")
        config = {
            "peft_type": "LORA",
            "r": int(rank),
            "lora_alpha": int(rank),  # vLLM scales by alpha / r = 1: B' already holds s · B
            "target_modules": targets,
            "bias": "none",
            "lora_dropout": 0.0,
            "use_rslora": False,
            "use_dora": False,
            "base_model_name_or_path": self.base_model,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        return folder

    @staticmethod
    def request(folder: Path, version: int):
        """vLLM's ``LoRARequest`` of ``version``'s folder: name ``v<version>``, id
        ``version + 1`` (vLLM's ids start at 1)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"v{version}", int(version) + 1, str(folder))

    def installed(self, request) -> Optional[Any]:
        """Record ``request`` (None: the base model, no adapter) as the served adapter;
        returns the one it replaces (whose folder is removed here; the caller removes it from
        vLLM)."""
        previous, self.current = self.current, request
        kept = request.lora_path if request is not None else None
        if previous is not None and previous.lora_path != kept:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return previous

    def discard(self, folder: Path) -> None:
        """Remove a version's folder that vLLM did not take (the served one stays)."""
        if self.current is None or Path(self.current.lora_path) != Path(folder):
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Remove every folder."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self.current = None


def check_adapter(tensors: dict[str, torch.Tensor]) -> str:
    """'' if ``tensors`` is an adapter update (every module with A [r, in] and B' [out, r]
    of one r, all modules of the same r), else a one-line reason naming the tensor/module."""
    if not tensors:
        return "no adapter tensors"
    try:
        modules = group_adapter({name: tuple(t.shape) for name, t in tensors.items()})
    except ValueError as exc:
        return str(exc)
    ranks = set()
    for module, pair in modules.items():
        if pair.missing(module):
            return pair.missing(module)
        a, b = pair
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            return f"adapter for {module!r}: A {a} and B {b} are not [r, in] and [out, r]"
        ranks.add(a[0])
    if len(ranks) > 1:
        return f"adapter ranks differ between modules: {sorted(ranks)}"
    return ""
