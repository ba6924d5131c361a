"""LoRA adapter updates: the tensor names a LoRA trainer publishes and engines install.

With ``actor.lora`` a weight update holds the adapter alone: per adapted linear module ``m``
(named as in the plain model, e.g. ``model.layers.0.self_attn.q_proj``) the tensors
``m.lora_A`` = A [r, in] and ``m.lora_B`` = B' = s · B [out, r], the scale s = alpha / r
folded into B (Hu et al. 2021, "LoRA", Eq. 3). The trainer names them
(:func:`areal_fast.train.lora.adapter_weights`); the engines tell such an update from a full
one (:func:`is_adapter_update`) and pair the tensors per module (:func:`group_adapter`) to
merge them (:mod:`areal_fast.rollout.lora_merge`) or write them as a PEFT folder
(:mod:`areal_fast.rollout.vllm_lora`). The names travel through weight sync like any other
tensor's, which is why they live here, below both the trainer and the engines.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

LORA_A, LORA_B = ".lora_A", ".lora_B"  # suffixes of the adapter tensors engines receive


class AdapterShapes(NamedTuple):
    """The shapes of one module's adapter tensors: A [r, in] and B' [out, r] when well formed;
    None for a tensor the update lacks."""

    a: tuple[int, ...] | None
    b: tuple[int, ...] | None

    def missing(self, module: str) -> str:
        """'' when the update has both tensors of ``module``, else a one-line reason naming the
        one it lacks."""
        if self.a is None or self.b is None:
            return (
                f"adapter for {module!r}: {module}{LORA_A if self.a is None else LORA_B} is missing"
            )
        return ""


def is_adapter_update(names: Iterable[str]) -> bool:
    """Whether a weight update holds adapter tensors only (and at least one)."""
    names = list(names)
    return bool(names) and all(n.endswith((LORA_A, LORA_B)) for n in names)


def split_adapter_name(name: str) -> tuple[str, str]:
    """``(module, suffix)`` of an adapter tensor name: ``"m.lora_A"`` → ``("m", ".lora_A")``.

    Raises
    ------
    ValueError
        ``name`` ends in neither ``.lora_A`` nor ``.lora_B``.
    """
    for suffix in (LORA_A, LORA_B):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise ValueError(f"tensor {name!r} is not an adapter tensor (.lora_A / .lora_B)")


def group_adapter(shapes: Mapping[str, Sequence[int]]) -> dict[str, AdapterShapes]:
    """The adapter tensors of an update grouped per module: module name → (A's, B''s shape).

    Parameters
    ----------
    shapes : Mapping[str, Sequence[int]]
        Adapter tensor name (``<module>.lora_A`` / ``<module>.lora_B``) → its shape.

    Returns
    -------
    dict[str, AdapterShapes]
        In the order the modules first appear; shapes as tuples, not checked against each
        other (the callers know what they must fit), None where the update lacks a tensor
        (:meth:`AdapterShapes.missing` says which).

    Raises
    ------
    ValueError
        A name that is not an adapter tensor's (one line naming the first such tensor).
    """
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        module, suffix = split_adapter_name(name)
        parts.setdefault(module, {})[suffix] = tuple(shape)
    return {m: AdapterShapes(p.get(LORA_A), p.get(LORA_B)) for m, p in parts.items()}
