"""Activation checkpointing of the decoder layers (``actor.gradient_checkpointing``).

A checkpointed layer keeps only its inputs for the backward pass and runs its forward again
there (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; torch's
non-reentrant :func:`torch.utils.checkpoint.checkpoint`): the activations a micro-batch holds
fall from every layer's intermediate tensors (about 11.5 k floats per token per layer on the
demo model) to one [T, H] input per layer, for one more forward pass of the decoder.

Hugging Face's own switch (``gradient_checkpointing_enable``) acts only in training mode;
the trainer keeps its model in eval mode (dropout off, so that it recomputes the engine's
log-probs exactly), hence this wrapper, which checkpoints whenever gradients are recorded.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

_MARK = "_areal_fast_checkpointed"


def checkpoint_decoder_layers(model) -> int:
    """Make every decoder layer of ``model`` (``model.get_decoder().layers``) checkpoint its
    activations while gradients are recorded; a pass without gradients runs as before.
    Applying it twice changes nothing the second time.

    Returns
    -------
    int
        The number of decoder layers.

    Raises
    ------
    ValueError
        The model has no ``get_decoder().layers`` (named with the model's class).
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"actor.gradient_checkpointing: {type(model).__name__} has no decoder layers "
            f"(get_decoder().layers)"
        )
    for layer in layers:
        if getattr(layer, _MARK, False):
            continue
        layer.forward = _checkpointed(layer.forward)
        setattr(layer, _MARK, True)
    return len(layers)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
