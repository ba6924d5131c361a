"""Supervised fine-tuning rows (``areal-fast sft``'s ``data.*`` keys): token ids and the
mask of the tokens the loss is taken on.

A row is either a prompt and a completion (two text columns) or a chat conversation (a
column of ``{"role", "content"}`` messages). A prompt/completion row is rendered as one user
turn and one assistant turn with the tokenizer's chat template (``data.chat_template``;
without a template, or with it off, as the plain prompt text followed by the completion text
and the end-of-sequence token); only the assistant turn's tokens are trained. A conversation
trains every assistant turn and nothing else: each turn's tokens are found by rendering the
conversation up to the turn before it with the generation prompt, and up to the turn itself,
so the template's own assistant header stays untrained and its end-of-turn token is trained.

Rows are read as ``data.task: jsonl | hf`` rows of the RL command are
(:mod:`areal_fast.data.user_data`); every row is checked and tokenized before anything is
written, and a bad one raises one line naming the file, the row and the key.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areal_fast.data.jsonl import jsonl_rows
from areal_fast.data.rewards import _as_token_list
from areal_fast.data.user_data import _hf_split, _load_hf, _messages

SFT_TASKS = ("jsonl", "hf")


@dataclass
class SftDataConfig:
    """Supervised rows: prompt and completion columns, or chat messages."""

    # "jsonl" (data.path: a .jsonl file, or a folder holding {split}.jsonl) or "hf" (a
    # Hugging Face dataset id or a datasets.save_to_disk folder; needs `pip install datasets`)
    task: str = "jsonl"
    path: Optional[str] = None  # the rows (required by areal-fast sft; see task)
    split: str = "train"  # {split}.jsonl of a data.path folder, or the HF split
    prompt_key: str = "prompt"  # column of the prompt text (prompt/completion rows)
    completion_key: str = "completion"  # column of the trained completion text
    # column of chat messages [{role, content}, ...]; set: rows are conversations and the
    # loss is taken on every assistant turn (prompt_key / completion_key are not read)
    messages_key: Optional[str] = None
    # render prompt/completion rows as a user and an assistant turn with the tokenizer's
    # chat template (false, or a tokenizer without one: prompt text + completion text + EOS)
    chat_template: bool = True
    max_rows: Optional[int] = None  # use the first max_rows rows of the split (None: all)

    def __post_init__(self):
        if self.task not in SFT_TASKS:
            raise ValueError(f"task = {self.task!r} is not one of {', '.join(SFT_TASKS)}")
        for key in ("prompt_key", "completion_key", "messages_key", "split"):
            value = getattr(self, key)
            if value is not None and not value:
                raise ValueError(f"{key} must be a non-empty name")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows = {self.max_rows} must be >= 1 (null: all rows)")


@dataclass
class SftExample:
    """One tokenized row.

    Attributes
    ----------
    input_ids : list of int, length L
        The whole rendered row.
    targets : list of bool, length L
        True where the token is trained (predicted from the tokens before it): completion
        or assistant-turn tokens.
    where : str
        The row's file (or dataset split) and row, for messages.
    """

    input_ids: list
    targets: list
    where: str

    @property
    def num_targets(self) -> int:
        """Trained tokens of the row."""
        return sum(self.targets)


def read_rows(d: SftDataConfig) -> list[tuple[str, dict]]:
    """``(where, row)`` pairs of ``d.split``: ``where`` is ``"<file> line <n>"`` (jsonl,
    1-based) or ``"<dataset> [<split>] index <i>"`` (hf, 0-based); the first ``d.max_rows``.

    Raises
    ------
    FileNotFoundError
        ``data.path`` is missing, or its folder has no ``{split}.jsonl``.
    ValueError
        One line naming the file and line: invalid JSON, a row that is not an object, an
        empty file; a missing HF split.
    ImportError
        ``task`` is hf and ``datasets`` is not installed.
    """
    if d.task == "jsonl":
        path = Path(d.path).expanduser()
        if path.is_dir():
            path = path / f"{d.split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"data.path {d.path}: no such file ({path})")
        rows = jsonl_rows(path)
    else:
        loaded = _load_hf(d.path)
        if isinstance(loaded, Mapping):  # a DatasetDict: pick the split
            if d.split not in loaded:
                raise ValueError(
                    f"data.path {d.path}: no split {d.split!r} (data.split; its splits: "
                    f"{', '.join(loaded)})"
                )
            loaded = loaded[d.split]
        rows = _hf_split(d.path, loaded, d.split).rows
    return rows[: d.max_rows] if d.max_rows else rows


def _text(row: dict, where: str, key: str) -> str:
    if key not in row:
        raise ValueError(f"{where}: missing key '{key}' (keys: {', '.join(sorted(row))})")
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: '{key}' is empty")
    return value


def _render(tokenizer, messages: list, generation_prompt: bool) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt
    )
    return _as_token_list(encoded)


def conversation_tokens(tokenizer, messages: list, where: str = "row") -> SftExample:
    """Token ids of a chat conversation with every assistant turn marked as trained.

    Parameters
    ----------
    tokenizer : transformers tokenizer with a chat template
    messages : list of dict
        ``{"role", "content"}`` messages; at least one has role ``assistant``.
    where : str
        The row's name for errors.

    Returns
    -------
    SftExample
        ``input_ids``: the template's rendering of the whole conversation; ``targets``:
        True on each assistant turn's tokens after the template's assistant header (its
        content and end-of-turn tokens), False elsewhere.

    Raises
    ------
    ValueError
        No assistant turn; or the template renders a conversation's start differently from
        the whole (it is not prefix-stable, so the turns cannot be told apart).
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to train on")
    ids: list[int] = []
    targets: list[bool] = []
    for k, message in enumerate(messages):
        head = _render(tokenizer, messages[:k], True) if message["role"] == "assistant" else ids
        full = _render(tokenizer, messages[: k + 1], False)
        if full[: len(ids)] != ids or full[: len(head)] != head or len(head) < len(ids):
            raise ValueError(
                f"{where}: the tokenizer's chat template renders message {k} without "
                "repeating the conversation before it; its assistant turns cannot be found"
            )
        trained = message["role"] == "assistant"
        targets += [False] * (len(head) - len(ids)) + [trained] * (len(full) - len(head))
        ids = full
    return SftExample(ids, targets, where)


