"""Supervised fine-tuning step on the trainer engine: packed rows, the token-mean negative
log-likelihood from the fused LM-head log-probs, one AdamW update.

The loss is the standard maximum-likelihood cross-entropy of the trained tokens,

    L = −(1 / N) Σ_t m_t · log p_θ(x_{t+1} | x_{≤t}),   N = Σ_t m_t,

over every trained position t of the whole batch (m_t: the next token is a completion or
assistant-turn token). Its log-probs come from
:func:`~areal_fast.ops.logprobs.linear_logprobs` on the final hidden states and the LM-head
weight (through :func:`~areal_fast.train.torch_engine.packed_forward_logprobs`), so the
[T, V] logits are never formed as one tensor. Rows are packed without padding into
micro-batches of at most ``actor.max_tokens_per_mb`` tokens by the engine's balanced
partitioner; each micro-batch's backward carries its share of the batch's sum, so the
accumulated gradient is that of one pass over the whole batch.
"""

from __future__ import annotations

import math

import torch

from areal_fast.ops.packing import cu_seqlens_from_lengths, position_ids_from_cu_seqlens
from areal_fast.rl.batch import IGNORE_INDEX, PackedBatch
from areal_fast.train.lora import set_dropout_active
from areal_fast.train.torch_engine import TorchTrainEngine, packed_forward_logprobs


def pack_rows(rows: list[tuple[list[int], list[bool]]]) -> PackedBatch:
    """Pack tokenized rows into one :class:`~areal_fast.rl.batch.PackedBatch`.

    Parameters
    ----------
    rows : list of (input_ids, targets), length B
        ``input_ids`` list of int, length L_b >= 1; ``targets`` list of bool, length L_b:
        True where the token is trained. The first token of a row is never predicted.

    Returns
    -------
    PackedBatch
        ``input_ids`` [T] int64, ``position_ids`` [T] int64, ``cu_seqlens`` [B+1] int32;
        ``labels`` [T] int64 = the next token where it is trained, else -100 (always at
        each row's last token); ``loss_mask`` [T] bool = ``labels != -100``;
        ``behav_logprobs``, ``advantages`` [T] float32 zeros, ``versions`` [T] int32 -1,
        ``rewards`` [B] float32 zeros, ``group_ids`` [B] int64 = 0..B-1 (unused by SFT).

    Raises
    ------
    ValueError
        A row is empty or its two lists differ in length.
    """
    ids, labels = [], []
    for b, (row_ids, targets) in enumerate(rows):
        if not row_ids or len(row_ids) != len(targets):
            raise ValueError(
                f"row {b}: input_ids ({len(row_ids)}) and targets ({len(targets)}) must "
                f"have the same length >= 1"
            )
        ids.extend(row_ids)
        labels.extend(t if m else IGNORE_INDEX for t, m in zip(row_ids[1:], targets[1:]))
        labels.append(IGNORE_INDEX)
    lengths = [len(r[0]) for r in rows]
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    labels_T = torch.tensor(labels, dtype=torch.int64)
    T, B = len(ids), len(rows)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths, default=0),
        labels=labels_T,
        loss_mask=labels_T != IGNORE_INDEX,
        behav_logprobs=torch.zeros(T, dtype=torch.float32),
        versions=torch.full((T,), -1, dtype=torch.int32),
        advantages=torch.zeros(T, dtype=torch.float32),
        rewards=torch.zeros(B, dtype=torch.float32),
        group_ids=torch.arange(B, dtype=torch.int64),
    )


def nll_sum(model, batch: PackedBatch) -> torch.Tensor:
    """Summed negative log-likelihood of ``batch``'s trained tokens (0-d float32, with grad).

    Σ_t −log p(labels[t]) over ``loss_mask``, the log-probs from the fused LM-head path at
    temperature 1 (:func:`~areal_fast.train.torch_engine.packed_forward_logprobs`: 0 where
    ``labels == -100``).
    """
    device = next(model.parameters()).device
    logprobs, _ = packed_forward_logprobs(model, batch.to(device), 1.0, with_entropy=False)
    return -logprobs.float().sum()


def accumulate_sft_gradients(engine: TorchTrainEngine, batch: PackedBatch) -> tuple[float, int]:
    """Add the gradient of the batch's token-mean NLL to the trained parameters' ``.grad``.

    For each micro-batch of at most ``actor.max_tokens_per_mb`` tokens
    (:meth:`TorchTrainEngine.micro_batches`) its NLL sum divided by the batch's trained
    tokens N is back-propagated, so the accumulated gradient equals that of one pass over
    the whole batch. LoRA adapters' dropout is active during the passes when set.

    Parameters
    ----------
    engine : TorchTrainEngine
    batch : PackedBatch
        From :func:`pack_rows`.

    Returns
    -------
    loss : float
        The token-mean NLL (nats) of the batch.
    micro_batches : int

    Raises
    ------
    ValueError
        ``batch`` has no trained token.
    """
    total = int(batch.loss_mask.sum())
    if total == 0:
        raise ValueError("the batch has no trained token")
    parts = engine.micro_batches(batch)
    lora = engine.actor.lora
    if lora.enabled:
        set_dropout_active(engine.model, lora.dropout > 0)
    loss_sum = torch.zeros((), dtype=torch.float64)
    try:
        for mb in parts:
            loss = nll_sum(engine.model, mb) / total
            loss.backward()
            loss_sum += loss.detach().to("cpu", torch.float64)
    finally:
        if lora.enabled:
            set_dropout_active(engine.model, False)
    return float(loss_sum), len(parts)


def sft_step(engine: TorchTrainEngine, batch: PackedBatch) -> dict[str, float]:
    """One supervised update of ``engine`` on ``batch``, then ``engine.version += 1``.

    Zero the gradients, :func:`accumulate_sft_gradients`, clip the global gradient norm to
    ``actor.optim.grad_clip``, one AdamW step and one learning-rate schedule step.

    Parameters
    ----------
    engine : TorchTrainEngine
        A single-process engine (its ``model``, ``optimizer``, ``scheduler``, ``actor``).
    batch : PackedBatch
        From :func:`pack_rows`; at least one trained token.

    Returns
    -------
    dict[str, float]
        ``loss`` (token-mean NLL in nats, before the update), ``perplexity`` (exp of it),
        ``grad_norm`` (pre-clip), ``lr`` (of this update), ``trained_tokens`` (N),
        ``tokens`` (T), ``sequences`` (B), ``num_micro_batches``, ``version`` (after).

    Raises
    ------
    ValueError
        ``batch`` has no trained token.
    """
    engine.optimizer.zero_grad(set_to_none=True)
    loss, micro_batches = accumulate_sft_gradients(engine, batch)
    params = [p for p in engine.model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, engine.optim.grad_clip))
    lr = float(engine.optimizer.param_groups[0]["lr"])
    engine.optimizer.step()
    engine.scheduler.step()
    engine.version += 1
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "grad_norm": grad_norm,
        "lr": lr,
        "trained_tokens": float(batch.loss_mask.sum()),
        "tokens": float(batch.num_tokens),
        "sequences": float(batch.num_seqs),
        "num_micro_batches": float(micro_batches),
        "version": float(engine.version),
    }
