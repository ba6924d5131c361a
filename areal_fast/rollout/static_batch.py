"""Static batches through ``model.generate``: left-padded rows that run until the longest ends.

The embedded engine's ``rollout.hf_batching: static`` mode
(:class:`~areal_fast.rollout.hf_engine.HFEngine`), kept as the reference the continuous
batches (:mod:`areal_fast.rollout.decode_batch`) are tested and measured against.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import StoppingCriteria

from areal_fast.rollout.sampling import SeededSampler


@dataclass
class RowResult:
    """Tokens generated for one row of a batch, cut at its budget or end-of-sequence.

    Attributes
    ----------
    tokens : list[int]
    logprobs : list[float]
        Behaviour log-prob of each token (fp32 nats).
    stop_reason : str
        "stop", "length" or "abort".
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


class _StopRows(StoppingCriteria):
    """Finish each row at its own budget, and every row once ``abort`` is set.

    Parameters
    ----------
    start_len : int
        Width of the padded input.
    budgets : torch.Tensor
        New-token budget of each row, shape [rows], int64, on the generation device.
    abort : threading.Event or None
        When set, every row is reported finished at the next step.
    """

    def __init__(self, start_len: int, budgets: torch.Tensor, abort: Optional[threading.Event]):
        self.start_len = start_len
        self.budgets = budgets
        self.abort = abort

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if self.abort is not None and self.abort.is_set():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.budgets <= input_ids.shape[1] - self.start_len


@torch.inference_mode()
def generate_rows(
    model,
    pad_id: int,
    eos_id: Optional[int],
    inputs: list[list[int]],
    budgets: list[int],
    temperature: float,
    top_p: float,
    seeds: Optional[list[int]] = None,
    offsets: Optional[list[int]] = None,
    abort: Optional[threading.Event] = None,
) -> list[RowResult]:
    """One left-padded ``model.generate`` over rows with their own budgets.

    Parameters
    ----------
    model : transformers PreTrainedModel
        The caller holds whatever lock guards it.
    pad_id, eos_id : int
        Padding and end-of-sequence tokens.
    inputs : list[list[int]]
        Token ids of each row (non-empty).
    budgets : list[int]
        New tokens at most per row.
    temperature, top_p : float
        Shared by every row; temperature 0 is greedy (log-probs at temperature 1).
    seeds, offsets : list[int], optional
        Per-row sampling seed and completion tokens before this call: seeded draws
        (:class:`~areal_fast.rollout.sampling.SeededSampler`); without seeds, torch's
        generator.
    abort : threading.Event, optional
        Set: every row ends at the next token (stop_reason "abort").

    Returns
    -------
    list[RowResult]
        Per row, its tokens cut at its budget or after its first end-of-sequence token.
    """
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    width = max(len(p) for p in inputs)
    input_ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(inputs):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sample = temperature > 0
    seeded = sample and seeds is not None
    random = sample and not seeded
    config = GenerationConfig(
        do_sample=random,
        temperature=temperature if random else None,
        top_p=top_p if random else None,
        top_k=0 if random else None,
        max_new_tokens=max(budgets),
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    processors = LogitsProcessorList()
    if seeded:
        processors.append(
            SeededSampler(seeds, offsets or [0] * len(inputs), width, temperature, top_p)
        )
    device = next(model.parameters()).device
    result = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        generation_config=config,
        logits_processor=processors,
        stopping_criteria=StoppingCriteriaList(
            [_StopRows(width, torch.tensor(budgets, dtype=torch.long, device=device), abort)]
        ),
    )
    new_ids = result.sequences[:, width:]
    scale = temperature if sample else 1.0
    logprobs = torch.stack(  # on the generation device, then one copy to the host
        [
            torch.log_softmax(s.float() / scale, dim=-1).gather(1, new_ids[:, i : i + 1])[:, 0]
            for i, s in enumerate(result.logits)
        ],
        dim=1,
    ).cpu()
    new_tokens = new_ids.cpu()
    return [
        _cut(new_tokens[row], logprobs[row], budgets[row], eos_id) for row in range(len(inputs))
    ]


def _cut(tokens: torch.Tensor, logprobs: torch.Tensor, budget: int, eos_id) -> RowResult:
    tokens = tokens[:budget].tolist()
    if eos_id is not None and eos_id in tokens:
        length, reason = tokens.index(eos_id) + 1, "stop"
    else:
        length, reason = len(tokens), "length" if len(tokens) == budget else "abort"
    return RowResult(tokens[:length], logprobs[:length].tolist(), reason)
