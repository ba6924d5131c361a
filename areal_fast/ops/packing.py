"""Micro-batch packing and packed-batch index helpers.

``partition_balanced`` splits a packed batch of B sequences into micro-batches
under a token budget, either with first-fit decreasing (fewest micro-batches)
or with the Karmarkar-Karp differencing method (fewest micro-batches that fit,
as evenly loaded as possible). Sequences of one GRPO group can be kept in the
same micro-batch. ``cu_seqlens_from_lengths`` and
``position_ids_from_cu_seqlens`` build the packed-batch index tensors.

Each function runs the C++ implementation in ``areal_fast._C`` when it is
built, else the pure-Python one below (``_partition_ffd_py``,
``_partition_kk_py``, ...). Both follow the same steps and tie-breaking and
return identical results, and raise the same ``ValueError`` messages.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch

from areal_fast._native import load_native

__all__ = ["partition_balanced", "cu_seqlens_from_lengths", "position_ids_from_cu_seqlens"]

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_METHODS = ("kk", "ffd")


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def partition_balanced(
    seqlens: Any,
    max_tokens_per_mb: int,
    *,
    method: str = "kk",
    group_ids: Any = None,
    min_num_mbs: int = 1,
) -> list[list[int]]:
    """Split sequences into micro-batches whose token count fits a budget.

    Parameters
    ----------
    seqlens : list[int] | np.ndarray | torch.Tensor, shape [B], integer dtype
        Token count of each sequence (>= 0).
    max_tokens_per_mb : int
        Token budget of one micro-batch (> 0).
    method : {"kk", "ffd"}
        ``"kk"``: Karmarkar-Karp largest differencing method for balanced k-way
        partitioning (Karmarkar & Karp 1982, "The differencing method of set
        partitioning"). k starts at ``max(min_num_mbs, ceil(sum(seqlens) /
        max_tokens_per_mb))``, never exceeds the number of items, and grows by
        one until the heaviest micro-batch fits the budget. Gives near-equal
        loads, which keeps data-parallel ranks in step.
        ``"ffd"``: first-fit decreasing bin packing (Johnson 1973): sequences
        by length descending (ties by index) each go into the first
        micro-batch with room. Few micro-batches, uneven loads.
    group_ids : list[int] | np.ndarray | torch.Tensor, shape [B], integer dtype, optional
        Group of each sequence (e.g. the GRPO prompt group). Sequences that
        share a group id are packed as one item and are never split across
        micro-batches.
    min_num_mbs : int
        Smallest number of micro-batches for ``"kk"`` (>= 1); capped at the
        number of items. Ignored by ``"ffd"``.

    Returns
    -------
    list[list[int]]
        Sequence indices of each micro-batch, ascending inside a micro-batch;
        micro-batches ordered by their first index. Every index appears
        exactly once and no micro-batch holds more than ``max_tokens_per_mb``
        tokens. Empty ``seqlens`` gives ``[]``.

    Raises
    ------
    ValueError
        Unknown ``method``; ``max_tokens_per_mb <= 0``; ``min_num_mbs < 1``;
        ``seqlens``/``group_ids`` not 1-D or of different lengths; a negative
        length; a sequence (``"seqlens[17] = 5000 exceeds max_tokens_per_mb =
        4096"``) or a group longer than the budget.
    TypeError
        Non-integer ``seqlens``, ``group_ids``, ``max_tokens_per_mb`` or
        ``min_num_mbs``.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    budget = _as_int(max_tokens_per_mb, "max_tokens_per_mb")
    min_mbs = _as_int(min_num_mbs, "min_num_mbs")
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {budget}")
    if min_mbs < 1:
        raise ValueError(f"min_num_mbs must be >= 1, got {min_mbs}")
    lengths = _as_int64_array(seqlens, "seqlens")
    groups = None
    if group_ids is not None:
        groups = _as_int64_array(group_ids, "group_ids")
        if groups.shape[0] != lengths.shape[0]:
            raise ValueError(
                f"group_ids has {groups.shape[0]} entries but seqlens has {lengths.shape[0]}"
            )

    native = load_native()
    if native is not None:
        if method == "kk":
            return native.partition_kk(lengths, budget, min_mbs, group_ids=groups)
        return native.partition_ffd(lengths, budget, group_ids=groups)
    return _partition_py(
        method, lengths.tolist(), None if groups is None else groups.tolist(), budget, min_mbs
    )


def cu_seqlens_from_lengths(lengths: Any) -> torch.Tensor:
    """Cumulative sequence offsets of a packed batch.

    Parameters
    ----------
    lengths : list[int] | np.ndarray | torch.Tensor, shape [B], integer dtype
        Token count of each sequence (>= 0).

    Returns
    -------
    torch.Tensor, shape [B + 1], int32
        ``cu_seqlens[0] = 0``, ``cu_seqlens[i + 1] = cu_seqlens[i] + lengths[i]``.
        On the device of ``lengths`` when it is a tensor, else on the CPU.

    Raises
    ------
    ValueError
        ``lengths`` not 1-D, a negative length, or a total beyond int32.
    TypeError
        Non-integer ``lengths``.
    """
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        _check_int_tensor(lengths, "lengths")
        return _cu_seqlens_from_lengths_torch(lengths)
    array = _as_int64_array(lengths, "lengths")
    native = load_native()
    if native is not None:
        return torch.from_numpy(native.cu_seqlens_from_lengths(array))
    return _cu_seqlens_from_lengths_torch(torch.from_numpy(array))


def position_ids_from_cu_seqlens(cu_seqlens: Any) -> torch.Tensor:
    """Position of every token inside its sequence, restarting at 0 per sequence.

    Parameters
    ----------
    cu_seqlens : list[int] | np.ndarray | torch.Tensor, shape [B + 1], int32 or int64
        Sequence offsets: ``cu_seqlens[0] = 0``, non-decreasing.

    Returns
    -------
    torch.Tensor, shape [T], int64, T = cu_seqlens[-1]
        ``position_ids[cu_seqlens[i] + t] = t``. On the device of
        ``cu_seqlens`` when it is a tensor, else on the CPU.

    Raises
    ------
    ValueError
        ``cu_seqlens`` empty, not 1-D, not starting at 0, decreasing, or with
        values beyond int32.
    TypeError
        Non-integer ``cu_seqlens``.
    """
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        _check_int_tensor(cu_seqlens, "cu_seqlens")
        return _position_ids_torch(cu_seqlens)
    array = _as_int64_array(cu_seqlens, "cu_seqlens")
    native = load_native()
    if native is not None:
        if array.size and (array.min() < -_INT32_MAX - 1 or array.max() > _INT32_MAX):
            raise ValueError("cu_seqlens values must fit in int32")
        return torch.from_numpy(native.position_ids_from_cu_seqlens(array.astype(np.int32)))
    return _position_ids_torch(torch.from_numpy(array))


# ---------------------------------------------------------------------------
# Input conversion
# ---------------------------------------------------------------------------


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_int_tensor(t: torch.Tensor, name: str) -> None:
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")


def _as_int64_array(values: Any, name: str) -> np.ndarray:
    """Any 1-D integer sequence -> contiguous int64 numpy array (CPU)."""
    if isinstance(values, torch.Tensor):
        _check_int_tensor(values, name)
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.size == 0 and array.dtype.kind == "f":
        array = array.astype(np.int64)  # np.asarray([]) is float64
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{name} values must fit in int64")
    return np.ascontiguousarray(array, dtype=np.int64)


# ---------------------------------------------------------------------------
# Pure-Python implementations (fallback and test twin of csrc/packing.cpp)
# ---------------------------------------------------------------------------


def _check_lengths(seqlens: Sequence[int], budget: int) -> None:
    for i, v in enumerate(seqlens):
        if v < 0:
            raise ValueError(f"seqlens[{i}] = {v} is negative")
        if v > budget:
            raise ValueError(f"seqlens[{i}] = {v} exceeds max_tokens_per_mb = {budget}")


def _decreasing_order(seqlens: Sequence[int]) -> list[int]:
    """Indices by length descending, ties by index ascending."""
    return sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i))


