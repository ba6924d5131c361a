"""Group-relative advantages for GRPO-family methods (pure tensor functions)."""

from __future__ import annotations

import torch

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "batch")


def _group_index(rewards, group_size, group_ids):
    """Dense group index [B] int64 from either a fixed group size or explicit group ids."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size or group_ids")
    num = rewards.shape[0]
    if group_ids is not None:
        if group_ids.shape != rewards.shape:
            raise ValueError(f"group_ids must be [B={num}], got {tuple(group_ids.shape)}")
        return torch.unique(group_ids, return_inverse=True)[1].to(rewards.device)
    if group_size < 1 or num % group_size:
        raise ValueError(f"group_size = {group_size} does not divide the batch of {num}")
    return torch.arange(num, device=rewards.device) // group_size


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    mode: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence advantages from scalar rewards, relative to each GRPO group.

    - ``"grpo"``: A_i = (r_i − mean_g) / (std_g + eps), unbiased std (N − 1)
      (Shao et al. 2024, DeepSeekMath, §4.1.2).
    - ``"dr_grpo"``: A_i = r_i − mean_g (Liu et al. 2025, "Understanding R1-Zero-Like
      Training", Dr. GRPO).
    - ``"rloo"``: A_i = r_i − mean of the other members of the group (Ahmadian et al. 2024).
    - ``"batch"``: (r_i − mean) / (std + eps) over the whole batch.

    Groups of size 1 give advantage 0 (there is nothing to compare against). Vectorised: no
    Python loop over groups.

    Parameters
    ----------
    rewards : Tensor [B], float
    group_size : int, optional
        Consecutive runs of ``group_size`` sequences form a group (B must be a multiple).
    group_ids : Tensor [B], int64, optional
        Explicit group of each sequence, any order and sizes. Exactly one of ``group_size``
        and ``group_ids`` must be given.
    mode : str
        One of ``"grpo" | "dr_grpo" | "rloo" | "batch"``.
    eps : float
        Added to the std in "grpo" and "batch".

    Returns
    -------
    Tensor [B], float32

    Raises
    ------
    ValueError
        Unknown mode, rewards not 1-D, both or neither grouping given, bad group_size.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode = {mode!r} is not one of {ADVANTAGE_MODES}")
    rewards = torch.as_tensor(rewards)
    if group_ids is not None:
        group_ids = torch.as_tensor(group_ids)
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    if mode == "batch":
        if rewards.numel() < 2:
            return torch.zeros_like(rewards)
        return (rewards - rewards.mean()) / (rewards.std() + eps)
    index = _group_index(rewards, group_size, group_ids)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(num_groups, device=rewards.device).index_add_(
        0, index, torch.ones_like(rewards)
    )
    total = torch.zeros(num_groups, device=rewards.device).index_add_(0, index, rewards)
    n = count[index]
    singleton = n < 2
    if mode == "rloo":
        others = (total[index] - rewards) / (n - 1).clamp(min=1)
        return torch.where(singleton, 0.0, rewards - others)
    centred = rewards - (total / count)[index]
    if mode == "dr_grpo":
        return torch.where(singleton, 0.0, centred)
    sq = torch.zeros(num_groups, device=rewards.device).index_add_(0, index, centred**2)
    std = (sq[index] / (n - 1).clamp(min=1)).sqrt()
    return torch.where(singleton, 0.0, centred / (std + eps))
