"""The cases of the LM-head benchmark (``bench_logprobs.py``): shapes, inputs, the operation
each implementation runs, and the ratios derived from their times and memory.

Shared by the CPU runner (one child process per case, in ``bench_logprobs.py``) and the
in-process runner (CUDA, or the CPU with ``--in-process``; ``_lm_head_inprocess.py``).
torch and areal_fast are imported inside the functions, so a parent process that only
launches children stays small.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics

import _harness as hx
from _lm_head_baselines import (
    Skip,
    compiled_grpo_loss_fn,
    liger_grpo_loss_fn,
    torch_lce_logprobs_fn,
)

SHAPES = {  # (T, H, V)
    "cpu": {"small": [(512, 128, 5003)], "large": [(4096, 576, 49152), (2048, 2048, 151936)]},
    "cuda": {"small": [(2048, 512, 32000)], "large": [(16384, 4096, 151936)]},
}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
MODES = ("fwd", "fwd_bwd")
LOGPROB_IMPLS = ("ours", "naive", "torch_lce")
LOSS_IMPLS = ("fused_loss", "ours_loss", "naive_loss", "compiled_loss", "liger_grpo")
# baselines whose first call compiles (torch.compile): warmed up apart (--warmup-only)
COMPILED_IMPLS = ("compiled_loss", "liger_grpo")
# "cpu": one child process per case; "cuda": every case in one process (CUDA, or the CPU
# with --in-process)
DEFAULT_IMPLS = {
    "cpu": ("matmul", "ours", "naive", "torch_lce", "fused_loss", "ours_loss", "naive_loss"),
    "cuda": (
        "matmul",
        "fused_loss",
        "compiled_loss",
        "liger_grpo",
        "ours",
        "ours_loss",
        "naive",
        "naive_loss",
        "torch_lce",
        "ours[torch]",
    ),
}
COMPILE_CHUNK_TOKENS = 2048  # tokens per compiled call of compiled_loss
OURS_VARIANTS = ("auto", "torch", "native", "triton")
NUM_SEQS = 8  # sequences per packed batch (equal lengths; cu_seqlens int32)
OLD_LOGPROB_NOISE = 0.1  # old_logprobs = ours' logprobs + N(0, 0.1²): some ratios clip at 0.2
SEED = 0


def baseline_of(impl: str) -> str:
    return "naive_loss" if is_loss(impl) else "naive"


def is_loss(impl: str) -> bool:
    return parse_impl(impl)[0] in LOSS_IMPLS


def parse_impl(impl: str) -> tuple[str, str | None]:
    """'ours[triton]' -> ('ours', 'triton'); 'naive' -> ('naive', None)."""
    if impl.endswith("]") and "[" in impl:
        base, variant = impl[:-1].split("[", 1)
        return base, variant
    return impl, None


def valid_impl(impl: str, layout: str) -> bool:
    """Whether ``impl`` can run under ``layout``: "cpu" (a child process per case) or "cuda"
    (every case in one process: CUDA, or the CPU with ``--in-process``; Liger's loss only
    there)."""
    base, variant = parse_impl(impl)
    if variant is not None:
        return base in ("ours", "fused_loss") and variant in OURS_VARIANTS
    if impl == "liger_grpo":
        return layout == "cuda"
    return impl in ("matmul",) + LOGPROB_IMPLS + LOSS_IMPLS


def modes_of(impl: str, layout: str = "cpu") -> tuple[str, ...]:
    """Modes timed for ``impl``: loss rows fwd_bwd only (the fused loss also fwd under the
    "cuda" layout: the loss value without gradients), ``matmul`` fwd only, log-prob rows
    both."""
    if is_loss(impl):
        if layout == "cuda" and parse_impl(impl)[0] == "fused_loss":
            return MODES
        return ("fwd_bwd",)
    if impl == "matmul":
        return ("fwd",)
    return MODES


def model_flops(shape, mode: str) -> float:
    T, H, V = shape
    return (2.0 if mode == "fwd" else 6.0) * T * H * V


def shape_name(shape) -> str:
    return "T{}_H{}_V{}".format(*shape)


def shape_entry(shape, dtype: str, grad_bytes: int) -> dict:
    """Result record of one shape: its sizes, the MB of the gradient outputs
    (hidden.grad + weight.grad at ``grad_bytes`` per element) and of fp32 [T, V] logits."""
    T, H, V = shape
    return {
        "name": shape_name(shape),
        "T": T,
        "H": H,
        "V": V,
        "dtype": dtype,
        "grad_buffers_mb": (T * H + V * H) * grad_bytes / hx.MIB,
        "logits_fp32_mb": T * V * 4 / hx.MIB,
        "modes": {},
    }


# ---------------------------------------------------------------------------
# Inputs and operations (torch imported lazily: the parent process stays small)
# ---------------------------------------------------------------------------


def make_inputs(shape, dtype_name: str, device: str, seed: int, with_loss: bool) -> dict:
    """Fixed-seed inputs. hidden ~ N(0, 1), weight ~ N(0, 1/H) (logits of unit scale),
    labels uniform, upstream gradient ~ N(0, 1) per token; for the loss: NUM_SEQS sequences
    of equal length, advantages ~ N(0, 1) per sequence, every token in the loss mask,
    old_logprobs = ours' logprobs + N(0, OLD_LOGPROB_NOISE²)."""
    import torch

    import areal_fast as af

    T, H, V = shape
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    hidden = torch.randn(T, H, dtype=torch.float32, **kw).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, dtype=torch.float32, **kw) / math.sqrt(H)).to(dtype)
    weight.requires_grad_()
    labels = torch.randint(0, V, (T,), **kw)
    grad_out = torch.randn(T, dtype=torch.float32, **kw)
    inputs = dict(hidden=hidden, weight=weight, labels=labels, grad_out=grad_out)
    if with_loss:
        if T % NUM_SEQS:
            raise ValueError(f"T = {T} must be a multiple of {NUM_SEQS}")
        seqlen = T // NUM_SEQS
        inputs["cu_seqlens"] = torch.arange(0, T + 1, seqlen, dtype=torch.int32, device=device)
        inputs["advantages"] = torch.randn(NUM_SEQS, dtype=torch.float32, **kw)
        inputs["loss_mask"] = torch.ones(T, dtype=torch.bool, device=device)
        with torch.no_grad():
            ref = af.linear_logprobs(hidden, weight, labels)
        noise = torch.randn(T, dtype=torch.float32, **kw) * OLD_LOGPROB_NOISE
        inputs["old_logprobs"] = (ref.detach().float() + noise).contiguous()
        del ref
    return inputs


