"""Single-process trainer: packed forward, chunked log-probs, GRPO loss, AdamW."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from areal_fast.models.packed_attention import register_packed_attention
from areal_fast.ops.logprobs import linear_logprobs
from areal_fast.ops.packing import partition_balanced
from areal_fast.ops.segment import segment_sum
from areal_fast.rl.batch import PackedBatch, select_sequences
from areal_fast.rl.config import LossConfig
from areal_fast.rl.objectives import grpo_loss


@dataclass
class OptimizerConfig:
    """AdamW and gradient-clipping settings (Loshchilov & Hutter 2019)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        for name in ("lr", "eps", "grad_clip"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} = {value} must be a finite number > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay = {self.weight_decay} must be a finite number >= 0")


def packed_forward_logprobs(model, batch: PackedBatch, temperature: float,
                            with_entropy: bool = True):
    """Token log-probs (and entropy) of a packed batch through a HF causal LM.

    The decoder runs once over the concatenated tokens with ``position_ids`` restarting at 0
    per sequence, ``attention_mask=None``, ``use_cache=False`` and the sequence boundaries as
    ``cu_seq_lens_q/k``: the packed attention of
    :mod:`areal_fast.models.packed_attention` and transformers' flash-attention path use the
    boundaries; its sdpa and eager paths infer them from ``position_ids``. Passing a mask or a
    KV cache silently turns packing off (later sequences attend to earlier ones), so neither
    is passed.
    Log-probs come from the final hidden states and the LM-head weight via
    :func:`~areal_fast.ops.logprobs.linear_logprobs`, never materialising [T, V] logits.

    Parameters
    ----------
    model : transformers causal LM with ``.model`` (decoder) and ``get_output_embeddings()``
    batch : PackedBatch
    temperature : float
        Temperature the log-probs are taken at (the sampling temperature).
    with_entropy : bool
        Also return the entropy.

    Returns
    -------
    logprobs : Tensor [T] float32 (0 where ``labels == -100``)
    entropy : Tensor [T] float32 or None
    """
    _check_supported(model.config)
    device = next(model.parameters()).device
    cu_seqlens = batch.cu_seqlens.to(device)
    out = model.get_decoder()(
        input_ids=batch.input_ids[None].to(device),
        position_ids=batch.position_ids[None].to(device), attention_mask=None, use_cache=False,
        cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
        max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    hidden = out.last_hidden_state[0]
    head = model.get_output_embeddings()
    result = linear_logprobs(hidden, head.weight, batch.labels.to(device),
                             temperature=temperature, return_entropy=with_entropy,
                             bias=getattr(head, "bias", None))
    return result if with_entropy else (result, None)


def _check_supported(config) -> None:
    """Refuse model features the packed log-prob path does not reproduce."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None):
            raise ValueError(f"model config {key} = {getattr(config, key)} is not supported by "
                             f"packed training (log-probs would differ from the model's)")
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError(f"model config logit_scale = {config.logit_scale} is not supported")


class TorchTrainEngine:
    """A :class:`~areal_fast.train.engine.TrainEngine` in one process (CPU or one GPU).

    Each step splits the packed batch into micro-batches with the native balanced
    partitioner (``max_tokens_per_mb`` tokens at most each), accumulates gradients so that
    the result equals one pass over the whole batch for the configured aggregation, clips the
    global gradient norm and takes one AdamW step.

    Parameters
    ----------
    model : transformers causal LM (trained in place)
    loss_config : LossConfig
    optim : OptimizerConfig
    temperature : float
        Sampling temperature of the engine; log-probs are recomputed at it.
    max_tokens_per_mb : int
        Token budget of a micro-batch.
    pack_method : str
        "kk" (Karmarkar–Karp balanced) or "ffd" (first-fit decreasing).
    keep_groups : bool
        Keep all sequences of a GRPO group in one micro-batch.
    ref_model : causal LM, optional
        Frozen reference policy for the KL term (needed when loss_config.kl_coef > 0).
    packed_attention : bool
        Switch the models to the mask-free per-sequence attention of
        :mod:`areal_fast.models.packed_attention` (else keep their own implementation).
    """

    def __init__(self, model, loss_config: LossConfig, optim: OptimizerConfig, *,
                 temperature: float = 1.0, max_tokens_per_mb: int = 4096,
                 pack_method: str = "kk", keep_groups: bool = False, ref_model=None,
                 packed_attention: bool = True):
        if loss_config.kl_coef > 0 and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        if packed_attention:
            name = register_packed_attention()
            for m in (model, ref_model):
                if m is not None:
                    m.set_attn_implementation(name)
        # Dropout stays off (eval mode; gradients flow as usual): the trainer must recompute
        # exactly the engine's log-probs, or the on-policy PPO ratio would not be 1.
        self.model = model.eval()
        self.loss_config = loss_config
        self.optim = optim
        self.temperature = temperature
        self.max_tokens_per_mb = max_tokens_per_mb
        self.pack_method = pack_method
        self.keep_groups = keep_groups
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
            weight_decay=optim.weight_decay)

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        """Split ``batch`` into balanced micro-batches under the token budget."""
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        parts = partition_balanced(lengths, self.max_tokens_per_mb, method=self.pack_method,
                                   group_ids=batch.group_ids if self.keep_groups else None)
        return [select_sequences(batch, part) for part in parts]

    def _mb_weight(self, mb: PackedBatch, batch: PackedBatch) -> float:
        """Share of the whole-batch loss that a micro-batch's aggregated loss carries.

        Summing ``weight · loss(mb)`` over micro-batches equals the loss of the whole batch
        for every aggregation, so accumulated gradients match one pass over the batch.
        """
        agg = self.loss_config.aggregation
        if agg == "token_sum":
            return 1.0
        if agg == "token_mean":
            return int(mb.loss_mask.sum()) / max(int(batch.loss_mask.sum()), 1)
        if agg == "seq_mean_token_sum":
            return mb.num_seqs / max(batch.num_seqs, 1)
        return _num_trained_seqs(mb) / max(_num_trained_seqs(batch), 1)

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer update on ``batch``; returns loss, grad norm and loss statistics.

        Statistics are means over the batch's trained tokens; ``behav_logprob_abs_diff`` is
        the mean |trainer − engine| log-prob of the same tokens (engine/trainer mismatch).
        """
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_gradients(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        stats["grad_norm"] = float(grad_norm)
        return stats

    def accumulate_gradients(self, batch: PackedBatch) -> dict[str, float]:
        """Forward and backward over the micro-batches of ``batch``; gradients add up in
        ``.grad`` to those of one pass over the whole batch. Returns loss statistics."""
        sums: dict[str, float] = {"loss": 0.0}
        total_tokens = max(int(batch.loss_mask.sum()), 1)
        micro_batches = self.micro_batches(batch)
        for mb in micro_batches:
            weight = self._mb_weight(mb, batch)
            loss, stats = self._micro_batch_loss(mb)
            (loss * weight).backward()
            sums["loss"] += float(loss.detach()) * weight
            token_share = int(mb.loss_mask.sum()) / total_tokens
            for key, value in stats.items():
                if key != "num_tokens":
                    sums[key] = sums.get(key, 0.0) + float(value) * token_share
        sums["num_micro_batches"] = float(len(micro_batches))
        return sums

    def _micro_batch_loss(self, mb: PackedBatch):
        device = next(self.model.parameters()).device
        logprobs, entropy = packed_forward_logprobs(self.model, mb, self.temperature)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = packed_forward_logprobs(self.ref_model, mb, self.temperature,
                                                 with_entropy=False)
        if self.loss_config.entropy_coef == 0:
            entropy = entropy.detach()
        mask = mb.loss_mask.to(device)
        behav = mb.behav_logprobs.to(device)
        loss, stats = grpo_loss(logprobs, behav, mb.advantages.to(device), mask,
                                mb.cu_seqlens.to(device), self.loss_config,
                                ref_logprobs=ref, entropy=entropy)
        diff = torch.where(mask, (logprobs.detach() - behav).abs(), 0.0).sum()
        stats["behav_logprob_abs_diff"] = diff / mask.sum().clamp(min=1)
        return loss, stats

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters to send to inference engines (tied tensors once)."""
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def save(self, path: str) -> None:
        """Write the model as a HF safetensors directory at ``path``."""
        self.model.save_pretrained(path)


def _num_trained_seqs(batch: PackedBatch) -> int:
    """Sequences with at least one trained token."""
    return int((segment_sum(batch.loss_mask.float(), batch.cu_seqlens) > 0).sum())
