"""Mixed precision for a trainer on a GPU: float32 master weights, half-precision compute.

A CUDA trainer with ``model.dtype`` bfloat16 (or float16) keeps its parameters, gradients and
AdamW moments in float32 and runs the decoder in ``model.dtype``
(:func:`compute_in_dtype`): every matmul of the decoder under ``torch.autocast``, and the
input embeddings cast to ``model.dtype``, so the residual stream, the rotary tables and the
attention inputs are in that dtype as in an engine that holds ``model.dtype`` weights. The
final norm multiplies by its float32 weight, so the last hidden states are float32; the
model's ``areal_compute_dtype`` attribute names the dtype the trainer runs the LM head in
(``train/torch_engine.py`` casts the hidden states and the head weight to it once per
micro-batch, so the fused loss runs bfloat16 matmuls with float32 accumulation, as the
engine's head does). Half-precision master weights would lose AdamW's small updates: bfloat16 keeps 8
significant bits, so a weight of magnitude 0.02 moves in steps of about 1.2e-4, and an update
of lr = 1e-5 rounds away.
"""

from __future__ import annotations

import functools

import torch

COMPUTE_DTYPE_ATTR = "areal_compute_dtype"  # set on the model: the dtype its decoder computes in


def compute_in_dtype(model, dtype: torch.dtype) -> None:
    """Make ``model``'s decoder compute in ``dtype`` over its own (float32) parameters.

    In place: the decoder's ``forward`` (``model.get_decoder()``) runs under
    ``torch.autocast(<the parameters' device type>, dtype)``; the input embedding's output is
    cast to ``dtype``; ``model.areal_compute_dtype`` is set to ``dtype``. Gradients reach the
    float32 parameters through the casts (autocast's and this one), so they stay float32.

    Parameters
    ----------
    model : transformers causal LM (``get_decoder()``, ``get_input_embeddings()``)
    dtype : torch.dtype
        torch.bfloat16 or torch.float16.

    Raises
    ------
    ValueError
        ``dtype`` is not a half-precision floating-point dtype.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"compute_in_dtype: dtype {dtype} is not bfloat16 or float16")
    device_type = next(model.parameters()).device.type
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: output.to(dtype)
    )
    decoder = model.get_decoder()
    forward = decoder.forward

    @functools.wraps(forward)
    def forward_in_dtype(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    decoder.forward = forward_in_dtype
    setattr(model, COMPUTE_DTYPE_ATTR, dtype)
