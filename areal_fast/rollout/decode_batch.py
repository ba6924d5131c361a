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

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from areal_fast.rollout.engine import seeded_uniform
from areal_fast.rollout.kv_slots import KVSlots, SlotPlan, register_slot_attention
from areal_fast.rollout.sampling import SeededSampler

# shared leading tokens from which a prefix is reused rather than computed again
PREFIX_MIN = 16
# On a CPU, matrix products of 6 to 15 rows take longer than of 16 (the BLAS's small-matrix
# path; 576 → 1536 on one core: 12 rows 0.58 ms, 16 rows 0.40 ms; the 49152-row output layer:
# 12 rows 39 ms, 16 rows 21 ms): steps of that many tokens are padded to 16 (dummy tokens in a
# scratch slot), and so are the rows of the output layer.
PAD_ROWS = (6, 16)


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
        ``time.monotonic()`` once its first token was sampled (the end of that step).
    slot, past : int
        Its slot (-1 before :meth:`DecodeBatch.add`) and how many of ``input_ids`` that slot
        holds already (their keys and values are not computed again).
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
    past: int = 0


class DecodeBatch:
    """Up to ``slots`` sequences decoded together, joining and leaving at every step.

    Prefixes are computed once (:data:`PREFIX_MIN` tokens or more in common):

    - sequences added for the same step that share a prefix with an earlier one of them (the
      samples of a GRPO group, resubmitted partial samples of one prompt) copy its keys and
      values for that prefix and prefill only the rest;
    - a sequence that ends leaves its keys and values in its slot until the slot is needed;
      a new sequence continuing those tokens (an agent's next call, which repeats the whole
      conversation) takes that slot and prefills only the new tokens. Such slots are
      forgotten when the weights change (the version passed to :meth:`step`).

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
        If ``slots`` < 1.
    """

    def __init__(self, model, slots: int, eos_id: Optional[int]):
        if slots < 1:
            raise ValueError(f"slots = {slots} must be >= 1")
        self.attention = register_slot_attention()
        self.model = model
        self.slots = slots
        self.eos_id = eos_id
        self.running: list[Sequence] = []  # prefilled, in order of arrival
        self.pending: list[Sequence] = []  # added, prefilled at the next step
        self._free = list(range(slots))
        # free slots whose cache still holds these tokens' keys and values, oldest first
        self._kept: dict[int, list[int]] = {}
        self._kv_version: Optional[int] = None
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
        """Give each sequence a free slot (one whose cached tokens it continues, if any);
        they are prefilled at the next :meth:`step`.

        Raises
        ------
        RuntimeError
            If there are fewer free slots than sequences.
        """
        if len(sequences) > len(self._free):
            raise RuntimeError(f"DecodeBatch: {len(sequences)} sequences, {self.free} free slots")
        for seq in sequences:
            seq.slot, seq.past = self._take_slot(seq.input_ids)
            self.pending.append(seq)

    def _take_slot(self, ids: list[int]) -> tuple[int, int]:
        """A free slot for a sequence of ``ids`` and how many of them it holds already."""
        best, held = None, 0
        for slot, tokens in self._kept.items():
            n = _common_prefix(tokens, ids, len(ids) - 1)
            if n > held:
                best, held = slot, n
        if best is None or held < PREFIX_MIN:
            plain = [s for s in self._free if s not in self._kept]
            best = min(plain) if plain else next(iter(self._kept))  # else the oldest kept
            held = 0
        self._free.remove(best)
        self._kept.pop(best, None)
        return best, held

    def abort(self) -> list[Sequence]:
        """End every sequence (stop_reason "abort"), free all slots and the cache."""
        ended = self.running + self.pending
        for seq in ended:
            seq.stop_reason = "abort"
        self.running, self.pending = [], []
        self._free = list(range(self.slots))
        self._kept.clear()
        self._cache = None
        return ended

    @torch.inference_mode()
    def step(self, version: int) -> list[Sequence]:
        """One forward pass; returns the sequences that ended in it.

        Parameters
        ----------
        version : int
            Policy version of the weights (tagged on every token sampled; kept prefixes of
            another version are not reused).
        """
        if not self.running and not self.pending:
            return []
        if version != self._kv_version:  # cached keys and values of other weights
            self._kept.clear()
            for seq in self.pending:
                seq.past = 0
            self._kv_version = version
        self._reserve(self.pending + self.running)
        copies, same = _share_prefixes(self.pending)
        prefill = [seq for seq in self.pending if id(seq) not in same]
        ids, plan, keep = self._plan(prefill, self.running)
        plan.copies = copies
        rows = prefill + self.running
        logits = self._forward(ids, plan, keep)[: len(rows)]
        index = {id(seq): i for i, seq in enumerate(rows)}
        batch = rows + [seq for seq in self.pending if id(seq) in same]
        order = list(range(len(rows))) + [index[id(same[id(seq)])] for seq in batch[len(rows) :]]
        tokens, logprobs = sample_rows(logits[order], batch)
        self.running += self.pending
        self.pending = []
        return self._advance(batch, tokens, logprobs, version, time.monotonic())

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
            # its cache holds every token but the last sampled one
            self._kept[seq.slot] = seq.input_ids + seq.tokens[:-1]
        if ended:
            self.running = [seq for seq in self.running if not seq.stop_reason]
        return ended

    def _reserve(self, rows: list[Sequence]) -> None:
        longest = max(len(s.input_ids) + len(s.tokens) for s in rows)
        if self._cache is None:
            config = self.model.config.get_text_config()
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            param = next(self.model.parameters())
            self._cache = KVSlots(  # one more slot: the padding's scratch slot
                config.num_hidden_layers, self.slots + 1,
                getattr(config, "num_key_value_heads", None) or heads, head_dim,
                param.dtype, param.device, capacity=_round_up(longest + 1, 64),
            )  # fmt: skip
        self._cache.reserve(longest + 1)

    def _plan(self, prefill: list[Sequence], running: list[Sequence]):
        """Packed input ids [1, T], the :class:`SlotPlan`, and the packed index of every row's
        last token (prefill sequences first, then the decode tokens)."""
        ids, slots, positions, chunks, keep = [], [], [], [], []
        for seq in prefill:
            start, n = len(ids), len(seq.input_ids)
            ids += seq.input_ids[seq.past :]
            slots += [seq.slot] * (n - seq.past)
            positions += range(seq.past, n)
            chunks.append((start, len(ids), seq.slot, seq.past))
            keep.append(len(ids) - 1)
        device = self._cache.device
        plan = SlotPlan(self._cache, None, None, chunks)
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
            plan.decode_gather = rows > 2 * len(running)  # few sequences over many slots
            if plan.decode_gather:
                per_row = lengths
            else:  # slots not decoding: position 0 only (their row is dropped)
                per_row = [1] * rows
                for seq, n in zip(running, lengths):
                    per_row[seq.slot] = n
            mask = torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(per_row).unsqueeze(1)
            plan.decode_mask = mask[:, None, None, :].to(device)
        low, high = PAD_ROWS
        if device.type == "cpu" and low <= len(ids) < high:  # dummy tokens, scratch slot
            pad = high - len(ids)
            chunks.append((len(ids), high, self.slots, 0))
            ids += [ids[-1]] * pad
            slots += [self.slots] * pad
            positions += range(pad)
        if device.type == "cpu" and low <= len(keep) < high:
            keep += [keep[-1]] * (high - len(keep))  # rows dropped after the output layer
        plan.token_slots = torch.tensor(slots, dtype=torch.long, device=device)
        plan.token_positions = torch.tensor(positions, dtype=torch.long, device=device)
        return (
            torch.tensor(ids, device=device)[None],
            plan,
            torch.tensor(keep, device=device),
        )


