"""Training and held-out problems (``data.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from areal_fast._checks import at_least
from areal_fast.data.rewards import DEFAULT_INSTRUCTION


@dataclass
class DataConfig:
    """Training and held-out problems."""

    task: str = "basic_arithmetic"  # "gsm8k" or a reasoning-gym dataset name
    path: Optional[str] = None  # GSM8K: jsonl file, folder with {split}.jsonl, or HF id
    # generator settings of a reasoning-gym task (examples/arith.yaml sets the demo's);
    # YAML/CLI layers merge into this mapping, they cannot empty it
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    train_size: Optional[int] = 2000  # None: the whole split (GSM8K)
    eval_size: int = 200
    train_seed: int = 0  # reasoning-gym generator seed of the training set
    # ... and of the held-out set; questions also in it are dropped from training. reasoning-
    # gym draws item i with seed + i, so nearby seeds overlap: keep the two far apart
    eval_seed: int = 999
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self):
        at_least("eval_size", self.eval_size, 1)
        if self.train_size is not None:
            at_least("train_size", self.train_size, 1)
