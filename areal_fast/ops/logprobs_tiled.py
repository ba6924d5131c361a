"""CPU strategy of ``linear_logprobs``: token chunks × vocabulary tiles (native C++ kernels).

A [chunk, V] logits block forces small token chunks when V is large, and every chunk's matmul
then streams the whole LM head from memory: at V = 151936, H = 2048 a 128-token chunk runs
the matmul at 2/3 of the full-size rate on a 2-core CPU. Here a chunk holds up to 4096 tokens
and its logits are formed one vocabulary tile [chunk, tile] at a time (the same byte budget),
so each matmul is large in every dimension. The forward merges tiles with an online
log-sum-exp (running max m, Σ exp(x − m) − 1, Σ exp(x − m)(x − m) and the label logit); the
backward writes each tile's gradient in place with the label column zeroed, pushes it through
both gradient matmuls, and adds the label entries at the end as a sparse update, with
1 − p_y = Σ_{v≠y} p_v accumulated over the tiles (accurate for confident rows).
The weight gradient of each tile is accumulated over token chunks in fp32: the first chunk
writes it (no zero-filled [V, H] buffer), later chunks add to it. Tiles the forward kept in a
:class:`~areal_fast.ops.logits_cache.LogitsCache` skip their recomputation in the backward and
are freed as they are consumed, while the weight gradient fills in.
"""

from __future__ import annotations

import torch

from areal_fast._native import load_native
from areal_fast.ops.logits_cache import LogitsCache

_TILED_ROWS = 4096  # tokens per chunk
_MIN_TILE = 256  # vocabulary columns per tile, at least