def _prompt_completion(tokenizer, prompt: str, completion: str, d: SftDataConfig, where):
    if d.chat_template and getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return conversation_tokens(tokenizer, messages, where)
    head = [int(t) for t in tokenizer.encode(prompt)]
    tail = [int(t) for t in tokenizer.encode(completion, add_special_tokens=False)]
    if tokenizer.eos_token_id is not None:
        tail.append(int(tokenizer.eos_token_id))
    return SftExample(head + tail, [False] * len(head) + [True] * len(tail), where)


def row_tokens(tokenizer, row: dict, where: str, d: SftDataConfig) -> SftExample:
    """One checked row tokenized (see the module notes).

    Raises
    ------
    ValueError
        One line naming the row and the key: a missing key, a prompt or completion that is
        not a string or is empty, malformed messages or none from the assistant, a
        conversation without a chat template.
    """
    if d.messages_key is None:
        prompt = _text(row, where, d.prompt_key)
        completion = _text(row, where, d.completion_key)
        return _prompt_completion(tokenizer, prompt, completion, d, where)
    if d.messages_key not in row:
        raise ValueError(
            f"{where}: missing key '{d.messages_key}' (keys: {', '.join(sorted(row))})"
        )
    messages = list(_messages(row[d.messages_key], where, d.messages_key))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: '{d.messages_key}' needs a tokenizer with a chat template")
    return conversation_tokens(tokenizer, messages, f"{where}: '{d.messages_key}'")


def load_sft_examples(d: SftDataConfig, tokenizer, max_tokens: int) -> list[SftExample]:
    """Every row of ``d`` checked and tokenized.

    Parameters
    ----------
    d : SftDataConfig
    tokenizer : transformers tokenizer
    max_tokens : int
        The longest row allowed (``actor.max_tokens_per_mb``: a row is never split).

    Returns
    -------
    list of SftExample, in file order

    Raises
    ------
    ValueError, FileNotFoundError, ImportError
        One line naming the file, the row and the key (:func:`read_rows`,
        :func:`row_tokens`), or a row of more than ``max_tokens`` tokens.
    """
    examples = []
    for where, row in read_rows(d):
        example = row_tokens(tokenizer, row, where, d)
        if len(example.input_ids) > max_tokens:
            key = d.messages_key or f"{d.prompt_key}' + '{d.completion_key}"
            raise ValueError(
                f"{where}: '{key}' is {len(example.input_ids)} tokens, more than "
                f"actor.max_tokens_per_mb = {max_tokens} (a row is never split)"
            )
        examples.append(example)
    return examples


def step_rows(num_rows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Row indices of training step ``step`` (0-based): the rows in a fresh random order per
    pass over the data (``random.Random(seed + pass)``), ``batch_size`` at a time, a batch
    that crosses the end of a pass continuing in the next pass's order.

    A function of ``(seed, step)`` alone, so a resumed run draws the rows an uninterrupted
    one would.

    Returns
    -------
    list of int, length ``batch_size``, each in ``[0, num_rows)``

    Raises
    ------
    ValueError
        ``num_rows`` or ``batch_size`` < 1, or ``step`` < 0.
    """
    if num_rows < 1 or batch_size < 1 or step < 0:
        raise ValueError(
            f"num_rows, batch_size >= 1 and step >= 0, got {num_rows, batch_size, step}"
        )
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, num_rows)
        out.append(_order(num_rows, seed + epoch)[index])
    return out


@functools.lru_cache(maxsize=2)  # a batch at a pass boundary needs two orders
def _order(num_rows: int, seed: int) -> tuple[int, ...]:
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    return tuple(order)


__all__ = [
    "SFT_TASKS",
    "SftDataConfig",
    "SftExample",
    "conversation_tokens",
    "load_sft_examples",
    "read_rows",
    "row_tokens",
    "step_rows",
]
