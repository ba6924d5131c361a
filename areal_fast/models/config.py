"""Which causal LM to load and how to hold it (``model.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_fast.models.loading import DEMO_MODEL

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelConfig:
    """Which causal LM to train and how to hold it."""

    path: str = DEMO_MODEL  # HF id, local directory, or the offline demo model
    # dtype of the weights in the engines and the trainer: "float32" | "bfloat16" | "float16"
    # (a trainer on CUDA keeps float32 master weights and computes in bfloat16/float16)
    dtype: str = "float32"
    attn_implementation: str = "sdpa"  # transformers attention backend of the engine
    # where the engines and the trainer run: "cpu", "cuda" or "cuda:N" (with several trainer
    # ranks on CUDA each rank uses its own GPU)
    device: str = "cpu"

    def __post_init__(self):
        import torch

        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device = {self.device!r} is not a torch device") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device = {self.device!r} but torch has no CUDA device here")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device = {self.device!r}: only 'cpu' and 'cuda' are supported")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype = {self.dtype!r} is not 'float32', 'bfloat16' or 'float16'")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation = {self.attn_implementation!r} is not one "
                f"of {ATTN_IMPLEMENTATIONS}"
            )
