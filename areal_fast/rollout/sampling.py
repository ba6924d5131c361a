"""Seeded, batch-independent token sampling for transformers generation."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import LogitsProcessor

from areal_fast.rollout.engine import seeded_uniform


class SeededSampler(LogitsProcessor):
    """Draw each row's next token by inverse transform sampling with a counter-based uniform.

    The token at completion position ``t`` of a sample with seed ``s`` is drawn from the
    uniform number ``u = seeded_uniform(s, t)``: the categorical distribution (tempered
    softmax, optionally restricted to its top-p nucleus) is laid out as a cumulative
    distribution and the first token whose cumulative mass exceeds ``u * total`` is chosen
    (inverse transform sampling). ``u`` is a pure function of ``(s, t)`` (a counter-based
    generator), so a draw does not depend on which other rows share the batch, on padding,
    or on whether the sample was interrupted and resumed from its partial completion.

    The processor returns scores that are ``-inf`` everywhere except ``0`` at the chosen
    token, so it must run with ``do_sample=False``: greedy selection then picks that token.

    Parameters
    ----------
    seeds : sequence of int
        Sampling seed of each row, length ``rows`` (64-bit; see
        :func:`areal_fast.rollout.engine.sample_seed`).
    offsets : sequence of int
        Completion tokens each row generated before this call of ``generate`` (>= 0), length
        ``rows``.
    start_len : int
        Width of the (padded) input given to ``generate``; the first call sees
        ``cur_len == start_len``.
    temperature : float
        Softmax temperature (> 0).
    top_p : float
        Nucleus mass in (0, 1]. With ``top_p < 1`` the probabilities are sorted in
        descending order (ties by token index, stably), the smallest prefix whose mass
        reaches ``top_p`` is kept (always at least one token) and renormalised; the
        cumulative distribution then runs in that sorted order. With ``top_p == 1`` it runs
        in vocabulary order.

    Raises
    ------
    ValueError
        If ``seeds`` and ``offsets`` differ in length, an offset is negative, ``start_len``
        is < 1, ``temperature`` is not > 0 or ``top_p`` is outside (0, 1].

    Notes
    -----
    Probabilities are computed in float64. Tokens with ``-inf`` logits have zero mass and
    are never chosen. Every row must have at least one finite logit.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        offsets: Sequence[int],
        start_len: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ):
        if len(seeds) != len(offsets):
            raise ValueError(f"offsets has {len(offsets)} entries, seeds has {len(seeds)}")
        if any(o < 0 for o in offsets):
            raise ValueError(f"offsets = {list(offsets)} must all be >= 0")
        if start_len < 1:
            raise ValueError(f"start_len = {start_len} must be >= 1")
        if not temperature > 0:
            raise ValueError(f"temperature = {temperature} must be > 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p = {top_p} must be in (0, 1]")
        self.seeds = [int(s) for s in seeds]
        self.offsets = [int(o) for o in offsets]
        self.start_len = int(start_len)
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def uniforms(self, cur_len: int) -> list[float]:
        """Uniform number of each row at the step where the sequence width is ``cur_len``.

        Returns
        -------
        list of float
            ``seeded_uniform(seeds[r], offsets[r] + cur_len - start_len)`` per row, in [0, 1).
        """
        step = cur_len - self.start_len
        return [seeded_uniform(s, o + step) for s, o in zip(self.seeds, self.offsets)]

    def choose(self, scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draw of one token per row.

        Parameters
        ----------
        scores : torch.Tensor
            Raw logits, shape [rows, V], any floating dtype.
        u : torch.Tensor
            Uniform numbers in [0, 1), shape [rows], float64, on ``scores.device``.

        Returns
        -------
        torch.Tensor
            Chosen token ids, shape [rows], int64.
        """
        probs = torch.softmax(scores.double() / self.temperature, dim=-1)
        if self.top_p < 1:
            probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            cum = probs.cumsum(dim=-1)
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
            probs = probs.masked_fill(before >= self.top_p, 0.0)
        else:
            order = None
        cdf = probs.cumsum(dim=-1)
        threshold = (u * cdf[:, -1]).unsqueeze(-1)
        pos = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
        # u * total can round up to total; fall back to the last token with positive mass.
        index = torch.arange(probs.shape[-1], device=probs.device)
        last = torch.where(probs > 0, index, -1).amax(dim=-1)
        pos = torch.minimum(pos, last)
        if order is not None:
            pos = order.gather(1, pos.unsqueeze(-1)).squeeze(-1)
        return pos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """Force each row's next token to its seeded draw.

        Parameters
        ----------
        input_ids : torch.LongTensor
            Sequences so far, shape [rows, cur_len], int64.
        scores : torch.Tensor
            Next-token logits, shape [rows, V] (float32 in transformers generation).

        Returns
        -------
        torch.Tensor
            Shape [rows, V], dtype of ``scores``: ``-inf`` everywhere except ``0`` at the
            chosen token of each row.

        Raises
        ------
        ValueError
            If the number of rows differs from ``len(seeds)`` or ``cur_len < start_len``.
        """
        rows, cur_len = input_ids.shape
        if rows != len(self.seeds) or scores.shape[0] != rows:
            raise ValueError(
                f"input_ids has {rows} rows, scores {scores.shape[0]}, "
                f"the sampler was built for {len(self.seeds)}"
            )
        if cur_len < self.start_len:
            raise ValueError(f"input_ids width {cur_len} is below start_len = {self.start_len}")
        u = torch.tensor(self.uniforms(cur_len), dtype=torch.float64, device=scores.device)
        chosen = self.choose(scores, u)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen.unsqueeze(-1), 0.0)
        return out
