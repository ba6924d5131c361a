"""Single-process trainer: packed forward, fused LM-head GRPO loss, AdamW."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, NamedTuple, Optional

import torch

from areal_fast._checks import positive_finite
from areal_fast.models.packed_attention import register_packed_attention
from areal_fast.ops.fused_pass import fused_pass_logprobs
from areal_fast.ops.logprobs import linear_logprobs
from areal_fast.ops.packing import partition_balanced
from areal_fast.ops.segment import segment_sum
from areal_fast.rl.batch import PackedBatch, select_sequences
from areal_fast.rl.decoupled import (
    behav_weight_stats,
    check_token_versions,
    loglinear_prox_logprobs,
    staleness_stats,
)
from areal_fast.rl.distill import distill_advantages
from areal_fast.rl.fused_loss import fused_linear_grpo_loss
from areal_fast.rl.objectives import grpo_loss
from areal_fast.train.activation_checkpointing import checkpoint_decoder_layers
from areal_fast.train.config import LR_SCHEDULES, PROX_LOGP_METHODS, ActorConfig, OptimizerConfig  # noqa: F401
from areal_fast.train.lora import (
    adapter_weights,
    apply_lora,
    merged_state_dict,
    set_dropout_active,
    trainable_parameters,
)
from areal_fast.train.precision import COMPUTE_DTYPE_ATTR

SHARDED_FORWARD = "fsdp_packed_forward_logprobs"
SHARDED_LOSS = "fsdp_packed_forward_loss"


def lr_factor(update: int, schedule: str, warmup_steps: int, total_updates: Optional[int]) -> float:
    """Learning-rate multiplier of optimizer update ``update`` (0-based).

    Warmup: ``(update + 1) / (warmup_steps + 1)`` for ``update < warmup_steps``. Then, with
    ``p = (update − warmup_steps) / max(total_updates − warmup_steps, 1)`` clamped to [0, 1]:
    "constant" 1, "linear" ``1 − p``, "cosine" ``(1 + cos(π p)) / 2`` (Loshchilov & Hutter
    2017, SGDR, without restarts). ``total_updates`` None: no decay (1 after warmup).
    """
    if update < warmup_steps:
        return (update + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_updates is None:
        return 1.0
    progress = min(max((update - warmup_steps) / max(total_updates - warmup_steps, 1), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class BatchTotals(NamedTuple):
    """Counts of a (global) batch that the micro-batch loss weights divide by."""

    tokens: int  # trained tokens (loss_mask True)
    seqs: int  # sequences
    trained_seqs: int  # sequences with at least one trained token


def packed_forward_logprobs(
    model, batch: PackedBatch, temperature: float, with_entropy: bool = True
):
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

    A model sharded by :func:`areal_fast.train.fsdp.shard_model` carries this computation as
    an FSDP2 forward method (``SHARDED_FORWARD``), so its root parameters (embeddings, final
    norm, LM head) are gathered around it; it is called instead.
    """
    sharded_forward = getattr(model, SHARDED_FORWARD, None)
    if sharded_forward is not None:
        return sharded_forward(batch, temperature, with_entropy)
    return unsharded_forward_logprobs(model, batch, temperature, with_entropy)


def unsharded_forward_logprobs(
    model, batch: PackedBatch, temperature: float, with_entropy: bool = True
):
    """:func:`packed_forward_logprobs` on a model whose parameters are all present."""
    hidden, weight, bias = _head_operands(model, _decoder_hidden_states(model, batch))
    result = linear_logprobs(
        hidden,
        weight,
        batch.labels.to(hidden.device),
        temperature=temperature,
        return_entropy=with_entropy,
        bias=bias,
    )
    return result if with_entropy else (result, None)


def packed_forward_loss(model, batch: PackedBatch, head_loss):
    """``head_loss(hidden, weight, bias)`` on the final hidden states of a packed batch.

    The decoder pass is that of :func:`packed_forward_logprobs`; ``head_loss`` gets the
    final hidden states [T, H] (model dtype, on the model's device), the LM-head weight
    [V, H] and its bias [V] (or None), and its result is returned. A model sharded by
    :func:`areal_fast.train.fsdp.shard_model` carries this as the FSDP2 forward method
    ``SHARDED_LOSS``, so the root parameters (embeddings, final norm, LM head) are gathered
    while ``head_loss`` runs: a loss that hands back an LM-head weight gradient computed in
    its forward (:func:`~areal_fast.rl.fused_loss.fused_linear_grpo_loss`) gives it to the
    gathered weight, whose gradient FSDP reduce-scatters after the backward.
    """
    sharded_forward = getattr(model, SHARDED_LOSS, None)
    if sharded_forward is not None:
        return sharded_forward(batch, head_loss)
    return unsharded_forward_loss(model, batch, head_loss)


