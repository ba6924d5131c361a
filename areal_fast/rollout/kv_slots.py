"""A per-slot KV cache and the attention function that reads it, for continuous batching.

One decoding step of :class:`~areal_fast.rollout.decode_batch.DecodeBatch` runs the model once
over a *packed* row: the whole prompts of newly admitted sequences (prefill) followed by one
token of every running sequence (decode), each token with its own position id, no padding
and no mask tensor from transformers. The attention function registered here under
:data:`SLOT_ATTENTION` (a transformers ``AttentionInterface`` entry with no mask function, so
transformers builds no mask) receives that row's queries, keys and values after the rotary
embedding, and a :class:`SlotPlan` as the keyword ``slot_plan``. It

1. writes every new key and value into the sequence's slot of :class:`KVSlots`;
2. copies shared prefixes between slots (:attr:`SlotPlan.copies`), then runs causal
   attention over each prefill sequence's new tokens, after the ones its slot holds already;
3. runs one batched attention for the decode tokens: each query against its slot's cached
   keys ``[0, length)``, with a boolean mask hiding the rest of the slot; one row per slot up
   to the highest decoding one (views of the cache, no copy), or, when few sequences are
   spread over many slots, one row per sequence over a copy of its slot.

The cache is dense per slot: per layer, keys and values of shape
``[slots, kv_heads, capacity, head_dim]``; ``capacity`` (tokens) grows by doubling when a
sequence outgrows it, so memory is ``2 · layers · slots · kv_heads · capacity · head_dim``
elements, bounded by ``max_batch_size`` sequences of the longest length seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

SLOT_ATTENTION = "areal_slots"


class KVSlots:
    """Keys and values of up to ``slots`` sequences, one slot each, every layer.

    Parameters
    ----------
    layers : int
        Decoder layers of the model.
    slots : int
        Sequences cached at once (the engine's ``max_batch_size``).
    kv_heads, head_dim : int
        Key/value heads and their width.
    dtype : torch.dtype
        The model's dtype.
    device : torch.device
    capacity : int
        Initial tokens per slot (grows by doubling, :meth:`reserve`).

    Raises
    ------
    ValueError
        If any size is < 1.
    """

    def __init__(self, layers, slots, kv_heads, head_dim, dtype, device, capacity: int = 128):
        for name, value in (("layers", layers), ("slots", slots), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("capacity", capacity)):  # fmt: skip
            if value < 1:
                raise ValueError(f"KVSlots: {name} = {value} must be >= 1")
        self.shape = (slots, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.layers = layers
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.reserve(capacity)

    def reserve(self, tokens: int) -> None:
        """Make every slot hold at least ``tokens`` tokens, doubling the capacity (the cached
        tokens are copied over). New memory is zeroed: a masked-out key still enters the
        attention's weighted sum with weight 0, and 0 · NaN of uninitialised memory is NaN."""
        if tokens <= self.capacity:
            return
        new = max(tokens, 2 * self.capacity)
        slots, heads, _, dim = self.shape
        grown = []
        for old in self.keys + self.values:
            buf = torch.zeros((slots, heads, new, dim), dtype=self.dtype, device=self.device)
            buf[:, :, : self.capacity] = old
            grown.append(buf)
        if not grown:
            grown = [
                torch.zeros((slots, heads, new, dim), dtype=self.dtype, device=self.device)
                for _ in range(2 * self.layers)
            ]
        self.keys, self.values = grown[: self.layers], grown[self.layers :]
        self.capacity = new

    def copy_slot(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first ``tokens`` cached tokens of slot ``src`` into slot ``dst`` (a
        sequence that shares its prompt with another one, prefilled once)."""
        for buf in self.keys + self.values:
            buf[dst, :, :tokens] = buf[src, :, :tokens]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return sum(b.numel() * b.element_size() for b in self.keys + self.values)


@dataclass
class SlotPlan:
    """Where the tokens of one packed step go, for :func:`slot_attention_forward`.

    Attributes
    ----------
    cache : KVSlots
    token_slots, token_positions : torch.Tensor
        Slot and position (cache index) of every packed token, shape [T], int64.
    prefill : list of (start, end, slot, past)
        Packed ranges of the prefill sequences: tokens ``past …`` of the sequence in
        ``slot``, whose first ``past`` tokens are cached already (or copied there first).
    decode_index : torch.Tensor or None
        Packed index of every decode token, shape [n], int64 (None: no decode token).
    decode_slots : torch.Tensor or None
        Their slots, shape [n], int64.
    decode_mask : torch.Tensor or None
        Shape [rows, 1, 1, width], bool: True at the cached positions ``[0, length)`` of a
        decoding sequence, its own position included; ``width`` is the longest length. With
        ``decode_gather`` False, one row per slot ``0 … rows − 1`` (``rows`` = the highest
        decoding slot + 1; a slot not decoding is True at position 0 only and its row is
        dropped), and the attention reads views of the cache; with it True, one row per
        decode token, and the attention reads a copy of their slots (few sequences spread
        over many slots).
    decode_gather : bool
    copies : list of (src, dst, tokens)
        Per layer, after the new keys and values are written and before any attention: the
        first ``tokens`` cached positions of slot ``src`` are copied to slot ``dst`` (a
        prefix that a sequence shares with another one prefilled in the same step).
    """

    cache: KVSlots
    token_slots: torch.Tensor
    token_positions: torch.Tensor
    prefill: list[tuple[int, int]]
    decode_index: Optional[torch.Tensor] = None
    decode_slots: Optional[torch.Tensor] = None
    decode_mask: Optional[torch.Tensor] = None
    decode_gather: bool = False
    copies: list[tuple[int, int, int]] = field(default_factory=list)


def slot_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Attention of one packed step over the slot cache; the transformers attention signature.

    Parameters
    ----------
    module : the attention module (gives ``layer_idx``)
    query : Tensor [1, H, T, D]
    key, value : Tensor [1, H_kv, T, D], the new tokens only (after the rotary embedding)
    attention_mask : must be None
    scaling : float, optional
        Softmax scale (default 1/sqrt(D)).
    slot_plan : SlotPlan (keyword)
    sliding_window, softcap : (keywords from the model)
        Not implemented: a model using either raises.

    Returns
    -------
    (Tensor [1, T, H, D], None)

    Raises
    ------
    ValueError
        If ``slot_plan`` is missing, a mask is passed, or the model needs soft-capping or a
        sliding window.
    """
    plan: Optional[SlotPlan] = kwargs.get("slot_plan")
    if plan is None:
        raise ValueError(f"attention '{SLOT_ATTENTION}' needs slot_plan (a decode step)")
    if attention_mask is not None or kwargs.get("softcap") or kwargs.get("sliding_window"):
        raise ValueError(
            f"attention '{SLOT_ATTENTION}' takes no mask and implements neither soft-capping "
            f"nor a sliding window"
        )
    layer = module.layer_idx
    k_cache, v_cache = plan.cache.keys[layer], plan.cache.values[layer]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H_kv, D]
    k_cache[plan.token_slots, :, plan.token_positions] = new_k
    v_cache[plan.token_slots, :, plan.token_positions] = new_v
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [T, H, D]
    gqa = query.shape[1] != key.shape[1]
    for src, dst, n in plan.copies:  # shared prefixes, this layer's part
        k_cache[dst, :, :n] = k_cache[src, :, :n]
        v_cache[dst, :, :n] = v_cache[src, :, :n]
    for start, end, slot, past in plan.prefill:
        if past:  # the new tokens after ``past`` cached ones: causal, offset by ``past``
            width = past + end - start
            o = F.scaled_dot_product_attention(
                query[:, :, start:end],
                k_cache[slot : slot + 1, :, :width],
                v_cache[slot : slot + 1, :, :width],
                attn_mask=_offset_causal(end - start, past, query.device),
                scale=scaling,
                enable_gqa=gqa,
            )
        else:
            o = F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                is_causal=True, scale=scaling, enable_gqa=gqa,
            )  # fmt: skip
        out[start:end] = o[0].transpose(0, 1)
    if plan.decode_index is not None:
        out[plan.decode_index] = _decode_attention(query, k_cache, v_cache, plan, scaling, gqa)
    return out.unsqueeze(0), None