def _naive_logprobs(hidden, weight, labels):
    import torch

    logits = (hidden @ weight.t()).float()  # [T, V] fp32, materialised
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


@dataclasses.dataclass(frozen=True)
class OpOptions:
    """How the compiled baselines are built: ``liger_compiled`` (Liger's ``compiled=``),
    ``compile_backend`` and ``chunk_tokens`` of ``compiled_loss``."""

    liger_compiled: bool = True
    compile_backend: str = "inductor"
    chunk_tokens: int = COMPILE_CHUNK_TOKENS


def build_op(impl: str, mode: str, inputs: dict, options: OpOptions | None = None):
    """The operation of one case.

    Returns ``(fn, reset)``: ``fn()`` runs the op once and returns a dict of checks (output
    sum, or the loss value); ``reset()`` drops the gradients between calls; ``fn.info`` is a
    dict the run records (Liger's ``compiled`` state, torch_lce's variant).

    Raises
    ------
    Skip
        The implementation is not available here (the message says why).
    ValueError
        An unknown implementation or variant.
    """
    import torch

    options = options or OpOptions()
    h, w, g = inputs["hidden"], inputs["weight"], inputs["grad_out"]
    base, variant = parse_impl(impl)

    def reset():
        h.grad = None
        w.grad = None

    if base in LOSS_IMPLS:
        return _build_loss_op(base, variant, inputs, reset, mode, options)
    if base == "matmul":
        if mode == "fwd_bwd":
            raise Skip("matmul is timed forward only")

        def fn():
            with torch.no_grad():
                out = h @ w.t()
            return {"out_sum": float(out[0].float().sum())}  # a cheap check: row 0

        fn.info = {}
        return fn, reset
    logprobs, info = _logprobs_fn(base, variant, inputs)

    if mode == "fwd":

        def fn():
            with torch.no_grad():
                out = logprobs()
            return {"out_sum": float(out.double().sum())}
    else:

        def fn():
            out = logprobs()
            out.backward(g.to(out.dtype))
            return {"out_sum": float(out.detach().double().sum())}

    fn.info = info
    return fn, reset


def _logprobs_fn(base: str, variant: str | None, inputs: dict):
    """(logprobs() -> Tensor [T], info) of a log-prob implementation."""
    import areal_fast as af

    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    if base == "ours":
        kwargs = {}
        if variant is not None:
            if "impl" not in inspect.signature(af.linear_logprobs).parameters:
                raise Skip("areal_fast.linear_logprobs has no impl= keyword")
            kwargs["impl"] = variant
        return (lambda: af.linear_logprobs(h, w, y, **kwargs)), {"path": resolved_path(h, variant)}
    if base == "naive":
        return (lambda: _naive_logprobs(h, w, y)), {}
    if base == "torch_lce":
        fn, lce_variant = torch_lce_logprobs_fn(h, w, y)
        return fn, {"variant": lce_variant}
    raise ValueError(f"unknown implementation {base!r}")


def resolved_path(hidden, variant: str | None = None) -> str | None:
    """The row-epilogue implementation areal_fast's log-prob ops take for ``hidden``
    ("triton", "native" or "torch"), None where this areal_fast cannot say."""
    try:
        from areal_fast.ops import _dispatch
    except ImportError:
        return None
    try:
        return _dispatch.resolve_impl(variant, hidden.device, "logprob_rows_forward")
    except (ValueError, AttributeError):
        return None