def unsharded_forward_loss(model, batch: PackedBatch, head_loss):
    """:func:`packed_forward_loss` on a model whose parameters are all present."""
    return head_loss(*_head_operands(model, _decoder_hidden_states(model, batch)))


def _head_operands(model, hidden: torch.Tensor):
    """(hidden [T, H], LM-head weight [V, H], bias [V] or None) as the LM head runs them: in
    the model's ``areal_compute_dtype`` when it has one (mixed precision on a GPU,
    :mod:`areal_fast.train.precision`: the float32 final hidden states and master head weight
    cast once per micro-batch, gradients flowing back through the casts), else as they are."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    dtype = getattr(model, COMPUTE_DTYPE_ATTR, None)
    if dtype is None or hidden.dtype == dtype:
        return hidden, weight, bias
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _decoder_hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """Final hidden states [T, H] of the packed batch (see :func:`packed_forward_logprobs`)."""
    _check_supported(model.config)
    device = next(model.parameters()).device
    cu_seqlens = batch.cu_seqlens.to(device)
    out = model.get_decoder()(
        input_ids=batch.input_ids[None].to(device),
        position_ids=batch.position_ids[None].to(device),
        attention_mask=None,
        use_cache=False,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
    )
    return out.last_hidden_state[0]


def _check_supported(config) -> None:
    """Refuse model features the packed log-prob path does not reproduce."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None):
            raise ValueError(
                f"model config {key} = {getattr(config, key)} is not supported by "
                f"packed training (log-probs would differ from the model's)"
            )
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError(f"model config logit_scale = {config.logit_scale} is not supported")


