"""Baselines of the LM-head benchmark (``bench_logprobs.py``) that are not areal_fast's own.

- :func:`liger_grpo_loss_fn`: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (chunked, its chunk
  function under ``torch.compile`` when ``compiled``), fed the benchmark's packed batch as
  [B, L] sequences of equal length;
- :func:`compiled_grpo_loss_fn`: the same GRPO loss written in plain torch, chunked over the
  tokens, each chunk's value and gradients formed by one ``torch.compile``'d function of
  ``torch.func.grad_and_value``: what a user gets from torch alone, on any torch ≥ 2.1;
- :func:`torch_lce_logprobs_fn`: ``torch.nn.functional.linear_cross_entropy`` in whatever
  form the installed torch has (absent; without ``options=``, the reference implementation
  that materialises the logits; with ``options=LinearCrossEntropyOptions()``, chunked).

All three compute the loss of :class:`areal_fast.LossConfig`'s defaults where they are a loss:
per token ``max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high))`` with
``r = exp(logp − old_logp)`` (Schulman et al. 2017, PPO, Eq. 7; GRPO's per-sequence
advantage A, Shao et al. 2024), averaged over the tokens of the loss mask ("token_mean").

:func:`fallback_reasons` reads the warnings a timed case raised for signs that it ran a
slower path than the one asked for.
"""

from __future__ import annotations

import inspect
import re


class Skip(Exception):
    """An implementation that is not available here (the message says why)."""


def clip_bounds(config) -> tuple[float, float]:
    """(1 − eps_clip, 1 + eps_clip_high) of a :class:`areal_fast.LossConfig` (eps_clip_high
    None means eps_clip)."""
    high = config.eps_clip if config.eps_clip_high is None else config.eps_clip_high
    return 1.0 - config.eps_clip, 1.0 + high


def liger_grpo_loss_fn(inputs: dict, config, compiled: bool):
    """Liger-Kernel's chunked GRPO loss on the benchmark's batch.

    Parameters
    ----------
    inputs : dict
        ``bench_logprobs.make_inputs(..., with_loss=True)``: hidden [T, H], weight [V, H]
        (bf16 on CUDA), labels [T] int64, old_logprobs [T] fp32, advantages [B] fp32,
        loss_mask [T] bool, every sequence T // B tokens long.
    config : areal_fast.LossConfig
        Clip range (eps_clip, eps_clip_high); no KL term (beta 0, no reference model).
    compiled : bool
        Passed to ``LigerFusedLinearGRPOLoss(compiled=...)``: its chunk function under
        ``torch.compile`` (Liger's default) or eager.

    Returns
    -------
    (loss_fn, state)
        ``loss_fn()`` -> scalar loss Tensor (token-mean, "dapo" in Liger's terms);
        ``state``: {"compiled": bool, "fallback": str | None}. A compiled call that raises
        is retried once with ``compiled=False``; ``state`` then records it (the benchmark
        marks such a case as fallen back, never silently).

    Raises
    ------
    Skip
        liger_kernel does not import.
    """
    import torch

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:  # not installed, or its import failed
        raise Skip(f"liger_kernel not importable ({type(exc).__name__}: {exc})") from None
    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    T, H = h.shape
    B = inputs["advantages"].numel()
    L = T // B
    old = inputs["old_logprobs"].view(B, L)
    mask = inputs["loss_mask"].view(B, L).to(torch.int64)
    adv, labels = inputs["advantages"], y.view(B, L)
    low, high = clip_bounds(config)
    common = dict(
        beta=0.0,
        use_ref_model=False,
        epsilon_low=1.0 - low,
        epsilon_high=high - 1.0,
        loss_type="dapo",
        temperature=1.0,
    )
    state = {"compiled": compiled, "fallback": None}
    module = {"loss": LigerFusedLinearGRPOLoss(compiled=compiled, **common)}

    def call():
        out = module["loss"](h.view(B, L, H), w, labels, mask, adv, old_per_token_logps=old)
        return out[0] if isinstance(out, tuple) else out

    def loss_fn():
        try:
            return call()
        except Exception as exc:
            if not state["compiled"]:
                raise
            state["fallback"] = f"compiled=True raised {type(exc).__name__}: {str(exc)[:200]}"
            state["compiled"] = False
            module["loss"] = LigerFusedLinearGRPOLoss(compiled=False, **common)
            return call()

    return loss_fn, state