def _canonical(mbs: list[list[int]]) -> list[list[int]]:
    for mb in mbs:
        mb.sort()
    mbs.sort(key=lambda mb: mb[0])
    return mbs


def _partition_ffd_py(seqlens: Sequence[int], max_tokens_per_mb: int) -> list[list[int]]:
    """First-fit decreasing (Johnson 1973); same contract as ``_C.partition_ffd``.

    A max segment tree over the remaining room of n bins finds the leftmost
    bin that fits in O(log n). Unopened bins have the full budget and opened
    bins form a prefix, so the leftmost fitting bin is exactly first fit.
    """
    budget = max_tokens_per_mb
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {budget}")
    _check_lengths(seqlens, budget)
    n = len(seqlens)
    if n == 0:
        return []
    leaves = 1 << (n - 1).bit_length()
    room = [-1] * (2 * leaves)
    room[leaves : leaves + n] = [budget] * n
    for v in range(leaves - 1, 0, -1):
        room[v] = max(room[2 * v], room[2 * v + 1])

    bin_of = [0] * n
    num_bins = 0
    for item in _decreasing_order(seqlens):
        w = seqlens[item]
        v = 1
        while v < leaves:
            v = 2 * v if room[2 * v] >= w else 2 * v + 1
        room[v] -= w
        b = v - leaves
        bin_of[item] = b
        num_bins = max(num_bins, b + 1)
        v >>= 1
        while v:
            best = max(room[2 * v], room[2 * v + 1])
            if room[v] == best:
                break  # ancestors are unchanged too
            room[v] = best
            v >>= 1
    mbs: list[list[int]] = [[] for _ in range(num_bins)]
    for i, b in enumerate(bin_of):
        mbs[b].append(i)
    return _canonical(mbs)