def tile_shape(num_tokens: int, vocab: int, block_bytes: int) -> tuple[int, int]:
    """(tokens per chunk, vocabulary columns per tile) for a fp32 block of ``block_bytes``."""
    rows = max(1, min(num_tokens, _TILED_ROWS))
    tile = min(vocab, max(_MIN_TILE, block_bytes // (4 * rows)))
    return rows, tile


def _tile_logits(hidden_chunk, weight_mm, bias, v0, width, out):
    """Logits of the chunk for vocabulary columns [v0, v0 + width), into ``out`` [C, width]."""
    torch.mm(hidden_chunk, weight_mm[v0 : v0 + width].t(), out=out)
    if bias is not None:
        out += bias[v0 : v0 + width]
    return out


class _Scratch:
    """One reused fp32 block of ``size`` elements, allocated on first use."""

    def __init__(self, size: int, device):
        self.size, self.device, self.block = size, device, None

    def view(self, rows: int, cols: int) -> torch.Tensor:
        if self.block is None:
            self.block = torch.empty(self.size, dtype=torch.float32, device=self.device)
        return self.block[: rows * cols].view(rows, cols)


def tiled_forward(
    hidden,
    weight_mm,
    labels,
    bias,
    temperature,
    ignore_index,
    want_entropy,
    block_bytes,
    cache: LogitsCache | None = None,
):
    """(logprobs [T], entropy [T] or None, lse [T]) in fp32; ``weight_mm`` is fp32 [V, H].

    Tiles that fit in ``cache`` are formed in blocks of their own and kept there (keyed by
    (chunk start, v0)) for :func:`tiled_backward`; the others share one scratch block.
    """
    native = load_native()
    num_tokens, vocab = hidden.shape[0], weight_mm.shape[0]
    rows, tile = tile_shape(num_tokens, vocab, block_bytes)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logprobs, lse = torch.empty(num_tokens, **f32), torch.empty(num_tokens, **f32)
    entropy = torch.empty(num_tokens, **f32) if want_entropy else None
    bias32 = None if bias is None else bias.to(torch.float32)
    scratch = _Scratch(rows * tile, hidden.device)
    inv_temp, threads = 1.0 / temperature, torch.get_num_threads()
    for start in range(0, num_tokens, rows):
        sl = slice(start, min(start + rows, num_tokens))
        chunk = hidden[sl].to(torch.float32)
        chunk_labels = labels[sl].contiguous()
        n = chunk.shape[0]
        row_max = torch.full((n,), float("-inf"), **f32)
        # Σ exp(x − max) − 1: the entry at the maximum kept out, so log1p of it is
        # accurate for rows that one token dominates
        sum_exp_rest, picked = torch.zeros(n, **f32), torch.zeros(n, **f32)
        sum_xexp = torch.zeros(n, **f32) if want_entropy else None
        for v0 in range(0, vocab, tile):
            width = min(tile, vocab - v0)
            out = None
            if cache is not None:
                out = cache.new_block((start, v0), n, width, chunk, torch.float32)
            if out is None:
                out = scratch.view(n, width)
            logits = _tile_logits(chunk, weight_mm, bias32, v0, width, out)
            native.logprob_tile_forward(
                logits.data_ptr(),
                n,
                width,
                width,
                v0,
                chunk_labels.data_ptr(),
                inv_temp,
                ignore_index,
                row_max.data_ptr(),
                sum_exp_rest.data_ptr(),
                0 if sum_xexp is None else sum_xexp.data_ptr(),
                picked.data_ptr(),
                threads,
            )
        valid = chunk_labels != ignore_index
        log_sum = torch.log1p(sum_exp_rest)
        lse[sl] = torch.where(valid, row_max + log_sum, 0.0)
        logprobs[sl] = torch.where(valid, (picked - row_max) - log_sum, 0.0)
        if entropy is not None:
            entropy[sl] = torch.where(valid, log_sum - sum_xexp / (1.0 + sum_exp_rest), 0.0)
    return logprobs, entropy, lse


def tiled_backward(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight_mm,
    labels,
    bias,
    temperature,
    ignore_index,
    lse,
    entropy,
    needs_grad,
    block_bytes,
    cache: LogitsCache | None = None,
):
    """(grad_hidden fp32 [T, H], grad_weight fp32 [V, H], grad_bias fp32 [V]), None if unneeded.

    ``grad_logprobs``/``grad_entropy`` are fp32 contiguous [T] (grad_entropy may be None).
    Tiles found in ``cache`` (kept by :func:`tiled_forward` with the same ``block_bytes``) are
    taken out of it and used instead of being recomputed; the others are recomputed.
    """
    native = load_native()
    num_tokens, vocab = hidden.shape[0], weight_mm.shape[0]
    rows, tile = tile_shape(num_tokens, vocab, block_bytes)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    need_hidden, need_weight, need_bias = needs_grad
    # the first tile (grad_hidden) and the first chunk (grad_weight) write these; later ones
    # add, so only an empty input needs zeros
    alloc = torch.empty if num_tokens else torch.zeros
    grad_hidden = alloc(hidden.shape, **f32) if need_hidden else None
    grad_weight = alloc(weight_mm.shape, **f32) if need_weight else None
    grad_bias = torch.zeros(vocab, **f32) if need_bias else None
    bias32 = None if bias is None else bias.to(torch.float32)
    scratch = _Scratch(rows * tile, hidden.device)
    inv_temp, threads = 1.0 / temperature, torch.get_num_threads()
    use_entropy = grad_entropy is not None and entropy is not None
    for start in range(0, num_tokens, rows):
        sl = slice(start, min(start + rows, num_tokens))
        chunk = hidden[sl].to(torch.float32)
        chunk_labels = labels[sl].contiguous()
        n = chunk.shape[0]
        others, d_label = torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, vocab, tile):
            width = min(tile, vocab - v0)
            grad_z = None if cache is None else cache.pop((start, v0))
            if grad_z is None:
                grad_z = _tile_logits(chunk, weight_mm, bias32, v0, width, scratch.view(n, width))
            native.logprob_tile_backward(
                grad_z.data_ptr(),
                n,
                width,
                width,
                v0,
                chunk_labels.data_ptr(),
                lse[sl].data_ptr(),
                entropy[sl].data_ptr() if use_entropy else 0,
                grad_logprobs[sl].data_ptr(),
                grad_entropy[sl].data_ptr() if use_entropy else 0,
                inv_temp,
                ignore_index,
                others.data_ptr(),
                d_label.data_ptr(),
                threads,
            )
            if grad_hidden is not None:
                if v0 == 0:
                    torch.mm(grad_z, weight_mm[:width], out=grad_hidden[sl])
                else:
                    grad_hidden[sl].addmm_(grad_z, weight_mm[v0 : v0 + width])
            if grad_weight is not None:
                if start == 0:
                    torch.mm(grad_z.t(), chunk, out=grad_weight[v0 : v0 + width])
                else:
                    grad_weight[v0 : v0 + width].addmm_(grad_z.t(), chunk)
            if grad_bias is not None:
                grad_bias[v0 : v0 + width] += grad_z.sum(0)
            del grad_z  # a kept tile is freed here
        _add_label_entries(
            grad_hidden,
            grad_weight,
            grad_bias,
            sl,
            chunk,
            chunk_labels,
            weight_mm,
            others,
            d_label,
            grad_logprobs[sl],
            grad_entropy[sl] if use_entropy else None,
            entropy[sl] if use_entropy else None,
            inv_temp,
            ignore_index,
        )
    return grad_hidden, grad_weight, grad_bias


def _add_label_entries(
    grad_hidden,
    grad_weight,
    grad_bias,
    sl,
    chunk,
    labels,
    weight_mm,
    others,
    d_label,
    grad_lp,
    grad_ent,
    entropy,
    inv_temp,
    ignore_index,
):
    """The label column's dz_y = inv_temp·(g·Σ_{v≠y} p_v − h·p_y·(x_y − lse + H)) as a
    sparse update. For confident rows (Σ_{v≠y} p_v < ½) x_y − lse = log1p(−Σ_{v≠y} p_v),
    which is accurate where the fp32 difference of two nearly equal numbers is not."""
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    grad_y = grad_lp * others
    if grad_ent is not None:
        confident = others < 0.5
        d_y = torch.where(confident, torch.log1p(-others), d_label)
        p_y = torch.where(confident, 1.0 - others, d_label.exp())
        grad_y = grad_y - grad_ent * torch.where(p_y > 0, p_y * (d_y + entropy), 0.0)
    grad_y = torch.where(valid, grad_y * inv_temp, 0.0)
    if grad_hidden is not None:
        grad_hidden[sl] += grad_y[:, None] * weight_mm[safe]
    if grad_weight is not None:
        grad_weight.index_add_(0, safe, grad_y[:, None] * chunk)
    if grad_bias is not None:
        grad_bias.index_add_(0, safe, grad_y)
