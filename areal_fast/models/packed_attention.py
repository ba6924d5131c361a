"""Variable-length ("packed") causal attention for transformers models, without a [T, T] mask.

transformers detects packed sequences from restarting ``position_ids`` and then builds a
dense block-diagonal [T, T] mask for its sdpa/eager paths: O(T²) memory and time per layer,
which dominates training on CPU. The attention function registered here instead takes the
sequence boundaries (``cu_seq_lens_q`` and ``max_length_q``, the keywords transformers'
flash-attention path also uses) and runs causal attention on each sequence separately:
O(Σ Lᵢ²) work, no mask. It is registered under :data:`PACKED_ATTENTION` with no mask
function, so transformers skips mask creation entirely.

The kernel is chosen per call by :func:`~areal_fast.models.attention_backends.choose_backend`
(``$AREAL_FAST_ATTN``: auto | flash_attn | varlen | sdpa). On CUDA with float16/bfloat16 one
varlen launch covers the whole batch (flash-attn's ``flash_attn_varlen_func``, else torch's
``varlen_attn``), with ``max_length_q`` from the host and no device→host synchronisation.
Elsewhere (CPU, float32, or neither kernel available) causal
``scaled_dot_product_attention`` runs once per sequence; PyTorch's fused (flash) kernels
apply because ``is_causal=True``. That path needs the boundaries on the host:
:func:`host_boundaries` reads ``cu_seq_lens_q`` once per forward (all layers of a forward
share the same tensor) and keeps them in a one-entry cache, so a CUDA model synchronises once
per forward, not once per layer.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from areal_fast.models.attention_backends import (
    choose_backend,
    flash_attn_packed,
    torch_varlen_packed,
)

PACKED_ATTENTION = "areal_packed"

# (weak reference to cu_seqlens, its version counter, host boundaries, longest sequence)
_host_cache: tuple | None = None


def host_boundaries(cu_seqlens: torch.Tensor) -> tuple[list[int], int]:
    """The boundaries of ``cu_seqlens`` as host integers, and the longest sequence length.

    The result for the last tensor seen is cached (a weak reference to it plus its version
    counter, so an in-place change or a new tensor reads again): the layers of one forward
    pass the same tensor, and only the first reads it back from the device.

    Parameters
    ----------
    cu_seqlens : Tensor [B+1] int32/int64, any device

    Returns
    -------
    (list[int] of length B+1, int)
        The boundaries and ``max(b[i+1] - b[i])`` (0 when B = 0).
    """
    global _host_cache
    cached = _host_cache
    try:
        version = cu_seqlens._version
    except RuntimeError:  # inference tensors keep no version counter: never cached
        version = None
    if cached is not None and version is not None:
        ref, cached_version, bounds, longest = cached
        if ref() is cu_seqlens and cached_version == version:
            return bounds, longest
    bounds = cu_seqlens.tolist()
    longest = max((e - s for s, e in zip(bounds[:-1], bounds[1:])), default=0)
    if version is not None:
        _host_cache = (weakref.ref(cu_seqlens), version, bounds, longest)
    return bounds, longest


def per_sequence_sdpa(query, key, value, bounds, scale=None, dropout=0.0):
    """Causal ``scaled_dot_product_attention`` of each packed sequence on its own.

    Parameters
    ----------
    query : Tensor [1, H, T, D]
    key, value : Tensor [1, H_kv, T, D], H divisible by H_kv
    bounds : list[int] of length B+1
        Host sequence boundaries (empty sequences allowed).
    scale : float, optional
        Softmax scale (default 1/sqrt(D)).
    dropout : float
        Attention dropout probability.

    Returns
    -------
    Tensor [1, H, T, D]
    """
    gqa = key.shape[1] != query.shape[1]
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(outputs, dim=2) if outputs else query[:, :, :0]


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
        Attention dropout probability, applied only in training mode (the varlen backend of
        torch has none: auto then runs flash-attn or the per-sequence SDPA).
    cu_seq_lens_q : Tensor [B+1] int32 (keyword)
        Sequence boundaries in the packed token dimension, on the tensors' device.
    max_length_q : int (keyword, optional)
        Length of the longest sequence, computed on the host (``PackedBatch.max_seqlen``).
        The CUDA varlen backends take it as is; without it they read the boundaries back
        once per forward (:func:`host_boundaries`).
    sliding_window, softcap : (keywords from the model)
        Not implemented: a sequence longer than the window, or any soft-capping, raises.

    Returns
    -------
    (Tensor [1, T, H, D], None)

    Raises
    ------
    ValueError
        If ``cu_seq_lens_q`` is missing, a mask is passed, the batch dimension is not 1, the
        model needs soft-capping or a sliding window shorter than a sequence, or the backend
        forced by ``$AREAL_FAST_ATTN`` cannot run on these tensors.
    """
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(f"attention '{PACKED_ATTENTION}' needs cu_seq_lens_q (packed input)")
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"attention '{PACKED_ATTENTION}' takes one packed row and no mask")
    if kwargs.get("softcap"):
        raise ValueError(f"attention '{PACKED_ATTENTION}' does not implement logit soft-capping")
    drop = dropout if module.training else 0.0
    backend = choose_backend(query.device, query.dtype, query.shape[-1], drop)
    longest = kwargs.get("max_length_q")
    if backend == "sdpa" or longest is None:
        bounds, longest = host_boundaries(cu_seqlens)
    longest = int(longest)
    window = kwargs.get("sliding_window")
    if window and longest > window:
        raise ValueError(
            f"a packed sequence of {longest} tokens exceeds the model's sliding "
            f"window of {window}, which attention '{PACKED_ATTENTION}' does not "
            f"implement"
        )
    if backend == "sdpa":
        out = per_sequence_sdpa(query, key, value, bounds, scaling, drop)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[2] == 0:
        return query.transpose(1, 2)[:, :0].contiguous(), None
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    if backend == "flash_attn":
        out = flash_attn_packed(q, k, v, cu, longest, scaling, drop)
    else:
        out = torch_varlen_packed(q, k, v, cu, longest, scaling)
    return out.unsqueeze(0), None


def register_packed_attention() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION
