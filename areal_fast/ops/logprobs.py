"""Token log-probs and entropy through the LM head without materialising [T, V] logits.

``linear_logprobs`` computes, for packed tokens, ``log_softmax((h · Wᵀ + b) / temperature)``
at the label and the entropy of that same distribution, chunk by chunk over tokens: only a
[chunk, V] block of logits is formed at a time. The backward needs each block's logits again:
blocks kept from the forward within the ``AREAL_FAST_LOGITS_CACHE_MB`` budget
(:mod:`areal_fast.ops.logits_cache`; 2048 MiB on the CPU, 0 elsewhere by default) are used as
they are, the others are recomputed. Weight and bias gradients accumulate in fp32 across
chunks. The row epilogue runs in torch, the native C++ kernels or Triton
(:mod:`areal_fast.ops.logprob_rows`); the native CPU path forms the logits in vocabulary tiles
(:mod:`areal_fast.ops.logprobs_tiled`).
"""

from __future__ import annotations

import functools
import math

import torch

from areal_fast.ops._dispatch import requested_impl, resolve_impl
from areal_fast.ops.logits_cache import LogitsCache, cache_budget_bytes, new_cache
from areal_fast.ops.logprob_rows import row_backend
from areal_fast.ops.logprobs_tiled import tiled_backward, tiled_forward

IGNORE_INDEX = -100
_CHUNK_BYTES = 64 * 1024 * 1024  # bytes of one [chunk, V] logits block
_MIN_CHUNK_ROWS = 256  # below this the matmuls lose efficiency (they stream the whole head)
_NATIVE_SYMBOL = "logprob_rows_forward"


def _chunk_size(num_tokens: int, vocab: int, itemsize: int = 4) -> int:
    """Tokens per chunk: one [chunk, V] block within ``_CHUNK_BYTES`` (≥ 256 rows)."""
    rows = max(_MIN_CHUNK_ROWS, _CHUNK_BYTES // (itemsize * vocab))
    return max(1, min(num_tokens, rows))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/single precision inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _matmul_weight(weight: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The LM head as the chunk matmuls use it.

    On CUDA half-precision weights stay as they are (tensor-core matmuls with fp32 output);
    elsewhere they are upcast once to the accumulation dtype, so the logits carry no
    half-precision rounding (this keeps an fp32 copy of the head during the call).
    """
    if weight.device.type == "cuda" or weight.dtype == acc:
        return weight
    return weight.to(acc)


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, out: torch.Tensor | None = None):
    """a @ b with an ``acc``-dtype result: fp32 output of half-precision CUDA matmuls."""
    if a.dtype == acc:
        return torch.mm(a, b, out=out)
    if out is not None:
        try:
            return torch.mm(a, b, out_dtype=acc, out=out)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    try:
        result = torch.mm(a, b, out_dtype=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        result = torch.mm(a, b).to(acc)  # older torch: one rounding of the product
    if out is None:
        return result
    return out.copy_(result)


def _chunk_logits(hidden_chunk, weight_mm, bias, acc, out):
    """Raw logits h·Wᵀ (+ b) of one chunk into ``out`` [C, V] (accumulation dtype)."""
    _mm(hidden_chunk.to(weight_mm.dtype), weight_mm.t(), acc, out=out)
    if bias is not None:
        out += bias.to(acc)
    return out


def linear_logprobs_forward(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    ignore_index,
    want_entropy,
    impl,
    cache: LogitsCache | None = None,
):
    """Chunked forward. Returns (logprobs [T], entropy [T] or None, logsumexp [T]), fp32.

    The arguments are those of :func:`linear_logprobs_fwd_op`, in its order, then ``cache``.
    ``impl`` is a resolved implementation name; the logsumexp is of the tempered logits.
    Logits blocks that fit in ``cache`` are kept there for :func:`linear_logprobs_backward`.
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden.dtype)
    weight_mm = _matmul_weight(weight, acc)
    if impl == "native":
        return tiled_forward(
            hidden,
            weight_mm,
            labels,
            bias,
            temperature,
            ignore_index,
            want_entropy,
            _CHUNK_BYTES,
            cache,
        )
    rows = row_backend(impl)
    logprobs = hidden.new_empty(num_tokens, dtype=acc)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    lse = torch.empty_like(logprobs)
    chunk = _chunk_size(num_tokens, vocab, torch.finfo(acc).bits // 8)
    block = None
    for start in range(0, num_tokens, chunk):
        sl = slice(start, min(start + chunk, num_tokens))
        out = None if cache is None else cache.new_block(start, sl.stop - start, vocab, hidden, acc)
        if out is None:
            if block is None:
                block = hidden.new_empty(chunk, vocab, dtype=acc)
            out = block[: sl.stop - start]
        logits = _chunk_logits(hidden[sl], weight_mm, bias, acc, out)
        rows.forward(
            logits,
            labels[sl],
            1.0 / temperature,
            ignore_index,
            logprobs[sl],
            None if entropy is None else entropy[sl],
            lse[sl],
        )
    return logprobs, entropy, lse


def linear_logprobs_backward(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    impl,
    needs_grad,
    cache: LogitsCache | None = None,
):
    """Chunked backward: each chunk's logits (taken out of ``cache`` when the forward kept
    them, else recomputed) are overwritten with their gradient (row epilogue), then
    grad_hidden = G·W and grad_weight += Gᵀ·h in the accumulation dtype.

    The arguments are :func:`linear_logprobs_bwd_op`'s, then ``cache``; ``needs_grad`` =
    (hidden, weight, bias) flags; gradients not needed are returned as None.
    """
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden.dtype)
    weight_mm = _matmul_weight(weight, acc)
    grad_logprobs = grad_logprobs.to(acc).contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(acc).contiguous()
    if impl == "native":
        grads = tiled_backward(
            grad_logprobs,
            grad_entropy,
            hidden,
            weight_mm,
            labels,
            bias,
            temperature,
            ignore_index,
            lse,
            entropy,
            needs_grad,
            _CHUNK_BYTES,
            cache,
        )
        return tuple(
            None if g is None else g.to(like.dtype)
            for g, like in zip(grads, (hidden, weight, bias))
        )
    rows = row_backend(impl)
    need_hidden, need_weight, need_bias = needs_grad
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    )
    grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_bias else None
    chunk = _chunk_size(num_tokens, vocab, torch.finfo(acc).bits // 8)
    block = None
    for start in range(0, num_tokens, chunk):
        sl = slice(start, min(start + chunk, num_tokens))
        hidden_chunk = hidden[sl]
        grad_z = None if cache is None else cache.pop(start)
        if grad_z is None:
            if block is None:
                block = hidden.new_empty(chunk, vocab, dtype=acc)
            grad_z = _chunk_logits(hidden_chunk, weight_mm, bias, acc, block[: sl.stop - start])
        rows.backward_(
            grad_z,
            labels[sl],
            lse[sl],
            None if entropy is None else entropy[sl],
            grad_logprobs[sl],
            None if grad_entropy is None else grad_entropy[sl],
            1.0 / temperature,
            ignore_index,
        )
        push_chunk_gradient(
            grad_z, hidden_chunk, weight_mm, acc, sl, grad_hidden, grad_weight, grad_bias
        )
        del grad_z  # a kept block is freed here
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def push_chunk_gradient(
    grad_z, hidden_chunk, weight_mm, acc, sl, grad_hidden, grad_weight, grad_bias
) -> None:
    """Chain one chunk's logit gradient G [C, V] through the LM head: grad_hidden[sl] = G·W,
    grad_weight += Gᵀ·h (accumulated in ``acc``), grad_bias += Σ_c G. None targets are skipped."""
    grad_lowp = grad_z if weight_mm.dtype == acc else grad_z.to(weight_mm.dtype)
    if grad_hidden is not None:
        if grad_hidden.dtype == acc:
            torch.mm(grad_lowp, weight_mm, out=grad_hidden[sl])
        else:
            grad_hidden[sl] = _mm(grad_lowp, weight_mm, acc)
    if grad_weight is not None:
        _accumulate(grad_weight, grad_lowp.t(), hidden_chunk.to(weight_mm.dtype))
    if grad_bias is not None:
        grad_bias += grad_z.sum(0)


def _accumulate(acc_tensor: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc_tensor += a @ b, accumulating in acc_tensor's dtype (fp32 for half inputs)."""
    if a.dtype == acc_tensor.dtype:
        acc_tensor.addmm_(a, b)
        return
    try:  # one GEMM with an fp32 C operand (beta = 1): no [V, H] temporary
        torch.addmm(acc_tensor, a, b, out_dtype=acc_tensor.dtype, out=acc_tensor)
    except (TypeError, RuntimeError, NotImplementedError):
        acc_tensor += _mm(a, b, acc_tensor.dtype)


# --- The op, registered once: each half is a torch.library custom op whose body is its
# launcher above, opaque to torch.compile (fake implementations for tracing) and
# differentiable through register_autograd. Optional outputs that are absent are empty [0]
# tensors (custom ops cannot return None). Eager calls run the same launchers through the
# same autograd glue (_setup_context, _backward_grads) in _EagerLinearLogprobs, which only
# adds the logits cache: a custom op's first call imports torch's compiler stack.


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32)


def _dense(outputs, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``outputs`` with each None replaced by an empty [0] float32 tensor on ``like``'s device."""
    return tuple(_empty(like) if t is None else t for t in outputs)


@torch.library.custom_op("areal_fast::linear_logprobs_fwd", mutates_args=())
def linear_logprobs_fwd_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    want_entropy: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [T], entropy [T] or [0], logsumexp [T]): :func:`linear_logprobs_forward`."""
    outputs = linear_logprobs_forward(
        hidden, weight, labels, bias, temperature, ignore_index, want_entropy, impl
    )
    return _dense(outputs, hidden)


@linear_logprobs_fwd_op.register_fake
def _(hidden, weight, labels, bias, temperature, ignore_index, want_entropy, impl):
    acc = _acc_dtype(hidden.dtype)
    num_tokens = hidden.shape[0]
    return (
        hidden.new_empty(num_tokens, dtype=acc),
        hidden.new_empty(num_tokens if want_entropy else 0, dtype=acc),
        hidden.new_empty(num_tokens, dtype=acc),
    )


@torch.library.custom_op("areal_fast::linear_logprobs_bwd", mutates_args=())
def linear_logprobs_bwd_op(
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    impl: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias), each [0] when not needed:
    :func:`linear_logprobs_backward`."""
    grads = linear_logprobs_backward(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        bias,
        lse,
        entropy,
        temperature,
        ignore_index,
        impl,
        needs_grad,
    )
    return _dense(grads, hidden)


@linear_logprobs_bwd_op.register_fake
def _(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    impl,
    needs_grad,
):
    shapes = (hidden, weight, bias)
    return tuple(
        like.new_empty(like.shape) if need and like is not None else _empty(hidden)
        for like, need in zip(shapes, needs_grad)
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, temperature, ignore_index, want_entropy, impl = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy)
    ctx.settings = (temperature, ignore_index, want_entropy, impl)
    ctx.mark_non_differentiable(lse)


def _backward_grads(ctx, grad_logprobs, grad_entropy, launch):
    """The backward of both entry points; ``launch`` takes the arguments of
    :func:`linear_logprobs_bwd_op` and returns (grad_hidden, grad_weight, grad_bias)."""
    hidden, weight, labels, bias, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, want_entropy, impl = ctx.settings
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if not want_entropy:
        grad_entropy, entropy = None, None
    needs = [
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        bias is not None and ctx.needs_input_grad[3],
    ]
    grads = launch(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        bias,
        lse,
        entropy,
        temperature,
        ignore_index,
        impl,
        needs,
    )
    grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in zip(grads, needs))
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None


def _backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
    return _backward_grads(ctx, grad_logprobs, grad_entropy, linear_logprobs_bwd_op)


linear_logprobs_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerLinearLogprobs(torch.autograd.Function):
    """:func:`linear_logprobs_fwd_op` for eager calls, without the custom-op dispatcher (which
    imports torch's compiler stack on first use: about 1.5 s and 150 MB that eager callers
    need not pay). ``apply(*op_args, cache_bytes)``: the op's arguments, then the bytes of
    logits the forward may keep for the backward (on ``ctx``, outside the saved tensors, so
    each kept block is freed as soon as the backward has used it)."""

    @staticmethod
    def forward(ctx, *args):
        *inputs, cache_bytes = args
        cache = new_cache(cache_bytes)
        outputs = _dense(linear_logprobs_forward(*inputs, cache), inputs[0])
        _setup_context(ctx, inputs, outputs)
        ctx.logits_cache = cache if cache is not None and len(cache) else None
        return outputs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        cache, ctx.logits_cache = ctx.logits_cache, None  # a second backward recomputes
        launch = functools.partial(linear_logprobs_backward, cache=cache)
        return _backward_grads(ctx, grad_logprobs, grad_entropy, launch) + (None,)


def _apply(*args):
    """The custom op under torch.compile, the autograd.Function otherwise (which keeps
    logits for the backward within :func:`_cache_bytes`)."""
    if torch.compiler.is_compiling():
        return linear_logprobs_fwd_op(*args)
    return _EagerLinearLogprobs.apply(*args, _cache_bytes(args[0], args[1], args[3]))