def _decode_attention(query, k_cache, v_cache, plan: SlotPlan, scaling, gqa) -> torch.Tensor:
    """Attention of the decode tokens over their slots; [n, H, D]."""
    width = plan.decode_mask.shape[-1]
    q = query[0][:, plan.decode_index].transpose(0, 1)  # [n, H, D]
    if plan.decode_gather:
        keys = k_cache[plan.decode_slots, :, :width]  # copies of n slots
        values = v_cache[plan.decode_slots, :, :width]
    else:  # one row per slot up to the highest decoding one: views, no copy
        rows = plan.decode_mask.shape[0]
        keys, values = k_cache[:rows, :, :width], v_cache[:rows, :, :width]
        q_rows = query.new_zeros((rows, query.shape[1], query.shape[3]))
        q_rows[plan.decode_slots] = q
        q = q_rows
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=plan.decode_mask, scale=scaling, enable_gqa=gqa
    )[:, :, 0]
    return o if plan.decode_gather else o[plan.decode_slots]


def _offset_causal(queries: int, past: int, device) -> torch.Tensor:
    """Mask [queries, past + queries], bool: query i sees keys 0 … past + i."""
    keys = torch.arange(past + queries, device=device)
    return keys.unsqueeze(0) <= (past + torch.arange(queries, device=device)).unsqueeze(1)


def register_slot_attention() -> str:
    """Register :func:`slot_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention_forward)
    return SLOT_ATTENTION
