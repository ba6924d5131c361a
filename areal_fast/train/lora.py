"""LoRA adapters on the trained policy (peft), and the adapter tensors that engines receive.

With ``actor.lora`` set, the trainer wraps its model with peft (``get_peft_model``): every
targeted ``nn.Linear`` W [out, in] becomes W + s · B A with A [r, in], B [out, r] and the
scale s = alpha / r (Hu et al. 2021, "LoRA", Eq. 3); only A and B require gradients. The
model object stays the transformers model (peft injects its layers in place), so the packed
decoder pass and the fused LM-head loss run on it unchanged.

Engines receive the adapter alone (:func:`adapter_weights`): per adapted module
``<module>.lora_A`` = A and ``<module>.lora_B`` = s · B (the scale folded into B), under the
module names of the plain model (:mod:`areal_fast.sync.adapter`, the names both sides use);
an engine installs W_base + (s · B) A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, List

import torch

from areal_fast.sync.adapter import LORA_A, LORA_B

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name
LORA_ATTR = "areal_lora"  # set on a model wrapped by apply_lora (its LoraConfig)
INIT_SEED = 0  # torch seed of the adapters' initialisation


@dataclass
class LoraConfig:
    """LoRA on the trained policy (``actor.lora.*``): with ``rank`` > 0 only the adapters are
    trained and sent to the engines; ``rank`` 0 (the default): full fine-tuning.

    Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; the
    adapter layers are peft's (``peft.LoraConfig``, ``get_peft_model``).
    """

    # r: rows of A [r, in] and columns of B [out, r] of each adapted linear; 0: no LoRA
    # (full fine-tuning), e.g. 16 turns it on
    rank: int = 0
    alpha: float = 32.0  # scale of the update: W + (alpha / rank) · B A
    # dropout on the adapter's input during the gradient pass (0: none; the log-prob passes
    # without gradient never drop)
    dropout: float = 0.0
    # module names (or name suffixes, e.g. q_proj) to adapt; ["all-linear"]: every linear
    # layer but the LM head. Only nn.Linear layers; the LM head and embeddings are not allowed
    target_modules: List[str] = field(default_factory=lambda: [ALL_LINEAR])

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank = {self.rank!r} must be an int >= 0 (0: off)")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"lora.alpha = {self.alpha!r} must be a finite number > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout = {self.dropout!r} must be in [0, 1)")
        targets = list(self.target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"lora.target_modules = {targets!r} must be a non-empty list of module names"
            )
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora.target_modules: {ALL_LINEAR!r} stands alone, got {targets}")

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank`` > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """s = alpha / rank, the factor of B A."""
        return self.alpha / self.rank


def linear_module_names(model) -> list[str]:
    """Sorted distinct last name parts of the ``nn.Linear`` modules of ``model`` (the names
    ``target_modules`` may use), the LM head excluded."""
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    )


def _matches(name: str, target: str) -> bool:
    """peft's rule: the full module name, or its ending after a dot."""
    return name == target or name.endswith("." + target)


def _check_targets(model, config: LoraConfig) -> None:
    """Every target names at least one module, and only nn.Linear ones other than the head."""
    targets = list(config.target_modules)
    if targets == [ALL_LINEAR]:
        return
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    linears = ", ".join(linear_module_names(model))
    for target in targets:
        found = [(n, m) for n, m in model.named_modules() if n and _matches(n, target)]
        if not found:
            raise ValueError(
                f"actor.lora.target_modules: {target!r} names no module of the model "
                f"(its linear modules: {linears})"
            )
        for name, module in found:
            if module is head or module is embeddings:
                raise ValueError(
                    f"actor.lora.target_modules: {target!r} names {name}, the LM head or "
                    f"embeddings, which LoRA does not adapt here (its linear modules: {linears})"
                )
            if type(module) is not torch.nn.Linear:
                raise ValueError(
                    f"actor.lora.target_modules: {target!r} names {name}, a "
                    f"{type(module).__name__}, not a Linear (its linear modules: {linears})"
                )