def _karmarkar_karp_py(seqlens: Sequence[int], k: int) -> tuple[list[list[int]], int]:
    """One Karmarkar-Karp run into exactly ``k`` parts (1 <= k <= n).

    Returns (micro-batches, heaviest part's load). A partial solution is a set
    of at most k subsets keyed by (sum, sid), sid being a creation number;
    missing subsets are empty. Merging P1 and P2 (sizes m, j) lines P1 up
    largest-first against P2 smallest-first in k slots: the o = m + j - k
    smallest subsets of each overlap, and the t-th smallest of P1 is combined
    with the t-th largest of P2's o smallest (fresh sids in order of t). A
    partition's difference is max_sum - min_sum, with min_sum = 0 while it has
    fewer than k subsets; the two largest differences are merged first, ties
    by creation order. Mirrors ``karmarkar_karp`` in csrc/packing.cpp.
    """
    n = len(seqlens)
    if n == 0:
        return [], 0
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    members: dict[int, list[int]] = {}
    heaps: dict[int, list[tuple[int, int]]] = {}
    max_sums: dict[int, int] = {}
    # Singletons are created in decreasing order, so their (-difference, pid)
    # keys are already sorted: they wait in a list and only merged partitions
    # go through a heap; popping the smaller of the two fronts is the same as
    # one priority queue over all partitions.
    singles: list[tuple[int, int]] = []
    for rank, item in enumerate(_decreasing_order(seqlens)):
        w = seqlens[item]
        members[rank] = [item]
        heaps[rank] = [(w, rank)]
        max_sums[rank] = w
        singles.append((-(w - (w if k == 1 else 0)), rank))
    merged_keys: list[tuple[int, int]] = []
    next_single = 0
    next_sid = next_pid = n

    def pop_pending() -> int:
        nonlocal next_single
        if next_single < n and (not merged_keys or singles[next_single] < merged_keys[0]):
            next_single += 1
            return singles[next_single - 1][1]
        return heapq.heappop(merged_keys)[1]

    while n - next_single + len(merged_keys) > 1:
        p1 = pop_pending()
        p2 = pop_pending()
        h1, h2 = heaps.pop(p1), heaps.pop(p2)
        max1, max2 = max_sums.pop(p1), max_sums.pop(p2)
        overlap = max(0, len(h1) + len(h2) - k)
        low1 = [heapq.heappop(h1) for _ in range(overlap)]
        low2 = [heapq.heappop(h2) for _ in range(overlap)]
        max_sum = max(max1 if h1 else -1, max2 if h2 else -1)
        merged, rest = (h1, h2) if len(h1) >= len(h2) else (h2, h1)
        for s in rest:
            heapq.heappush(merged, s)
        for t in range(overlap):
            (sum_a, sid_a), (sum_b, sid_b) = low1[t], low2[overlap - 1 - t]
            items_a, items_b = members.pop(sid_a), members.pop(sid_b)
            if len(items_a) < len(items_b):
                items_a, items_b = items_b, items_a
            items_a.extend(items_b)
            members[next_sid] = items_a
            heapq.heappush(merged, (sum_a + sum_b, next_sid))
            max_sum = max(max_sum, sum_a + sum_b)
            next_sid += 1
        heaps[next_pid] = merged
        max_sums[next_pid] = max_sum
        low = merged[0][0] if len(merged) == k else 0
        heapq.heappush(merged_keys, (-(max_sum - low), next_pid))
        next_pid += 1

    pid = pop_pending()
    mbs = [members[sid] for _, sid in heaps[pid]]
    return _canonical(mbs), max_sums[pid]