class TorchTrainEngine:
    """A :class:`~areal_fast.train.engine.TrainEngine` in one process (CPU or one GPU).

    Each step splits the packed batch into micro-batches with the native balanced
    partitioner (``max_tokens_per_mb`` tokens at most each), accumulates gradients so that
    the result equals one pass over the whole batch for the configured aggregation, clips the
    global gradient norm and takes one AdamW step. Each micro-batch's loss comes from
    :func:`~areal_fast.rl.fused_loss.fused_linear_grpo_loss` on the final hidden states (one pass
    over the vocabulary that also yields the logged entropy, log-probs and proximal
    log-probs), run through :func:`packed_forward_loss`.

    Parameters
    ----------
    model : transformers causal LM (trained in place)
    actor : ActorConfig
        The trained policy's settings (``actor.*`` keys), used as they are:

        - ``loss`` (LossConfig) and ``optim`` (OptimizerConfig: AdamW, clipping, schedule);
        - ``max_tokens_per_mb``: token budget of a micro-batch; ``pack_method``: "kk"
          (Karmarkar–Karp balanced) or "ffd" (first-fit decreasing); ``keep_groups``: keep
          all sequences of a GRPO group in one micro-batch;
        - ``use_decoupled_loss``: decoupled PPO (Fu et al. 2025, AReaL, Eq. 5): the PPO
          ratio is taken against the proximal policy π_prox (the weights at the start of
          :meth:`train_step`) and the per-token loss is weighted by
          w = exp(log π_prox − log π_behav), capped as ``loss.behav_weight_cap`` /
          ``behav_weight_mode`` say; False: the ratio is taken against the behaviour
          log-probs (plain PPO/GRPO);
        - ``prox_logp_method``: how log π_prox is obtained with the decoupled loss:
          "recompute" (the trainer's own log-probs at the start of the step) or "loglinear"
          (interpolation between behaviour and current log-probs by version, no forward
          pass; see :func:`~areal_fast.rl.decoupled.loglinear_prox_logprobs`);
        - ``ppo_n_minibatches``: optimizer updates per :meth:`train_step`: the batch is split
          into this many minibatches (balanced by tokens, groups kept whole when
          ``keep_groups``), each then split into micro-batches;
        - ``lora`` (LoraConfig; ``rank`` > 0 turns it on): wrap the model in place with peft
          LoRA adapters (:func:`~areal_fast.train.lora.apply_lora`); only they require
          gradients and are in the optimizer, :meth:`named_weights` yields them alone and
          :meth:`save` writes the merged model and the adapter. The LM head stays frozen
          (the fused loss then forms no head-weight gradient);
        - ``distill`` (DistillConfig; ``teacher_path`` set turns it on): on-policy
          distillation, each micro-batch's advantages replaced by
          :func:`~areal_fast.rl.distill.distill_advantages` of ``teacher_model``'s log-probs.

        ``adv_mode`` is not used here (advantages are computed when a batch is assembled).
    temperature : float
        Sampling temperature of the engines (``rollout.temperature``); log-probs are
        recomputed at it.
    ref_model : causal LM, optional
        Frozen reference policy for the KL term (needed when ``actor.loss.kl_coef > 0``).
    teacher_model : causal LM, optional
        Frozen teacher of on-policy distillation (needed when ``actor.distill.teacher_path``
        is set): each micro-batch's teacher log-probs, taken like the reference's, turn
        into per-token advantages (:func:`~areal_fast.rl.distill.distill_advantages`).
    packed_attention : bool
        Switch the models to the mask-free packed attention of
        :mod:`areal_fast.models.packed_attention` (one varlen kernel per layer on CUDA,
        per-sequence SDPA elsewhere; else keep their own implementation).
    initial_version : int
        Starting value of :attr:`version`.
    total_steps : int, optional
        :meth:`train_step` calls the run will make: the learning-rate schedule decays over
        ``total_steps · ppo_n_minibatches`` optimizer updates (:func:`lr_factor`). None: no
        decay (constant after warmup).
    fused_loss : bool
        True (default): the fused loss above. False: the composed reference,
        :func:`~areal_fast.ops.logprobs.linear_logprobs` then
        :func:`~areal_fast.rl.objectives.grpo_loss` (one more LM-head matmul per micro-batch;
        the same losses, gradients and statistics to rounding).

    Attributes
    ----------
    actor : ActorConfig
        The settings given (the engine reads them from here; ``loss_config``, ``optim``,
        ``max_tokens_per_mb``, ``pack_method``, ``keep_groups``, ``use_decoupled_loss``,
        ``prox_logp_method`` and ``ppo_n_minibatches`` are read-only views of it).
    version : int
        Policy version of the current weights: ``initial_version`` plus the number of
        :meth:`train_step` calls (one step is one version, whatever ``ppo_n_minibatches``).
        Tokens generated by the weights of version v carry v in ``PackedBatch.versions``.

    Raises
    ------
    ValueError
        ``actor.loss.kl_coef > 0`` without ``ref_model``; ``actor.distill.teacher_path``
        set without ``teacher_model``, or the reverse; ``temperature`` not a finite
        number > 0; ``initial_version`` or ``total_steps`` out of range; ``fused_loss`` not
        a bool.

    Notes
    -----
    On a GPU the micro-batch loop of :meth:`accumulate_gradients` makes no device→host
    synchronisation: micro-batches are copied to the device from pinned memory without
    blocking, the trained positions and loglinear interpolation weights are formed on the
    host, the loss's backward reads nothing back (its upstream gradient is passed on the
    host) and the statistics are summed on the device. What remains, once per optimizer
    update: reading the summed statistics back (after their all-reduce on FSDP ranks) and the
    pre-clip gradient norm. Elsewhere: the packed attention's per-sequence fallback (without a
    varlen kernel) reads ``cu_seqlens`` per layer; the composed reference with "loglinear"
    checks token versions on the device.
    """

    def __init__(
        self,
        model,
        actor: ActorConfig,
        *,
        temperature: float,
        ref_model=None,
        teacher_model=None,
        packed_attention: bool = True,
        initial_version: int = 0,
        total_steps: Optional[int] = None,
        fused_loss: bool = True,
    ):
        if not isinstance(actor, ActorConfig):
            raise TypeError(f"actor must be an ActorConfig, got {type(actor).__name__}")
        if actor.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("actor.loss.kl_coef > 0 needs a reference model")
        if actor.distill.enabled and teacher_model is None:
            raise ValueError("actor.distill.teacher_path is set but no teacher_model is given")
        if teacher_model is not None and not actor.distill.enabled:
            raise ValueError("teacher_model is given but actor.distill.teacher_path is not set")
        positive_finite("temperature", temperature)
        _check_decoupled_args(actor.prox_logp_method, actor.ppo_n_minibatches, initial_version)
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ValueError(f"total_steps = {total_steps!r} must be an int >= 1 or None")
        if not isinstance(fused_loss, bool):
            raise ValueError(f"fused_loss = {fused_loss!r} must be a bool")
        if actor.lora.enabled:  # in place (FSDPTrainEngine did it before sharding)
            apply_lora(model, actor.lora)
        if actor.gradient_checkpointing:
            checkpoint_decoder_layers(model)
        if packed_attention:
            name = register_packed_attention()
            for m in (model, ref_model, teacher_model):
                if m is not None:
                    m.set_attn_implementation(name)
        # Dropout stays off (eval mode; gradients flow as usual): the trainer must recompute
        # exactly the engine's log-probs, or the on-policy PPO ratio would not be 1.
        self.model = model.eval()
        self.actor = actor
        self.temperature = temperature
        self.ref_model = _frozen(ref_model)
        self.teacher_model = _frozen(teacher_model)
        optim = actor.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],  # LoRA: the adapters only
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.total_steps = total_steps
        self.scheduler = self._make_scheduler(optim, total_steps, actor.ppo_n_minibatches)
        self.version = initial_version
        self.fused_loss = fused_loss
        # Run the separate no-grad proximal pass even when one minibatch makes it redundant.
        self._explicit_prox_pass = False

    # read-only views of the actor settings (one home: ``self.actor``)
    loss_config = property(lambda self: self.actor.loss, doc="``actor.loss``")
    optim = property(lambda self: self.actor.optim, doc="``actor.optim``")
    max_tokens_per_mb = property(
        lambda self: self.actor.max_tokens_per_mb, doc="``actor.max_tokens_per_mb``"
    )
    pack_method = property(lambda self: self.actor.pack_method, doc="``actor.pack_method``")
    keep_groups = property(lambda self: self.actor.keep_groups, doc="``actor.keep_groups``")
    use_decoupled_loss = property(
        lambda self: self.actor.use_decoupled_loss, doc="``actor.use_decoupled_loss``"
    )
    prox_logp_method = property(
        lambda self: self.actor.prox_logp_method, doc="``actor.prox_logp_method``"
    )
    ppo_n_minibatches = property(
        lambda self: self.actor.ppo_n_minibatches, doc="``actor.ppo_n_minibatches``"
    )

    def _make_scheduler(self, optim: OptimizerConfig, total_steps, ppo_n_minibatches):
        """A LambdaLR over :func:`lr_factor`, stepped once per optimizer update."""
        total_updates = None if total_steps is None else total_steps * ppo_n_minibatches

        def factor(update: int) -> float:  # a plain function: LambdaLR saves no state of it
            return lr_factor(update, optim.lr_schedule, optim.warmup_steps, total_updates)

        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        """Split ``batch`` into balanced micro-batches under the token budget."""
        return [select_sequences(batch, part) for part in self._micro_batch_parts(batch)]

    def _micro_batch_parts(self, batch: PackedBatch) -> list[list[int]]:
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        return partition_balanced(
            lengths,
            self.max_tokens_per_mb,
            method=self.pack_method,
            group_ids=batch.group_ids if self.keep_groups else None,
        )

    def minibatch_parts(self, batch: PackedBatch) -> list[list[int]]:
        """Sequence indices of the ``ppo_n_minibatches`` minibatches of ``batch``.

        Karmarkar–Karp balancing of the sequence lengths into exactly that many parts
        (whatever ``pack_method``, which has no part count), groups kept whole when
        ``keep_groups``.

        Raises
        ------
        ValueError
            ``ppo_n_minibatches`` exceeds the number of sequences (groups with keep_groups).
        """
        n = self.ppo_n_minibatches
        if n == 1:
            return [list(range(batch.num_seqs))]
        groups = batch.group_ids if self.keep_groups else None
        num_items = batch.num_seqs if groups is None else len(set(groups.tolist()))
        if num_items < n:
            unit = "groups" if groups is not None else "sequences"
            raise ValueError(f"ppo_n_minibatches = {n} exceeds the {num_items} {unit} of the batch")
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        parts = partition_balanced(
            lengths, max(sum(lengths), 1), method="kk", group_ids=groups, min_num_mbs=n
        )
        assert len(parts) == n, (len(parts), n)
        return parts

    def batch_totals(self, batch: PackedBatch) -> BatchTotals:
        """Trained tokens, sequences and trained sequences of ``batch`` (the FSDP engine
        sums them over the data-parallel ranks: the totals of the global batch)."""
        return BatchTotals(int(batch.loss_mask.sum()), batch.num_seqs, _num_trained_seqs(batch))

    def _mb_weight(self, mb: PackedBatch, totals: BatchTotals) -> float:
        """Share of the whole-batch loss that a micro-batch's aggregated loss carries.

        Summing ``weight · loss(mb)`` over micro-batches equals the loss of the whole batch
        (whose counts are ``totals``) for every aggregation, so accumulated gradients match
        one pass over the batch.
        """
        agg = self.loss_config.aggregation
        if agg == "token_sum":
            return 1.0
        if agg == "token_mean":
            return int(mb.loss_mask.sum()) / max(totals.tokens, 1)
        if agg == "seq_mean_token_sum":
            return mb.num_seqs / max(totals.seqs, 1)
        return _num_trained_seqs(mb) / max(totals.trained_seqs, 1)

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """``ppo_n_minibatches`` optimizer updates on ``batch``, then ``version += 1``.

        Each minibatch: zero the gradients, accumulate over its micro-batches, clip the
        global gradient norm, take one AdamW step. With decoupled PPO and
        ``prox_logp_method="recompute"``, the proximal log-probs are those of the weights
        at the start of the step: with several minibatches a no-grad pass over the whole batch
        computes them before any update (:meth:`recompute_logprobs`); with one minibatch
        the gradient forward itself runs at exactly those weights, so its detached log-probs
        are used and no extra pass is made.

        Returns
        -------
        dict[str, float]
            ``loss`` and ``grad_norm`` (pre-clip) averaged over the minibatches, the loss
            statistics of :meth:`accumulate_gradients` (means over the batch's trained
            tokens; ``behav_logprob_abs_diff`` is the mean |trainer − engine| log-prob, the
            engine/trainer mismatch), ``num_micro_batches`` (all minibatches together),
            ``num_minibatches``, ``lr`` (mean over the step's updates), ``version`` (after
            the step) and, with decoupled PPO,
            ``staleness_mean`` / ``staleness_max`` (version at the start of the step minus
            token version) and ``behav_weight_mean`` / ``behav_weight_masked_fraction``;
            with ``actor.distill``, ``distill_kl`` (mean over trained tokens of behaviour
            minus teacher log-prob, the reverse-KL estimate).
        """
        start_stats = {}
        if self.use_decoupled_loss:
            if self.prox_logp_method == "loglinear":  # fail before any update
                check_token_versions(batch.versions, batch.loss_mask, self.version)
            start_stats = self._staleness_stats(batch)
        parts = self.minibatch_parts(batch)
        prox = self._prox_before_update(batch)
        results = []
        for part in parts:
            minibatch, mb_prox = (batch, prox) if len(parts) == 1 else _select(batch, part, prox)
            stats = self._optimizer_step(minibatch, mb_prox)
            tokens = self.batch_totals(minibatch).tokens if len(parts) > 1 else 0
            results.append((tokens, stats))
        self.version += 1
        stats = _combine_minibatch_stats(results)
        stats.update(start_stats, num_minibatches=float(len(parts)), version=float(self.version))
        return stats

    def _staleness_stats(self, batch: PackedBatch) -> dict[str, float]:
        return staleness_stats(batch.versions, batch.loss_mask, self.version)

    def _optimizer_step(self, batch: PackedBatch, prox) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_gradients(batch, prox_logprobs=prox)
        stats["grad_norm"] = self._clip_gradients()
        stats["lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return stats

    def _clip_gradients(self) -> float:
        """Clip the global gradient norm to ``optim.grad_clip``; the pre-clip norm."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip))

    def _prox_before_update(self, batch: PackedBatch):
        """Proximal log-probs [T] computed before any update, or None where the loss makes
        them on the fly (no decoupled loss, loglinear, or recompute with one minibatch)."""
        if not self.use_decoupled_loss or self.prox_logp_method != "recompute":
            return None
        if self.ppo_n_minibatches == 1 and not self._explicit_prox_pass:
            return None
        return self.recompute_logprobs(batch)

    @torch.no_grad()
    def recompute_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The current weights' log-probs of ``batch``, micro-batch by micro-batch, no grad.

        Computed as the loss computes them (with the fused loss:
        :func:`~areal_fast.ops.fused_pass.fused_pass_logprobs`), so that they equal the gradient
        pass's log-probs of the same micro-batch bitwise.

        Returns
        -------
        Tensor [T] float32 on the model's device (0 where ``labels == -100``)
        """
        device = self._device()
        out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)
        for part in self._micro_batch_parts(batch):
            mb = select_sequences(batch, part or [0])  # [] pads: see _padding_pass
            logprobs = self._no_grad_logprobs(mb, _to_device(mb, device))
            if part:
                out[_copy_to(_token_index(batch.cu_seqlens, part), device)] = logprobs.float()
        return out

    def _no_grad_logprobs(self, mb: PackedBatch, dev: PackedBatch) -> torch.Tensor:
        if not self.fused_loss:
            return packed_forward_logprobs(self.model, dev, self.temperature, False)[0]
        trained = _copy_to(mb.loss_mask.nonzero().squeeze(1), dev.loss_mask.device)
        temperature = self.temperature

        def head_logprobs(hidden, head_weight, bias):
            return fused_pass_logprobs(
                hidden,
                head_weight,
                dev.labels,
                dev.loss_mask,
                temperature=temperature,
                bias=bias,
                trained_positions=trained,
            )

        return packed_forward_loss(self.model, dev, head_logprobs)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def accumulate_gradients(
        self, batch: PackedBatch, prox_logprobs: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Forward and backward over the micro-batches of ``batch``; gradients add up in
        ``.grad`` to those of one pass over the whole batch. Returns loss statistics.

        ``prox_logprobs`` [T] float32 (decoupled PPO only) gives the proximal log-probs
        explicitly; None makes them as ``prox_logp_method`` says from each micro-batch's
        forward (recompute: its detached log-probs; loglinear: the interpolation at
        :attr:`version`).

        The statistics are summed over the micro-batches on the device (float64) and read
        back once, after the loop: the loop itself makes no device→host synchronisation
        on a GPU (see the class notes for what remains).
        """
        if prox_logprobs is not None and not self.use_decoupled_loss:
            raise ValueError("prox_logprobs is given but use_decoupled_loss is False")
        if prox_logprobs is not None and prox_logprobs.shape != (batch.num_tokens,):
            raise ValueError(
                f"prox_logprobs must be [T={batch.num_tokens}], got {tuple(prox_logprobs.shape)}"
            )
        sums = {"loss": torch.zeros((), dtype=torch.float64, device=self._device())}
        totals = self.batch_totals(batch)
        parts = self._micro_batch_parts(batch)
        if self.actor.lora.enabled and self.actor.lora.dropout > 0:
            set_dropout_active(self.model, True)  # off again below: the no-grad passes
        try:
            self._accumulate_parts(batch, parts, prox_logprobs, totals, sums)
        finally:
            if self.actor.lora.enabled:
                set_dropout_active(self.model, False)
        stats = self._reduce_stats(sums)
        stats["num_micro_batches"] = float(len(parts))
        return stats

    def _accumulate_parts(self, batch, parts, prox_logprobs, totals: BatchTotals, sums) -> None:
        """The micro-batch loop of :meth:`accumulate_gradients` (shares summed into ``sums``)."""
        total_tokens = max(totals.tokens, 1)
        for part in parts:
            if not part:
                self._padding_pass(batch)
                continue
            mb, mb_prox = _select(batch, part, prox_logprobs)
            weight = self._mb_weight(mb, totals)
            loss, stats = self._micro_batch_loss(mb, mb_prox, weight)
            (loss * weight).backward()
            _add_share(sums, "loss", loss, weight)
            token_share = int(mb.loss_mask.sum()) / total_tokens
            for key, value in stats.items():
                if key != "num_tokens":
                    _add_share(sums, key, value, token_share)

    def _reduce_stats(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum the shares of the micro-batch statistics (0-d float64 device tensors) over
        data-parallel ranks (here: one) and read them back, in one synchronisation."""
        return dict(zip(sums, torch.stack(list(sums.values())).tolist()))

    def _padding_pass(self, batch: PackedBatch) -> None:
        """Forward and backward of the first sequence with weight 0: an empty part ``[]``
        pads a data-parallel rank's micro-batch count up to the other ranks' (their FSDP
        collectives pair up); it adds exact zeros to the gradients and nothing to the stats."""
        loss, _ = self._micro_batch_loss(select_sequences(batch, [0]), None, 0.0)
        (loss * 0.0).backward()

    def _micro_batch_loss(self, mb: PackedBatch, prox: torch.Tensor | None = None, weight=1.0):
        """(loss, stats) of one micro-batch (host tensors), ``prox`` its explicit proximal
        log-probs; ``weight`` is the factor the caller back-propagates the loss with, as
        ``(weight * loss).backward()`` (the fused loss forms its gradients pre-scaled)."""
        dev = _to_device(mb, self._device())
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = packed_forward_logprobs(
                    self.ref_model, dev, self.temperature, with_entropy=False
                )
        distill_stats = {}
        if self.teacher_model is not None:
            dev, distill_stats = self._distill(dev)
        if self.fused_loss:
            loss, stats, logprobs, prox = self._fused_loss(mb, dev, prox, ref, weight)
        else:
            loss, stats, logprobs, prox = self._composed_loss(dev, prox, ref)
        mask, behav = dev.loss_mask, dev.behav_logprobs
        diff = torch.where(mask, (logprobs - behav).abs(), 0.0).sum()
        stats["behav_logprob_abs_diff"] = diff / mask.sum().clamp(min=1)
        if prox is not None:
            stats.update(behav_weight_stats(prox, behav, mask, self.loss_config.behav_weight_cap))
        stats.update(distill_stats)
        return loss, stats

    def _distill(self, dev: PackedBatch) -> tuple[PackedBatch, dict]:
        """``dev`` with on-policy distillation advantages, and ``{"distill_kl": mean reverse
        KL over its trained tokens}`` (0-d tensor; no host synchronisation).

        The teacher scores the micro-batch's tokens on the reference's path (no grad, no
        [T, V] logits, at :attr:`temperature`); the student's log-probs are the behaviour
        log-probs, those of the policy that sampled the tokens
        (:func:`~areal_fast.rl.distill.distill_advantages`).
        """
        with torch.no_grad():
            teacher, _ = packed_forward_logprobs(
                self.teacher_model, dev, self.temperature, with_entropy=False
            )
        cfg = self.actor.distill
        advantages, reverse_kl = distill_advantages(
            dev.advantages, dev.behav_logprobs, teacher, dev.loss_mask, cfg.coef, cfg.task_reward
        )
        mean_kl = reverse_kl.sum() / dev.loss_mask.sum().clamp(min=1)
        return dataclasses.replace(dev, advantages=advantages), {"distill_kl": mean_kl}

    def _fused_loss(self, mb: PackedBatch, dev: PackedBatch, prox, ref, weight):
        """fused_linear_grpo_loss inside packed_forward_loss: (loss, stats, detached
        log-probs [T], proximal log-probs [T] or None)."""
        prox_fn = None
        if self.use_decoupled_loss and prox is None:
            prox_fn = self._prox_fn(mb, dev)
        trained = _copy_to(mb.loss_mask.nonzero().squeeze(1), dev.loss_mask.device)
        config, temperature = self.loss_config, self.temperature

        def head_loss(hidden, head_weight, bias):
            return fused_linear_grpo_loss(
                hidden,
                head_weight,
                dev.labels,
                dev.behav_logprobs,
                dev.advantages,
                dev.loss_mask,
                dev.cu_seqlens,
                config,
                temperature=temperature,
                prox_logprobs=prox,
                ref_logprobs=ref,
                bias=bias,
                prox_fn=prox_fn,
                with_entropy=True,
                return_per_token=True,
                upstream_grad=weight,
                trained_positions=trained,
            )

        loss, stats, tokens = packed_forward_loss(self.model, dev, head_loss)
        return loss, stats, tokens.logprobs, tokens.prox_logprobs

    def _prox_fn(self, mb: PackedBatch, dev: PackedBatch):
        """``prox_fn`` of fused_linear_grpo_loss for ``prox_logp_method`` (no explicit prox)."""
        if self.prox_logp_method == "recompute":
            # Only reached when this forward runs at the step-start weights (one minibatch).
            return _current_logprobs
        behav = dev.behav_logprobs
        alpha = _copy_to(_loglinear_alpha(mb, self.version), behav.device)

        def loglinear(logprobs, positions):
            base = behav[positions].to(logprobs.dtype)
            return base + alpha[positions].to(logprobs.dtype) * (logprobs - base)

        return loglinear

    def _composed_loss(self, dev: PackedBatch, prox, ref):
        """The reference: linear_logprobs then grpo_loss (same returns as _fused_loss)."""
        logprobs, entropy = packed_forward_logprobs(self.model, dev, self.temperature)
        if self.loss_config.entropy_coef == 0:
            entropy = entropy.detach()
        prox = self._proximal_logprobs(dev, logprobs, prox)
        loss, stats = grpo_loss(
            logprobs,
            dev.behav_logprobs,
            dev.advantages,
            dev.loss_mask,
            dev.cu_seqlens,
            self.loss_config,
            prox_logprobs=prox,
            ref_logprobs=ref,
            entropy=entropy,
        )
        return loss, stats, logprobs.detach(), prox

    def _proximal_logprobs(self, mb: PackedBatch, logprobs: torch.Tensor, prox):
        """Proximal log-probs [T] of a micro-batch for grpo_loss (None: plain PPO)."""
        if not self.use_decoupled_loss:
            return None
        device = logprobs.device
        if prox is not None:
            return prox.to(device)
        if self.prox_logp_method == "recompute":
            # Only reached when this forward runs at the step-start weights (one minibatch).
            return logprobs.detach()
        return loglinear_prox_logprobs(
            logprobs.detach(),
            mb.behav_logprobs.to(device),
            mb.versions.to(device),
            self.version,
            mb.loss_mask.to(device),
        )

    @property
    def trainable_parameters(self) -> int:
        """Parameter elements the optimizer updates (LoRA: the adapters' A and B)."""
        return trainable_parameters(self.model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors to send to inference engines: the parameters (tied tensors once), or
        with ``actor.lora`` the adapter alone (:func:`~areal_fast.train.lora.adapter_weights`:
        ``<module>.lora_A`` [r, in] and the scaled ``<module>.lora_B`` [out, r])."""
        if self.actor.lora.enabled:
            yield from adapter_weights(self.model)
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def save(self, path: str) -> None:
        """Write the model as a HF safetensors directory at ``path``.

        With ``actor.lora``: the merged model (W = base + s · B A under the plain names,
        loadable by transformers without peft) at ``path``, and the adapter alone (peft's
        ``save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors``) in
        ``path/adapter``.
        """
        if not self.actor.lora.enabled:
            self.model.save_pretrained(path)
            return
        self._save_merged(path, {k: v.detach().cpu() for k, v in self.model.state_dict().items()})

    def _save_merged(self, path: str, state: dict) -> None:
        """Write the merged model from the wrapped model's full ``state`` and the adapter."""
        import os

        from peft import get_peft_model_state_dict

        peft_model = self.model.areal_peft_model
        merged = merged_state_dict(self.model, state)
        # the plain model's save: transformers writes tied weights once, as for full training
        peft_model.get_base_model().save_pretrained(path, state_dict=merged)
        adapter = get_peft_model_state_dict(peft_model, state_dict=_peft_keys(state))
        peft_model.save_pretrained(os.path.join(path, "adapter"), state_dict=adapter)


def _frozen(model):
    """``model`` in eval mode without gradients (None stays None)."""
    return None if model is None else model.eval().requires_grad_(False)


def _peft_keys(state: dict) -> dict:
    """A state dict of the wrapped model under the PeftModel's keys (``base_model.model.``)."""
    return {f"base_model.model.{k}": v for k, v in state.items()}


def _current_logprobs(logprobs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``prox_fn`` of recomputed proximal log-probs: the forward's own (detached) ones."""
    return logprobs


def _loglinear_alpha(batch: PackedBatch, version: int) -> torch.Tensor:
    """Weights α [T] float64 (host) of :func:`loglinear_prox_logprobs` at ``version``.

    That interpolation, behav + α·(logprobs − behav), is affine in the log-probs, so its
    value at logprobs = 1, behav = 0 is α (0 outside ``loss_mask``); evaluated on the
    host batch, it checks the token versions without a device synchronisation. α in
    float64, cast to the log-probs' dtype where used, is the function's own α.
    """
    ones = torch.ones(batch.num_tokens, dtype=torch.float64)
    return loglinear_prox_logprobs(
        ones, torch.zeros_like(ones), batch.versions, version, batch.loss_mask
    )


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; host → GPU through pinned memory without blocking (no
    host synchronisation: torch's pinned-memory cache keeps the staging buffer until the
    copy has run)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """``batch`` with every tensor on ``device`` (:func:`_copy_to`); itself if already there."""
    fields = batch.__dict__
    if all(v.device == device for v in fields.values() if isinstance(v, torch.Tensor)):
        return batch
    return PackedBatch(
        **{k: _copy_to(v, device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    )


def _add_share(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor, share: float):
    """``sums[key] += value · share`` in float64 on the device (no read-back)."""
    term = value.detach().to(torch.float64) * share
    sums[key] = sums[key] + term if key in sums else term


def _num_trained_seqs(batch: PackedBatch) -> int:
    """Sequences with at least one trained token."""
    return int((segment_sum(batch.loss_mask.float(), batch.cu_seqlens) > 0).sum())


def _token_index(cu_seqlens: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Packed token positions [T'] int64 of sequences ``indices``, in that order."""
    bounds = cu_seqlens.tolist()
    if not indices:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in indices])


def _select(batch: PackedBatch, indices: list[int], per_token: torch.Tensor | None):
    """Sequences ``indices`` of ``batch`` and the matching entries of a [T] tensor."""
    sub = select_sequences(batch, indices)
    if per_token is None:
        return sub, None
    return sub, per_token[_copy_to(_token_index(batch.cu_seqlens, indices), per_token.device)]


def _combine_minibatch_stats(results: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Merge per-minibatch stats: token-weighted means of the token statistics, plain
    means of ``loss``, ``grad_norm`` and ``lr``, the sum of ``num_micro_batches``."""
    if len(results) == 1:
        return dict(results[0][1])
    total_tokens = max(sum(tokens for tokens, _ in results), 1)
    merged: dict[str, float] = {}
    for tokens, stats in results:
        for key, value in stats.items():
            if key == "num_micro_batches":
                share = 1.0
            elif key in ("loss", "grad_norm", "lr"):
                share = 1.0 / len(results)
            else:
                share = tokens / total_tokens
            merged[key] = merged.get(key, 0.0) + value * share
    return merged


def _check_decoupled_args(prox_logp_method, ppo_n_minibatches, initial_version) -> None:
    if prox_logp_method not in PROX_LOGP_METHODS:
        raise ValueError(
            f"prox_logp_method = {prox_logp_method!r} is not one of {PROX_LOGP_METHODS}"
        )
    if (
        isinstance(ppo_n_minibatches, bool)
        or not isinstance(ppo_n_minibatches, int)
        or ppo_n_minibatches < 1
    ):
        raise ValueError(f"ppo_n_minibatches = {ppo_n_minibatches!r} must be an int >= 1")
    if (
        isinstance(initial_version, bool)
        or not isinstance(initial_version, int)
        or initial_version < 0
    ):
        raise ValueError(f"initial_version = {initial_version!r} must be an int >= 0")
