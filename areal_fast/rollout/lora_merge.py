"""Installing a LoRA adapter into an engine's weights: W = W_base + B' A, per version.

A LoRA trainer publishes, per adapted linear module ``m``, ``m.lora_A`` = A [r, in] and
``m.lora_B`` = B' = s · B [out, r], the scale s = alpha / r folded into B (the names and their
grouping: :mod:`areal_fast.sync.adapter`). :class:`AdapterMerger` keeps an untouched copy of
the base weight of every module an adapter has touched (taken at its first adapter update)
and writes ``W_base + B' A`` into the served weight at each version, so versions never
accumulate (Hu et al. 2021, "LoRA", §4.1: merged weights add no inference latency).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from areal_fast.sync.adapter import LORA_A, LORA_B, group_adapter, split_adapter_name


class AdapterMerger:
    """Merges adapter updates into the weights of one engine's model.

    Parameters
    ----------
    model : torch.nn.Module
        The served model (its parameters are written in place).

    Attributes
    ----------
    base : dict[str, torch.Tensor]
        Module name → its untouched base weight [out, in] (engine dtype and device); memory
        of one copy of every adapted weight.
    """

    def __init__(self, model):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}

    def check(self, shapes: dict[str, tuple[int, ...]]) -> str:
        """'' if adapter tensors of these names and shapes fit the model, else a one-line
        reason (checked before any weight changes).

        Every module named must be a submodule with a 2-D ``weight`` [out, in], come with
        both A [r, in] and B' [out, r] of the same r.
        """
        try:
            modules = group_adapter(shapes)
        except ValueError as exc:
            return str(exc)
        for module, pair in modules.items():
            weight = self._weight(module)
            if weight is None:
                return f"adapter for {module!r}: the engine has no such module with a 2-D weight"
            if pair.missing(module):
                return pair.missing(module)
            (rank, fan_in), (fan_out, rank_b) = pair
            if rank != rank_b or (fan_out, fan_in) != tuple(weight.shape):
                return (
                    f"adapter for {module!r}: A {pair.a} and B {pair.b} do not "
                    f"make the weight's {tuple(weight.shape)}"
                )
        return ""

    def _weight(self, module: str):
        try:
            weight = getattr(self.model.get_submodule(module), "weight", None)
        except AttributeError:
            return None
        return weight if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None

    @torch.no_grad()
    def install(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write W_base + B' A into every adapted module (float32 product, cast to the
        weight's dtype); modules adapted before but absent now go back to their base.
        Returns the number of modules adapted.

        Raises
        ------
        ValueError
            :meth:`check` failed (nothing has changed).
        """
        incoming = dict(named_tensors)
        reason = self.check({k: tuple(v.shape) for k, v in incoming.items()})
        if reason:
            raise ValueError(f"adapter update: {reason}")
        names = sorted({split_adapter_name(n)[0] for n in incoming})
        for module in names:
            weight = self._weight(module)
            if module not in self.base:
                self.base[module] = weight.detach().clone()
            a = incoming[module + LORA_A].to(weight.device, torch.float32)
            b = incoming[module + LORA_B].to(weight.device, torch.float32)
            weight.copy_(torch.addmm(self.base[module].float(), b, a))
        for module in set(self.base) - set(names):
            self._weight(module).copy_(self.base.pop(module))
        return len(names)

    def forget(self) -> None:
        """Drop the base copies (a full weight update installed new base weights)."""
        self.base.clear()

    def receive_targets(self, specs: Sequence) -> list[torch.Tensor]:
        """Empty float32 tensors to receive a bucketed adapter update into (one per spec,
        on the model's device)."""
        device = next(self.model.parameters()).device
        return [torch.empty(tuple(s.shape), dtype=torch.float32, device=device) for s in specs]