def _partition_kk_py(
    seqlens: Sequence[int], max_tokens_per_mb: int, min_num_mbs: int = 1
) -> list[list[int]]:
    """Karmarkar-Karp with a token budget; same contract as ``_C.partition_kk``."""
    budget = max_tokens_per_mb
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {budget}")
    if min_num_mbs < 1:
        raise ValueError(f"min_num_mbs must be >= 1, got {min_num_mbs}")
    _check_lengths(seqlens, budget)
    n = len(seqlens)
    if n == 0:
        return []
    total = sum(seqlens)
    if total > _INT64_MAX:
        raise ValueError("total of seqlens overflows int64")
    k = max(1, min(max(min_num_mbs, -(-total // budget)), n))
    while True:
        mbs, max_load = _karmarkar_karp_py(seqlens, k)
        if max_load <= budget or k >= n:
            return mbs
        k += 1


def _group_sequences_py(
    seqlens: Sequence[int], group_ids: Sequence[int]
) -> tuple[list[int], list[list[int]]]:
    """Merge sequences sharing a group id into items, numbered by first appearance.

    Returns (item lengths, sequence indices of each item).
    """
    item_of: dict[int, int] = {}
    lengths: list[int] = []
    members: list[list[int]] = []
    for i, (v, g) in enumerate(zip(seqlens, group_ids)):
        if v < 0:
            raise ValueError(f"seqlens[{i}] = {v} is negative")
        item = item_of.setdefault(g, len(lengths))
        if item == len(lengths):
            lengths.append(0)
            members.append([])
        lengths[item] += v
        if lengths[item] > _INT64_MAX:
            raise ValueError("total of seqlens overflows int64")
        members[item].append(i)
    return lengths, members


def _partition_py(
    method: str,
    seqlens: Sequence[int],
    group_ids: Sequence[int] | None,
    max_tokens_per_mb: int,
    min_num_mbs: int = 1,
) -> list[list[int]]:
    """Pure-Python ``partition_balanced`` body; mirrors ``partition_sequences`` in C++."""
    budget = max_tokens_per_mb
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {budget}")
    if method == "kk" and min_num_mbs < 1:
        raise ValueError(f"min_num_mbs must be >= 1, got {min_num_mbs}")

    def run(lengths: Sequence[int]) -> list[list[int]]:
        if method == "ffd":
            return _partition_ffd_py(lengths, budget)
        return _partition_kk_py(lengths, budget, min_num_mbs)

    if group_ids is None:
        return run(seqlens)
    lengths, members = _group_sequences_py(seqlens, group_ids)
    for total, seqs in zip(lengths, members):
        if total > budget:
            raise ValueError(
                f"group {group_ids[seqs[0]]} (first at seqlens[{seqs[0]}]) has "
                f"{total} tokens, exceeding max_tokens_per_mb = {budget}"
            )
    item_mbs = run(lengths)
    return _canonical([[s for item in items for s in members[item]] for items in item_mbs])


def _cu_seqlens_from_lengths_torch(lengths_B: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``_C.cu_seqlens_from_lengths`` (any device)."""
    lengths = lengths_B.to(torch.int64)
    cum = torch.cumsum(lengths, 0)
    negative = (lengths < 0).nonzero()
    overflow = (cum > _INT32_MAX).nonzero()
    first_neg = int(negative[0, 0]) if negative.numel() else None
    first_over = int(overflow[0, 0]) if overflow.numel() else None
    if first_over is not None and (first_neg is None or first_over < first_neg):
        raise ValueError(
            f"total of lengths exceeds the int32 range of cu_seqlens at lengths[{first_over}]"
        )
    if first_neg is not None:
        raise ValueError(f"lengths[{first_neg}] = {int(lengths[first_neg])} is negative")
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = cum
    return out


def _position_ids_torch(cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``_C.position_ids_from_cu_seqlens`` (any device)."""
    if cu_seqlens_B1.numel() == 0:
        raise ValueError("cu_seqlens must have at least one element")
    cu = cu_seqlens_B1.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    bad = (lengths < 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0]) + 1
        raise ValueError(
            f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}] = "
            f"{int(cu[i])} < cu_seqlens[{i - 1}] = {int(cu[i - 1])}"
        )
    if int(cu[-1]) > _INT32_MAX:
        raise ValueError("cu_seqlens values must fit in int32")
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64, device=cu.device) - starts