def compiled_grpo_loss_fn(inputs: dict, config, chunk_tokens: int = 2048, backend="inductor"):
    """GRPO loss in plain torch, chunked over tokens, each chunk under ``torch.compile``.

    For every chunk of ``chunk_tokens`` tokens one compiled call of
    ``torch.func.grad_and_value`` returns the chunk's summed per-token loss and its gradients
    with respect to the chunk's hidden states and the weight (the [chunk, V] fp32 logits live
    only inside that call); the forward accumulates them and the backward hands them out
    scaled by the incoming gradient. Peak extra memory: the fp32 weight-gradient accumulator
    [V, H] plus one chunk's logits and their gradient.

    Parameters
    ----------
    inputs : dict
        As for :func:`liger_grpo_loss_fn` (cu_seqlens [B+1] int32 gives each sequence's
        advantage to its tokens).
    config : areal_fast.LossConfig
        Clip range; the loss is the token mean over ``loss_mask``.
    chunk_tokens : int
        Tokens per compiled call (the last chunk may be shorter: one more compilation).
    backend : str
        ``torch.compile`` backend ("inductor"; "eager" traces without generating code).

    Returns
    -------
    loss_fn : callable () -> Tensor [] float32, differentiable w.r.t. hidden and weight
    """
    import torch

    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    T = h.shape[0]
    cu = inputs["cu_seqlens"].long()
    adv_tok = torch.repeat_interleave(inputs["advantages"].float(), cu[1:] - cu[:-1])
    mask = inputs["loss_mask"].float()
    old = inputs["old_logprobs"].float()
    count = mask.sum().clamp_min(1.0)
    low, high = clip_bounds(config)

    def chunk_loss(h_c, w_, y_c, old_c, adv_c, mask_c):
        logits = (h_c @ w_.t()).float()
        logp = logits.gather(1, y_c[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ratio = torch.exp(logp - old_c)
        per_token = torch.maximum(-adv_c * ratio, -adv_c * ratio.clamp(low, high))
        return (per_token * mask_c).sum()

    step = torch.compile(
        torch.func.grad_and_value(chunk_loss, argnums=(0, 1)), backend=backend, dynamic=False
    )

    class ChunkedLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight):
            grad_h = torch.empty_like(hidden)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, T, chunk_tokens):
                rows = slice(start, min(start + chunk_tokens, T))
                (g_h, g_w), value = step(
                    hidden[rows], weight, y[rows], old[rows], adv_tok[rows], mask[rows]
                )
                grad_h[rows] = (g_h.float() / count).to(hidden.dtype)
                grad_w += g_w
                total += value
            ctx.save_for_backward(grad_h, (grad_w / count).to(weight.dtype))
            return total / count

        @staticmethod
        def backward(ctx, grad_out):
            grad_h, grad_w = ctx.saved_tensors
            return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype)

    return lambda: ChunkedLoss.apply(h, w)


def torch_lce_logprobs_fn(hidden, weight, labels):
    """Per-token log-probs through ``torch.nn.functional.linear_cross_entropy``.

    Returns
    -------
    (fn, variant)
        ``fn()`` -> Tensor [T] (``-linear_cross_entropy(..., reduction="none")``);
        ``variant``: "chunked" (``options=LinearCrossEntropyOptions()``) or "reference"
        (a torch whose function has no ``options=``: it materialises the [T, V] logits).

    Raises
    ------
    Skip
        This torch has no ``linear_cross_entropy``.
    """
    import torch

    F = torch.nn.functional
    if not hasattr(F, "linear_cross_entropy"):
        raise Skip(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
    params = inspect.signature(F.linear_cross_entropy).parameters
    if "options" in params and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        options = torch.nn.LinearCrossEntropyOptions()

        def chunked():
            return -F.linear_cross_entropy(
                hidden, weight, labels, reduction="none", options=options
            )

        return chunked, "chunked"

    def reference():
        return -F.linear_cross_entropy(hidden, weight, labels, reduction="none")

    return reference, "reference"


_FALLBACK = re.compile(
    r"fall(s|ing)?[ -]?back|fallback|using the torch implementation|using torch copies"
    r"|_C is not|cannot import|materiali[sz]",
    re.IGNORECASE,
)


def fallback_reasons(messages: list[str]) -> list[str]:
    """The warnings (``"Category: message"`` strings) that say a slower path ran: every
    RuntimeWarning (areal_fast raises one when a CUDA kernel or the extension is unavailable
    and torch takes over) and any warning that speaks of falling back or materialising."""
    return [m for m in messages if m.startswith("RuntimeWarning") or _FALLBACK.search(m)]
