"""Variable-length ("packed") causal attention for transformers models, without a [T, T] mask.

transformers detects packed sequences from restarting ``position_ids`` and then builds a
dense block-diagonal [T, T] mask for its sdpa/eager paths: O(T²) memory and time per layer,
which dominates training on CPU. The attention function registered here instead takes the
sequence boundaries (``cu_seq_lens_q``, the keyword transformers' flash-attention path also
uses) and runs causal ``scaled_dot_product_attention`` on each sequence separately: O(Σ Lᵢ²)
work, no mask, and PyTorch's fused (flash) CPU/GPU kernels apply because ``is_causal=True``.
It is registered under :data:`PACKED_ATTENTION` with no mask function, so transformers
skips mask creation entirely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "areal_packed"


def packed_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Causal attention over packed sequences; the transformers attention-function signature.

    Parameters
    ----------
    module : the attention module (gives ``training``)
    query : Tensor [1, H, T, D]
    key, value : Tensor [1, H_kv, T, D] (grouped-query attention when H_kv < H)
    attention_mask : must be None (packing replaces the mask)
    scaling : float, optional
        Softmax scale (default 1/sqrt(D)).
    dropout : float
        Attention dropout probability, applied only in training mode.
    cu_seq_lens_q : Tensor [B+1] int32 (keyword)
        Sequence boundaries in the packed token dimension.
    sliding_window, softcap : (keywords from the model)
        Not implemented: a sequence longer than the window, or any soft-capping, raises.

    Returns
    -------
    (Tensor [1, T, H, D], None)

    Raises
    ------
    ValueError
        If ``cu_seq_lens_q`` is missing, a mask is passed, the batch dimension is not 1, or
        the model needs soft-capping or a sliding window shorter than a sequence.
    """
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(f"attention '{PACKED_ATTENTION}' needs cu_seq_lens_q (packed input)")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"attention '{PACKED_ATTENTION}' takes one packed row and no mask")
    if kwargs.get("softcap"):
        raise ValueError(f"attention '{PACKED_ATTENTION}' does not implement logit soft-capping")
    bounds = cu_seqlens.tolist()
    window = kwargs.get("sliding_window")
    longest = max((e - s for s, e in zip(bounds[:-1], bounds[1:])), default=0)
    if window and longest > window:
        raise ValueError(
            f"a packed sequence of {longest} tokens exceeds the model's sliding "
            f"window of {window}, which attention '{PACKED_ATTENTION}' does not "
            f"implement"
        )
    drop = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=drop,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    out = torch.cat(outputs, dim=2) if outputs else query[:, :, :0]
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION
