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

The step drives the RL trainer engine (:class:`~areal_fast.train.torch_engine.TorchTrainEngine`
or :class:`~areal_fast.train.fsdp.FSDPTrainEngine`) with its own micro-batch partition, count
reduction over the ranks and gradient clipping (``batch_totals``, ``_micro_batch_parts``,
``_reduce_stats``, ``_clip_gradients``), so one rank and N FSDP2 ranks behave alike.
"""

from __future__ import annotations

import math

import torch

from areal_fast.ops.packing import cu_seqlens_from_lengths, position_ids_from_cu_seqlens
from areal_fast.rl.batch import IGNORE_INDEX, PackedBatch, select_sequences
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
    """Summed negative log-likelihood of ``batch``'s trained tokens.

    Σ_t −log p(labels[t]) over ``loss_mask``, the log-probs from the fused LM-head path at
    temperature 1 (:func:`~areal_fast.train.torch_engine.packed_forward_logprobs`: 0 where
    ``labels == -100``; an FSDP2-sharded model gathers its root parameters around it).

    Parameters
    ----------
    model : transformers causal LM (or one sharded by :func:`areal_fast.train.fsdp.shard_model`)
    batch : PackedBatch
        ``input_ids`` [T] int64, ``position_ids`` [T] int64, ``cu_seqlens`` [B+1] int32,
        ``labels`` [T] int64 (copied to the model's device here).

    Returns
    -------
    Tensor, 0-d float32 (differentiable w.r.t. the model's parameters)
    """
    device = next(model.parameters()).device
    logprobs, _ = packed_forward_logprobs(model, batch.to(device), 1.0, with_entropy=False)
    return -logprobs.float().sum()


def accumulate_sft_gradients(engine: TorchTrainEngine, batch: PackedBatch) -> dict[str, float]:
    """Add the gradient of the batch's token-mean NLL to the trained parameters' ``.grad``.

    The micro-batches are the engine's (at most ``actor.max_tokens_per_mb`` tokens each, the
    same count on every FSDP rank, an empty part padding a rank with fewer: a zero-weight
    pass, so the ranks' collectives pair up). Each back-propagates its NLL sum divided by
    the global batch's trained tokens N (summed over the ranks), so the accumulated
    gradient, summed over the ranks by FSDP, equals that of one pass over the whole batch.
    LoRA adapters' dropout is active during the passes when set. Collective on an
    :class:`~areal_fast.train.fsdp.FSDPTrainEngine`: every rank calls it with its own part.

    Parameters
    ----------
    engine : TorchTrainEngine or FSDPTrainEngine
    batch : PackedBatch
        This rank's rows, from :func:`pack_rows` (at least one).

    Returns
    -------
    dict[str, float]
        Of the global batch: ``loss`` (token-mean NLL, nats), ``trained_tokens`` (N),
        ``tokens`` (T), ``sequences`` (B); and this rank's ``num_micro_batches``.

    Raises
    ------
    ValueError
        The global batch has no trained token.
    """
    total = engine.batch_totals(batch).tokens
    if total == 0:
        raise ValueError("the batch has no trained token")
    parts = engine._micro_batch_parts(batch)  # FSDP: as many on every rank
    lora = engine.actor.lora
    if lora.enabled:
        set_dropout_active(engine.model, lora.dropout > 0)
    loss_sum = torch.zeros((), dtype=torch.float64)
    try:
        for part in parts:
            loss = nll_sum(engine.model, select_sequences(batch, part or [0])) / total
            (loss if part else loss * 0.0).backward()
            if part:
                loss_sum += loss.detach().to("cpu", torch.float64)
    finally:
        if lora.enabled:
            set_dropout_active(engine.model, False)
    local = [loss_sum, batch.loss_mask.sum(), batch.num_tokens, batch.num_seqs]
    keys = ("loss", "trained_tokens", "tokens", "sequences")
    stats = engine._reduce_stats(
        {
            k: torch.as_tensor(v, dtype=torch.float64, device=engine._device())
            for k, v in zip(keys, local)
        }
    )
    stats["num_micro_batches"] = float(len(parts))
    return stats


def sft_step(engine: TorchTrainEngine, batch: PackedBatch) -> dict[str, float]:
    """One supervised update of ``engine`` on ``batch``, then ``engine.version += 1``.

    Zero the gradients, :func:`accumulate_sft_gradients`, clip the global gradient norm to
    ``actor.optim.grad_clip`` (the engine's clipping: of the sharded gradients on FSDP
    ranks), one AdamW step and one learning-rate schedule step. Collective on FSDP ranks.

    Parameters
    ----------
    engine : TorchTrainEngine or FSDPTrainEngine
        Its ``model``, ``optimizer``, ``scheduler`` and ``actor``.
    batch : PackedBatch
        This rank's rows, from :func:`pack_rows`.

    Returns
    -------
    dict[str, float]
        The stats of :func:`accumulate_sft_gradients`, plus ``perplexity`` (exp of the
        loss), ``grad_norm`` (pre-clip), ``lr`` (of this update) and ``version`` (after).

    Raises
    ------
    ValueError
        The global batch has no trained token.
    """
    engine.optimizer.zero_grad(set_to_none=True)
    stats = accumulate_sft_gradients(engine, batch)
    stats["perplexity"] = math.exp(min(stats["loss"], 700.0))
    stats["grad_norm"] = engine._clip_gradients()
    stats["lr"] = float(engine.optimizer.param_groups[0]["lr"])
    engine.optimizer.step()
    engine.scheduler.step()
    engine.version += 1
    stats["version"] = float(engine.version)
    return stats
