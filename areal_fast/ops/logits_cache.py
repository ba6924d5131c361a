"""Logits blocks that ``linear_logprobs`` keeps from its forward for its backward.

The chunked log-prob path forms the logits one block at a time and never holds all [T, V] of
them. Without the upstream gradient the backward needs every block's logits again, and forming
them anew costs one more [T, H] × [H, V]-sized matmul: four such matmuls for forward +
backward where a materialised path performs three. A block kept from the forward skips its
recomputation, so keeping some of them trades memory for time (selective recompute).

The budget is ``AREAL_FAST_LOGITS_CACHE_MB`` MiB of kept fp32 logits per call (read on every
call; default 2048 on the CPU, 0 on every other device). Blocks are kept in forward order
while they fit; the backward consumes each kept block in place (it becomes that block's
gradient) and frees it. Nothing is kept when no gradient is wanted (``torch.no_grad()``,
inputs that do not require grad) or under ``torch.compile`` (the custom op recomputes).
"""

from __future__ import annotations

import math
import os

import torch

CACHE_ENV = "AREAL_FAST_LOGITS_CACHE_MB"
DEFAULT_CPU_MIB = 2048  # CPU default; 0 on every other device
_MIB = 1 << 20


def cache_budget_bytes(device: torch.device) -> int:
    """Bytes of logits one call may keep for its backward on ``device``.

    Parameters
    ----------
    device : torch.device
        Device of the hidden states; the default budget is ``DEFAULT_CPU_MIB`` MiB on the
        CPU and 0 elsewhere.

    Returns
    -------
    int
        ``$AREAL_FAST_LOGITS_CACHE_MB`` MiB (a number ≥ 0, fractions allowed) in bytes, or the
        device's default when the variable is unset or empty.

    Raises
    ------
    ValueError
        The variable is set to something other than a finite number ≥ 0 (the message names
        the variable and the value).
    """
    raw = os.environ.get(CACHE_ENV, "").strip()
    if not raw:
        return DEFAULT_CPU_MIB * _MIB if device.type == "cpu" else 0
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not (math.isfinite(mib) and mib >= 0):
        raise ValueError(f"{CACHE_ENV} must be a number of MiB >= 0, got {raw!r}")
    return int(mib * _MIB)


class LogitsCache:
    """Logits blocks kept under a byte budget, keyed by their place in the chunk loop.

    Parameters
    ----------
    budget_bytes : int
        Most bytes of blocks this cache holds over its lifetime (a block that does not fit
        is not kept; later, smaller ones may be).
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.kept_bytes = 0
        self._blocks: dict = {}

    def new_block(self, key, rows: int, cols: int, like: torch.Tensor, dtype: torch.dtype):
        """A fresh [rows, cols] ``dtype`` tensor on ``like``'s device, kept under ``key``, or
        None when it does not fit in what is left of the budget."""
        nbytes = rows * cols * torch.finfo(dtype).bits // 8
        if self.kept_bytes + nbytes > self.budget_bytes:
            return None
        block = like.new_empty(rows, cols, dtype=dtype)
        self._blocks[key] = block
        self.kept_bytes += nbytes
        return block

    def pop(self, key) -> torch.Tensor | None:
        """The block kept under ``key`` (the caller now owns it), or None."""
        return self._blocks.pop(key, None)

    def __len__(self) -> int:
        """Number of blocks still held."""
        return len(self._blocks)


def new_cache(budget_bytes: int) -> LogitsCache | None:
    """A :class:`LogitsCache` of ``budget_bytes``, or None for a budget of 0."""
    return LogitsCache(budget_bytes) if budget_bytes > 0 else None
