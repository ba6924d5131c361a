"""Continuous batching over a transformers causal LM: sequences join and leave at every step.

:class:`DecodeBatch` keeps up to ``slots`` sequences running. Each :meth:`DecodeBatch.step`
is one forward pass of the model over a packed row (:mod:`areal_fast.rollout.kv_slots`):
the prompts of the sequences added since the last step (prefill; sequences with identical
token ids are prefilled once and the cached keys copied to the others' slots) and the newest
token of every running sequence (decode). Only the rows whose next token is sampled go
through the output layer (``logits_to_keep``). A sequence leaves the batch after its
end-of-sequence token or its budget, and its slot is free for the next one at the next step.

Sampling (:func:`sample_rows`) follows the static engine's conventions exactly: greedy is the
arg-max of the raw logits, reported at temperature 1; seeded sampling draws the token at
completion position ``offset + j`` with ``seeded_uniform(seed, offset + j)``
(:class:`~areal_fast.rollout.sampling.SeededSampler`), so a sample's tokens do not depend on
the other sequences in the batch; unseeded sampling draws from torch's generator. The
behaviour log-prob is ``log_softmax(logits / temperature)`` at the chosen token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from areal_fast.rollout.engine import seeded_uniform
from areal_fast.rollout.kv_slots import KVSlots, SlotPlan, register_slot_attention
from areal_fast.rollout.sampling import SeededSampler


@dataclass
class Sequence:
    """One sequence in a :class:`DecodeBatch`.

    Attributes
    ----------
    key : Any
        The caller's handle (a request id), returned untouched.
    input_ids : list[int]
        Prompt plus earlier completion tokens (non-empty).
    budget : int
        New tokens at most (>= 1).
    temperature, top_p : float
        Temperature 0 is greedy.
    seed : int or None
        Sampling seed (None: torch's generator); ``offset`` completion tokens came before.
    offset : int
    tokens, logprobs, versions : list
        Generated so far: token ids, behaviour log-probs (fp32 nats), policy versions.
    stop_reason : str
        "" while running, then "stop" (end-of-sequence), "length" or "abort".
    first_token_time : float or None
        ``time.monotonic()`` when its first token was sampled.
    """

    key: Any
    input_ids: list[int]
    budget: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    offset: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str = ""
    first_token_time: Optional[float] = None
    slot: int = -1


class DecodeBatch:
    """Up to ``slots`` sequences decoded together, joining and leaving at every step.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM whose attention modules call the attention interface with their
        ``layer_idx`` (Llama, Qwen2/3, Mistral, ...); during :meth:`step` its attention
        implementation is :data:`~areal_fast.rollout.kv_slots.SLOT_ATTENTION`, and the one it
        had is restored afterwards. The caller serialises steps with other uses of it.
    slots : int
        Sequences at once (>= 1).
    eos_id : int or None
        End-of-sequence token (None: sequences stop at their budget only).

    Raises
    ------
    ValueError
        If ``slots`` < 1 or the model config lacks the sizes of its attention.
    """

    def __init__(self, model, slots: int, eos_id: Optional[int]):
        if slots < 1:
            raise ValueError(f"slots = {slots} must be >= 1")
        self.attention = register_slot_attention()
        self.model = model
        self.slots = slots
        self.eos_id = eos_id
        self.running: list[Sequence] = []  # prefilled, in slot order of arrival
        self.pending: list[Sequence] = []  # added, prefilled at the next step
        self._free = list(range(slots))
        self._cache: Optional[KVSlots] = None

    @property
    def free(self) -> int:
        """Slots without a sequence."""
        return len(self._free)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache now held (0 while empty)."""
        return 0 if self._cache is None else self._cache.nbytes

    def add(self, sequences: list[Sequence]) -> None:
        """Give each sequence a free slot; they are prefilled at the next :meth:`step`.

        Raises
        ------
        RuntimeError
            If there are fewer free slots than sequences.
        """
        if len(sequences) > len(self._free):
            raise RuntimeError(f"DecodeBatch: {len(sequences)} sequences, {self.free} free slots")
        self._free.sort()
        for seq in sequences:
            seq.slot = self._free.pop(0)
            self.pending.append(seq)

    def abort(self) -> list[Sequence]:
        """End every sequence (stop_reason "abort"), free all slots and the cache."""
        ended = self.running + self.pending
        for seq in ended:
            seq.stop_reason = "abort"
        self.running, self.pending = [], []
        self._free = list(range(self.slots))
        self._cache = None
        return ended

    @torch.inference_mode()
    def step(self, version: int, now: float = 0.0) -> list[Sequence]:
        """One forward pass; returns the sequences that ended in it.

        Parameters
        ----------
        version : int
            Policy version of the weights (tagged on every token sampled).
        now : float
            Time recorded as ``first_token_time`` of sequences sampling their first token.
        """
        if not self.running and not self.pending:
            return []
        leaders, followers = _share_prompts(self.pending)
        rows = leaders + self.running
        self._reserve(rows)
        ids, plan, keep = self._plan(leaders, self.running)
        logits = self._forward(ids, plan, keep)
        for seq, leader in followers:
            self._cache.copy_slot(leader.slot, seq.slot, len(seq.input_ids))
        index = {id(seq): i for i, seq in enumerate(rows)}
        samplers = [index[id(leader)] for _, leader in followers]
        batch = rows + [seq for seq, _ in followers]
        tokens, logprobs = sample_rows(logits[list(range(len(rows))) + samplers], batch)
        self.running += self.pending
        self.pending = []
        return self._advance(batch, tokens, logprobs, version, now)

    def _forward(self, ids, plan: SlotPlan, keep) -> torch.Tensor:
        """Logits [rows, V] of the kept packed positions; the model attends through the slot
        cache for this call only (other callers of the model keep its own attention)."""
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attention)
        try:
            return self.model(
                input_ids=ids,
                position_ids=plan.token_positions[None],
                use_cache=False,
                logits_to_keep=keep,
                slot_plan=plan,
            ).logits[0]
        finally:
            self.model.set_attn_implementation(before)

    def _advance(self, batch, tokens, logprobs, version, now) -> list[Sequence]:
        ended = []
        for seq, tok, lp in zip(batch, tokens, logprobs):
            if not seq.tokens:
                seq.first_token_time = now
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            if self.eos_id is not None and tok == self.eos_id:
                seq.stop_reason = "stop"
            elif len(seq.tokens) >= seq.budget:
                seq.stop_reason = "length"
            else:
                continue
            ended.append(seq)
            self._free.append(seq.slot)
        if ended:
            self.running = [seq for seq in self.running if not seq.stop_reason]
        if not self.running:
            self._cache = None  # idle: give the memory back
        return ended

    def _reserve(self, rows: list[Sequence]) -> None:
        longest = max(len(s.input_ids) + len(s.tokens) for s in rows)
        if self._cache is None:
            config = self.model.config.get_text_config()
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            param = next(self.model.parameters())
            self._cache = KVSlots(
                config.num_hidden_layers, self.slots,
                getattr(config, "num_key_value_heads", None) or heads, head_dim,
                param.dtype, param.device, capacity=_round_up(longest + 1, 64),
            )  # fmt: skip
        self._cache.reserve(longest + 1)

    def _plan(self, leaders: list[Sequence], running: list[Sequence]):
        """Packed input ids [1, T], the :class:`SlotPlan`, and the packed index of every row's
        last token (prefill leaders first, then the decode tokens)."""
        ids, slots, positions, prefill, keep = [], [], [], [], []
        for seq in leaders:
            start, n = len(ids), len(seq.input_ids)
            ids += seq.input_ids
            slots += [seq.slot] * n
            positions += range(n)
            prefill.append((start, start + n))
            keep.append(start + n - 1)
        device = self._cache.device
        plan = SlotPlan(self._cache, None, None, prefill)
        if running:
            lengths = [len(s.input_ids) + len(s.tokens) for s in running]
            first = len(ids)
            ids += [s.tokens[-1] for s in running]
            slots += [s.slot for s in running]
            positions += [n - 1 for n in lengths]
            keep += range(first, len(ids))
            plan.decode_index = torch.arange(first, len(ids), device=device)
            plan.decode_slots = torch.tensor([s.slot for s in running], device=device)
            rows = 1 + max(s.slot for s in running)
            per_slot = [1] * rows  # slots not decoding: position 0 only (their row is dropped)
            for seq, n in zip(running, lengths):
                per_slot[seq.slot] = n
            mask = torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(per_slot).unsqueeze(1)
            plan.decode_mask = mask[:, None, None, :].to(device)
        plan.token_slots = torch.tensor(slots, device=device)
        plan.token_positions = torch.tensor(positions, device=device)
        return (
            torch.tensor(ids, device=device)[None],
            plan,
            torch.tensor(keep, device=device),
        )


