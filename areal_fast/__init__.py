"""areal_fast: fully asynchronous RL for LLMs (GRPO family) with fast kernels and weight sync.

Public API (everything else is internal and may change):

- :func:`linear_logprobs` — token log-probs / entropy through the LM head without [T, V] logits
- :func:`grpo_loss`, :class:`LossConfig` — GRPO-family policy loss on packed sequences
- :func:`fused_linear_grpo_loss` — the loss straight from hidden states, one vocabulary pass
- :func:`group_advantages` — GRPO / Dr.GRPO / RLOO advantages
- :func:`partition_balanced`, :func:`cu_seqlens_from_lengths`,
  :func:`position_ids_from_cu_seqlens` — sequence packing (native C++ with a Python fallback)
- :func:`segment_sum` — per-sequence sums over packed tokens
"""

from areal_fast.ops.logprobs import linear_logprobs
from areal_fast.ops.packing import (
    cu_seqlens_from_lengths,
    partition_balanced,
    position_ids_from_cu_seqlens,
)
from areal_fast.ops.segment import segment_sum
from areal_fast.rl.advantages import group_advantages
from areal_fast.rl.config import LossConfig
from areal_fast.rl.fused_loss import fused_linear_grpo_loss
from areal_fast.rl.objectives import grpo_loss

__version__ = "0.1.0"

__all__ = [
    "LossConfig",
    "cu_seqlens_from_lengths",
    "fused_linear_grpo_loss",
    "group_advantages",
    "grpo_loss",
    "linear_logprobs",
    "partition_balanced",
    "position_ids_from_cu_seqlens",
    "segment_sum",
]
