"""Training and held-out problems (``data.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from areal_fast._checks import at_least
from areal_fast.data.rewards import DEFAULT_INSTRUCTION

USER_TASKS = ("jsonl", "hf")
"""``data.task`` values that read the user's own rows (see :mod:`areal_fast.data.user_data`)."""


@dataclass
class DataConfig:
    """Training and held-out problems."""

    # "gsm8k" (read from data.path), a reasoning-gym dataset name (generated offline), or
    # your own rows: "jsonl" (data.path: a .jsonl file or a folder of {split}.jsonl files)
    # or "hf" (data.path: a Hugging Face dataset id or a datasets.save_to_disk folder)
    task: str = "basic_arithmetic"
    # where GSM8K comes from: a .jsonl file, a folder holding {split}.jsonl (train.jsonl,
    # test.jsonl), or a Hugging Face dataset id such as openai/gsm8k (its "main" config;
    # needs `pip install datasets` and network access); None: openai/gsm8k. jsonl and hf:
    # required (as above). Generated tasks: None
    path: Optional[str] = None
    # jsonl/hf: the column holding the prompt as plain text (data.instruction is appended,
    # as for the built-in tasks); set exactly one of prompt_key and messages_key
    prompt_key: Optional[str] = None
    # jsonl/hf: the column holding the prompt as chat messages, a list of {role, content},
    # rendered with the tokenizer's chat template as given (data.instruction is not added)
    messages_key: Optional[str] = None
    # jsonl/hf: the column of the reference answer (a string or a number; numbers are
    # normalised, "1,234.50" -> "1234.5"); every other column reaches the reward too
    answer_key: str = "answer"
    # generator settings of a reasoning-gym task (examples/arith.yaml sets the demo's); a YAML
    # file or key=value merges into this mapping, and `data.task_kwargs={}` on the command
    # line empties it (e.g. to switch arith.yaml to data.task=gsm8k, which takes none)
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    # split of the training problems ({split}.jsonl of a data.path folder, or the HF
    # split; a data.path file is read whatever the split); reasoning-gym tasks ignore it
    train_split: str = "train"
    # split of the held-out problems (as train_split). jsonl/hf without this split (a
    # single file, or a folder or dataset without it): drawn from the training rows with
    # eval_seed and removed from them
    eval_split: str = "test"
    # training problems: GSM8K, jsonl, hf: a random subset of train_split drawn with
    # train_seed (None: the whole split); reasoning-gym, how many to generate (None: the
    # task's default size)
    train_size: Optional[int] = 2000
    # held-out problems: the first eval_size distinct questions of eval_seed's draw (GSM8K,
    # jsonl, hf: a random subset of eval_split, kept in file order)
    eval_size: int = 200
    train_seed: int = 0  # reasoning-gym generator seed of the training set (others: its subset)
    # seed of the held-out set (as train_seed); questions also in it are dropped from
    # training. reasoning-gym draws item i with seed + i, so nearby seeds overlap: keep
    # train_seed and eval_seed far apart
    eval_seed: int = 999
    # appended to every plain-text question of the prompt (training and held-out): the
    # answer format the reward expects; "" sends the question alone
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self):
        at_least("eval_size", self.eval_size, 1)
        if self.train_size is not None:
            at_least("train_size", self.train_size, 1)
        keys = [k for k in ("prompt_key", "messages_key") if getattr(self, k) is not None]
        if self.task not in USER_TASKS:
            if keys:
                raise ValueError(
                    f"{keys[0]} is only read by data.task jsonl or hf, not {self.task!r}"
                )
            return
        if not self.path:
            raise ValueError(
                f"path is required with data.task={self.task} ("
                + (
                    "a .jsonl file or a folder of {split}.jsonl files)"
                    if self.task == "jsonl"
                    else "a Hugging Face dataset id or a saved dataset folder)"
                )
            )
        if len(keys) != 1:
            what = "both are set" if keys else "neither is set"
            raise ValueError(
                f"prompt_key / messages_key: data.task={self.task} needs exactly one of them "
                f"({what}): prompt_key names a plain-text column, messages_key a column of "
                "chat messages"
            )
        for key in ("prompt_key", "messages_key", "answer_key"):
            value = getattr(self, key)
            if value is not None and not value:
                raise ValueError(f"{key} must be a non-empty column name")