def _build_loss_op(base, variant, inputs: dict, reset, mode: str, options: OpOptions):
    """``build_op`` for the loss rows (scalar loss; its backward on fwd_bwd)."""
    import torch

    import areal_fast as af

    h, w, y = inputs["hidden"], inputs["weight"], inputs["labels"]
    old, adv = inputs["old_logprobs"], inputs["advantages"]
    mask, cu = inputs["loss_mask"], inputs["cu_seqlens"]
    config = af.LossConfig()
    if variant is not None and base != "fused_loss":
        raise ValueError(f"{base} takes no [impl] variant")
    info = {}
    if base == "fused_loss":
        fused = getattr(af, "fused_linear_grpo_loss", None)
        if fused is None:
            raise Skip("areal_fast.fused_linear_grpo_loss does not exist in this checkout")
        kwargs = {} if variant is None else {"impl": variant}
        info["path"] = resolved_path(h, variant)

        def loss_fn():
            return fused(h, w, y, old, adv, mask, cu, config, **kwargs)[0]
    elif base in ("ours_loss", "naive_loss"):

        def loss_fn():
            lp = af.linear_logprobs(h, w, y) if base == "ours_loss" else _naive_logprobs(h, w, y)
            return af.grpo_loss(lp, old, adv, mask, cu, config)[0]
    elif base == "compiled_loss":
        loss_fn = compiled_grpo_loss_fn(
            inputs, config, options.chunk_tokens, backend=options.compile_backend
        )
        info["compile_backend"] = options.compile_backend
    elif base == "liger_grpo":
        loss_fn, info = liger_grpo_loss_fn(inputs, config, compiled=options.liger_compiled)
    else:
        raise ValueError(base)

    if mode == "fwd":

        def fn():
            with torch.no_grad():
                loss = loss_fn()
            return {"loss": float(loss)}
    else:

        def fn():
            loss = loss_fn()
            loss.backward()
            return {"loss": float(loss.detach())}

    fn.info = info
    return fn, reset


def grad_checks(inputs: dict) -> dict:
    h, w = inputs["hidden"], inputs["weight"]
    out = {}
    if h.grad is not None:
        out["grad_hidden_norm"] = float(h.grad.double().norm())
    if w.grad is not None:
        out["grad_weight_norm"] = float(w.grad.double().norm())
    return out


# ---------------------------------------------------------------------------
# Ratios
# ---------------------------------------------------------------------------


def add_ratios(entry: dict, shape, mode: str) -> None:
    """time / memory ratios of each implementation of ``entry[mode]`` against its baseline
    (naive or naive_loss) and torch_lce (log-prob rows) or ours_loss (loss rows); model
    GFLOP/s and the fraction of the forward matmul rate of the same shape."""
    cases = entry["modes"][mode]
    mm = entry["modes"].get("fwd", {}).get("matmul", {}).get("median_s")
    for impl, rec in cases.items():
        if rec.get("median_s") is None:
            continue
        rec["model_gflops_per_s"] = model_flops(shape, mode) / rec["median_s"] / 1e9
        if mm and mode == "fwd_bwd":
            rec["matmul_rate_fraction"] = 3 * mm / rec["median_s"]
        elif mm:
            rec["matmul_rate_fraction"] = mm / rec["median_s"]
        refs = [baseline_of(impl)]
        refs += ["torch_lce"] if not is_loss(impl) else ["ours_loss"]
        for ref in refs:
            other = cases.get(ref, {})
            if ref == impl or other.get("median_s") is None:
                continue
            rec[f"time_ratio_vs_{ref}"] = rec["median_s"] / other["median_s"]
            paired = paired_time_ratios(rec, other)
            if paired is not None:
                rec[f"paired_time_ratio_vs_{ref}"] = paired
            for key, suffix in (("extra_peak_mb", ""), ("extra_peak_mb_warm", "_warm")):
                if rec.get(key) is not None and other.get(key):
                    rec[f"peak_mem_ratio_vs_{ref}{suffix}"] = rec[key] / other[key]


def paired_time_ratios(rec: dict, ref: dict) -> dict | None:
    """Round-by-round time ratios of ``rec`` over ``ref``.

    Both records carry ``round_times_s``: per round (``--rounds``), the seconds of that
    round's timed calls, ``None`` for a round that failed. The ratio of each round whose two
    cases both ran is median(rec's calls) / median(ref's calls); both ran in the same round
    of the case list, a few seconds apart, so a load that drifts between rounds reaches both
    alike. Returns ``{"median", "min", "max", "per_round"}`` (dimensionless, lower is faster),
    or None with fewer than two such rounds.
    """
    mine, theirs = rec.get("round_times_s"), ref.get("round_times_s")
    if not mine or not theirs:
        return None
    per_round = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(mine, theirs)
        if a and b and statistics.median(b) > 0
    ]
    if len(per_round) < 2:
        return None
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "per_round": per_round,
    }