def _share_prompts(pending: list[Sequence]):
    """Split newly added sequences into leaders (prefilled) and (follower, leader) pairs whose
    token ids equal their leader's."""
    first: dict[tuple, Sequence] = {}
    leaders, followers = [], []
    for seq in pending:
        key = tuple(seq.input_ids)
        if key in first:
            followers.append((seq, first[key]))
        else:
            first[key] = seq
            leaders.append(seq)
    return leaders, followers


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """Next token and its behaviour log-prob for each row.

    Parameters
    ----------
    logits : torch.Tensor
        Shape [rows, V], the raw next-token logits (any float dtype; computed in float32,
        or float64 for float64 logits).
    seqs : list[Sequence]
        The sequence of each row (temperature, top_p, seed, offset, tokens so far).

    Returns
    -------
    (list[int], list[float])
        Token ids and ``log_softmax(logits / T)`` at them (T = 1 for greedy rows).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    chosen = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    scale = torch.ones(len(seqs), dtype=logits.dtype, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, seq in enumerate(seqs):
        mode = (
            "greedy" if seq.temperature == 0 else ("seeded" if seq.seed is not None else "random")
        )
        key = (mode, 0.0, 1.0) if mode == "greedy" else (mode, seq.temperature, seq.top_p)
        groups.setdefault(key, []).append(i)
    for (mode, temperature, top_p), rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        scores = logits.index_select(0, index)
        if mode == "greedy":
            chosen[index] = scores.argmax(dim=-1)
            continue
        scale[index] = temperature
        if mode == "seeded":
            sampler = SeededSampler([seqs[r].seed for r in rows], [0] * len(rows), 1,
                                    temperature, top_p)  # fmt: skip
            u = [seeded_uniform(seqs[r].seed, seqs[r].offset + len(seqs[r].tokens)) for r in rows]
            chosen[index] = sampler.choose(
                scores, torch.tensor(u, dtype=torch.float64, device=logits.device)
            )
        else:
            chosen[index] = _draw(scores, temperature, top_p)
    logprobs = torch.log_softmax(logits / scale.unsqueeze(1), dim=-1)
    picked = logprobs.gather(1, chosen.unsqueeze(1))[:, 0]
    return chosen.tolist(), picked.tolist()


def _draw(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Multinomial draw from the tempered softmax, restricted to its top-p nucleus."""
    probs = torch.softmax(scores / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        return order.gather(1, torch.multinomial(sorted_probs, 1)).squeeze(1)
    return torch.multinomial(probs, 1).squeeze(1)
