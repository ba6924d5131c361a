"""Training and held-out problems (``data.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from areal_fast._checks import at_least
from areal_fast.data.rewards import DEFAULT_INSTRUCTION


@dataclass
class DataConfig:
    """Training and held-out problems."""

    # "gsm8k" (read from data.path) or a reasoning-gym dataset name (generated offline)
    task: str = "basic_arithmetic"
    # where GSM8K comes from: a .jsonl file, a folder holding {split}.jsonl (train.jsonl,
    # test.jsonl), or a Hugging Face dataset id such as openai/gsm8k (its "main" config;
    # needs `pip install datasets` and network access); None: openai/gsm8k. Other tasks: None
    path: Optional[str] = None
    # generator settings of a reasoning-gym task (examples/arith.yaml sets the demo's); a YAML
    # file or key=value merges into this mapping, and `data.task_kwargs={}` on the command
    # line empties it (e.g. to switch arith.yaml to data.task=gsm8k, which takes none)
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    # GSM8K split of the training problems ({split}.jsonl of a data.path folder, or the HF
    # split; a data.path file is read whatever the split); reasoning-gym tasks ignore it
    train_split: str = "train"
    eval_split: str = "test"  # GSM8K split of the held-out problems (as train_split)
    # training problems: GSM8K, a random subset of train_split drawn with train_seed (None:
    # the whole split); reasoning-gym, how many to generate (None: the task's default size)
    train_size: Optional[int] = 2000
    # held-out problems: the first eval_size distinct questions of eval_seed's draw (GSM8K:
    # a random subset of eval_split, kept in file order)
    eval_size: int = 200
    train_seed: int = 0  # reasoning-gym generator seed of the training set (GSM8K: its subset)
    # seed of the held-out set (as train_seed); questions also in it are dropped from
    # training. reasoning-gym draws item i with seed + i, so nearby seeds overlap: keep
    # train_seed and eval_seed far apart
    eval_seed: int = 999
    # appended to every question of the prompt (training and held-out): the answer format
    # the reward expects
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self):
        at_least("eval_size", self.eval_size, 1)
        if self.train_size is not None:
            at_least("train_size", self.train_size, 1)