def _cache_bytes(hidden, weight, bias) -> int:
    """The logits budget of one eager call: 0 unless a backward can follow (the variable is
    checked either way)."""
    budget = cache_budget_bytes(hidden.device)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    return budget if wants_grad else 0


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _validate(hidden, weight, labels, bias, temperature, ignore_index, validate):
    """Shape/dtype/device checks (ValueError naming the tensor); label range when validate."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"hidden must be float32/bfloat16/float16 (or float64), got {hidden.dtype}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"bias must be [V={weight.shape[0]}] {hidden.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    for name, tensor in (("weight", weight), ("labels", labels), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if validate and labels.numel():
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(
                f"labels hold values outside [0, V={weight.shape[0]}) other than "
                f"ignore_index = {ignore_index}"
            )


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    bias: torch.Tensor | None = None,
    impl: str | None = None,
    validate: bool | None = None,
):
    """Log-prob of each label (and optionally the entropy) under a linear LM head.

    logprobs[t] = log_softmax((hidden[t] · weightᵀ + bias) / temperature)[labels[t]];
    entropy[t] = −Σ_v p_v log p_v of that same tempered distribution. The [T, V] logits are
    never materialised at once: tokens go through in chunks and the fp32 logits are formed
    one block at a time, [chunk, V] with max(256 rows, 64 MiB) on the torch and Triton paths,
    [≤ 4096 tokens, vocabulary tile] within 64 MiB on the native CPU path. The backward
    needs every block again and overwrites it with its gradient: when a backward can follow
    (grad mode on, an input requiring grad, not under ``torch.compile``) the forward keeps
    blocks for it while they fit in ``$AREAL_FAST_LOGITS_CACHE_MB`` MiB (default 2048 on the
    CPU, 0 on other devices) and the backward recomputes only the others, freeing each kept
    block once used. This trades memory for time: each kept block saves one of the four
    [chunk, H] × [H, V]-sized matmuls of forward + backward. Extra memory is O(T + block),
    plus the kept blocks (≤ the budget, between forward and backward), on the CPU for
    bf16/fp16 inputs an fp32 copy of the LM head, and the fp32 weight gradient in the
    backward. Positions labelled ``ignore_index`` are left out of the matmuls altogether on
    the CPU.

    Parameters
    ----------
    hidden : Tensor [T, H], float32 | bfloat16 | float16 (float64 accepted for reference checks)
        Final hidden states of the packed tokens.
    weight : Tensor [V, H], same dtype and device as ``hidden``
        LM-head (output embedding) weight.
    labels : Tensor [T], int64
        Token whose log-prob is wanted at each position; ``ignore_index`` marks positions
        that give logprob 0 and entropy 0 and receive zero gradient.
    temperature : float, > 0
        Sampling temperature the log-probs are taken at (applied to log-probs and entropy).
    return_entropy : bool
        Also return the entropy (computed in the same pass; skipped otherwise).
    ignore_index : int
        Label value to skip (default -100, as in ``torch.nn.functional.cross_entropy``).
    bias : Tensor [V], optional
        LM-head bias.
    impl : {"auto", "torch", "native", "triton"}, optional
        Force an implementation (default: ``$AREAL_FAST_IMPL``, else the fastest available:
        Triton on CUDA, the C++ row kernels on the CPU, torch otherwise). float64 inputs
        always take the torch implementation.
    validate : bool, optional
        Check that labels lie in [0, V) or equal ``ignore_index``. Default: on for CPU
        tensors, off on GPUs, where the check costs a device-to-host synchronisation.

    Returns
    -------
    Tensor [T] float32, or (Tensor [T] float32, Tensor [T] float32)
        ``logprobs`` (nats), or ``(logprobs, entropy)`` when ``return_entropy`` (float64 for
        float64 inputs). Both are differentiable w.r.t. ``hidden``, ``weight`` and ``bias``;
        the weight and bias gradients accumulate in fp32 across chunks. Under
        ``torch.no_grad()`` this is the fast path for old/prox/ref log-probs.

    Raises
    ------
    ValueError
        On a shape, dtype, device or (with ``validate``) label-range mismatch, naming the
        offending tensor; an unknown or unavailable ``impl``; ``AREAL_FAST_LOGITS_CACHE_MB``
        set to anything but a number ≥ 0.

    Notes
    -----
    With z the tempered logits and p = softmax(z): d logp_y/dz = onehot(y) − p and
    dH/dz = −p ⊙ (log p + H) (softmax calculus; the quantities of
    ``torch.nn.functional.cross_entropy(reduction='none')``, negated). The label entry
    1 − p_y is formed as Σ_{v≠y} p_v, accurate for confident rows.
    """
    if validate is None:
        validate = hidden.device.type == "cpu" and not torch.compiler.is_compiling()
    _validate(hidden, weight, labels, bias, temperature, ignore_index, validate)
    labels = labels.contiguous()  # the kernels index labels by row
    chosen = _choose_impl(impl, hidden)
    if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
        kept = (labels != ignore_index).nonzero().squeeze(1)
        if kept.numel() < labels.numel():
            return _on_kept_tokens(
                hidden,
                weight,
                labels,
                bias,
                kept,
                temperature,
                return_entropy,
                ignore_index,
                chosen,
            )
    outputs = _apply(
        hidden,
        weight,
        labels,
        bias,
        float(temperature),
        int(ignore_index),
        bool(return_entropy),
        chosen,
    )
    return (outputs[0], outputs[1]) if return_entropy else outputs[0]


def _choose_impl(impl: str | None, hidden: torch.Tensor) -> str:
    """Resolved implementation; float64 inputs always take torch (after checking ``impl``)."""
    if hidden.dtype == torch.float64:
        requested_impl(impl)
        return "torch"
    return resolve_impl(impl, hidden.device, _NATIVE_SYMBOL)


def _on_kept_tokens(
    hidden, weight, labels, bias, kept, temperature, return_entropy, ignore_index, impl
):
    """Run on the non-ignored tokens only and scatter back (zeros elsewhere)."""
    outputs = _apply(
        hidden.index_select(0, kept),
        weight,
        labels.index_select(0, kept),
        bias,
        float(temperature),
        int(ignore_index),
        bool(return_entropy),
        impl,
    )
    num_tokens = labels.shape[0]

    def scatter(values):
        return values.new_zeros(num_tokens).index_copy(0, kept, values)

    if return_entropy:
        return scatter(outputs[0]), scatter(outputs[1])
    return scatter(outputs[0])