def check_lora_targets(model_config, config: LoraConfig) -> None:
    """Check ``target_modules`` against a model built from its transformers config on the
    meta device (no weights are read or allocated): the errors of :func:`apply_lora`, before
    any worker starts.

    Raises
    ------
    ValueError
        As :func:`apply_lora`.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    _check_targets(skeleton, config)


def apply_lora(model, config: LoraConfig):
    """Wrap ``model`` in place with peft LoRA adapters; returns the same model object.

    Afterwards only the adapter parameters (``...lora_A.default.weight`` [r, in],
    ``...lora_B.default.weight`` [out, r], B zero-initialised, so the policy starts as the
    base model) require gradients. A is drawn by peft (Kaiming-uniform) from the fixed
    torch seed ``INIT_SEED`` on the CPU, the global RNG left as it was: the same adapter on
    every rank and in every run. Applying it twice does nothing the second time.

    Raises
    ------
    ValueError
        A ``target_modules`` entry names no module of the model, the LM head, an embedding
        or a non-Linear module (one line naming ``actor.lora.target_modules`` and the
        model's linear module names).
    ImportError
        peft is not installed (one line: ``pip install 'areal_fast[lora]'``).
    """
    if not config.enabled:
        raise ValueError("apply_lora: lora.rank = 0 (LoRA off)")
    if getattr(model, LORA_ATTR, None) is not None:
        return model
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "actor.lora needs the peft package: pip install 'areal_fast[lora]'"
        ) from exc
    _check_targets(model, config)
    targets = list(config.target_modules)
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        bias="none",
    )
    # A's random start from a fixed seed, whatever the global RNG: every FSDP rank shards
    # the same adapter, and a run's adapter does not depend on what drew numbers before
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        wrapped = peft.get_peft_model(model, peft_config)
    inner = wrapped.get_base_model()
    assert inner is model, "peft wrapped a copy of the model"
    setattr(model, LORA_ATTR, config)
    # the PeftModel (adapter save), held outside the module tree (it contains the model)
    object.__setattr__(model, "areal_peft_model", wrapped)
    return model


def lora_layers(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(module name, peft LoRA layer) of every adapted module, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (a DTensor, e.g. FSDP2, is all-gathered)."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor") and hasattr(tensor, "device_mesh"):
        tensor = tensor.full_tensor()
    return tensor


def adapter_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter as engines receive it: per adapted module ``<module>.lora_A`` = A
    [r, in] and ``<module>.lora_B`` = s · B [out, r] (parameter dtype), named as in the plain
    model (``model.layers.0.self_attn.q_proj``). Sharded parameters are gathered (a
    collective: every rank iterates to the end, in the same order)."""
    for name, layer in lora_layers(model):
        scale = layer.scaling[ADAPTER]
        yield name + LORA_A, _full(layer.lora_A[ADAPTER].weight)
        yield name + LORA_B, _full(layer.lora_B[ADAPTER].weight) * scale


def merged_state_dict(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict from a full state dict of the LoRA-wrapped ``model``:
    each adapted ``W`` = base + s · B A (computed in float32, stored in W's dtype), under
    the plain names (``...q_proj.weight``); adapter entries dropped."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        merged[key.replace(".base_layer.", ".")] = value
    for name, layer in lora_layers(model):
        a = state[f"{name}.lora_A.{ADAPTER}.weight"].float()
        b = state[f"{name}.lora_B.{ADAPTER}.weight"].float()
        base = merged[f"{name}.weight"]
        merged[f"{name}.weight"] = (base.float() + layer.scaling[ADAPTER] * (b @ a)).to(base.dtype)
    return merged


def set_dropout_active(model, active: bool) -> None:
    """Switch the adapters' dropout on (gradient pass) or off (log-prob passes); the rest of
    the model stays in eval mode."""
    for _, layer in lora_layers(model):
        layer.lora_dropout[ADAPTER].train(active)


def trainable_parameters(model) -> int:
    """Number of parameter elements that require gradients (global: DTensor shapes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