def check_model(model) -> None:
    """Raise ``ValueError`` (one line naming ``rollout.hf_batching``) when the slot attention
    cannot run ``model``: logit soft-capping or sliding-window layers, which it does not
    implement."""
    config = model.config.get_text_config()
    softcap = getattr(config, "attn_logit_softcapping", None)
    types = getattr(config, "layer_types", None)
    if types:  # per-layer attention kinds (Qwen2/3, Gemma, ...)
        sliding = "sliding_attention" in types
    else:  # one window for every layer when set (Mistral's default 4096)
        sliding = bool(getattr(config, "sliding_window", None)) and getattr(
            config, "use_sliding_window", True
        )
    if softcap or sliding:
        what = "attention logit soft-capping" if softcap else "sliding-window attention layers"
        raise ValueError(
            f"rollout.hf_batching = 'continuous' does not implement the {what} of "
            f"{type(model).__name__}; use rollout.hf_batching=static"
        )


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _share_prefixes(pending: list[Sequence]):
    """Prefixes that sequences added for one step share with an earlier one of them.

    A sequence with nothing cached (``past == 0``) that shares :data:`PREFIX_MIN` or more
    leading tokens with an earlier such sequence copies the keys and values of the longest
    such prefix (``past`` is set to its length; the copies run in order, so a source that
    copied its own prefix from a third sequence has it in place). Returns the copies
    ``(src slot, dst slot, tokens)`` and, for sequences whose ids equal their source's
    (nothing left to prefill), the source whose logits they sample from, by ``id``.
    """
    copies, same, sources = [], {}, []
    for seq in pending:
        if seq.past:
            continue
        best, held = None, 0
        for src in sources:
            n = _common_prefix(src.input_ids, seq.input_ids, len(seq.input_ids))
            if n > held:
                best, held = src, n
        if best is not None and held >= PREFIX_MIN:
            copies.append((best.slot, seq.slot, held))
            if held == len(seq.input_ids) == len(best.input_ids):
                same[id(seq)] = same.get(id(best), best)
                continue  # its ids are its source's: not a source of its own
            seq.past = min(held, len(seq.input_ids) - 1)
        sources.append(seq)
    return copies, same


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
