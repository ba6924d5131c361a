"""Backends of the packed causal attention, and the choice between them.

Three kernels compute causal attention over sequences packed along one token dimension:

- ``"flash_attn"``: ``flash_attn.flash_attn_varlen_func`` (the flash-attn package, when it
  imports): one launch for the whole batch; CUDA, float16/bfloat16, compute capability >= 8.0,
  head dim a multiple of 8 up to 256; attention dropout supported.
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, same flash kernel
  inside torch): one launch; the same device, dtype and head-dim limits; no dropout. Its
  keywords differ between torch versions, so they are read from its signature: causality is
  ``window_size=(-1, 0)`` where that keyword exists, else ``is_causal=True``; where ``scale``
  is missing the query is pre-scaled; where ``enable_gqa`` is missing the key/value heads are
  repeated to the query's.
- ``"sdpa"``: ``scaled_dot_product_attention`` once per sequence (every device and dtype;
  needs the boundaries on the host).

The environment variable ``AREAL_FAST_ATTN`` picks one of ``"auto"`` (the default),
``"flash_attn"``, ``"varlen"`` or ``"sdpa"``. Auto takes flash_attn, then varlen, then sdpa,
the first that can run on the tensors at hand (CPU tensors always get sdpa). A forced backend
that cannot run raises instead of falling back, so forcing one really exercises it.

The varlen runners take tensors in the [T, H, D] layout of both kernels and never read
sequence lengths back from the device: the longest sequence (``max_seqlen``) comes from the
caller, computed on the host when the batch was packed.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch

ATTN_ENV = "AREAL_FAST_ATTN"
BACKENDS = ("auto", "flash_attn", "varlen", "sdpa")
VARLEN_BACKENDS = ("flash_attn", "varlen")  # auto's order of preference
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def requested_backend() -> str:
    """The backend asked for by ``$AREAL_FAST_ATTN`` (lower-cased; unset or empty: "auto").

    Raises
    ------
    ValueError
        The variable holds a value that is not one of :data:`BACKENDS`.
    """
    wanted = os.environ.get(ATTN_ENV, "").strip().lower() or "auto"
    if wanted not in BACKENDS:
        raise ValueError(f"{ATTN_ENV} = {wanted!r} is not one of {BACKENDS}")
    return wanted


@functools.lru_cache(maxsize=None)
def load_flash_attn():
    """``flash_attn.flash_attn_varlen_func``, or None when flash-attn does not import."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # installed but broken (e.g. built against another torch)
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def load_torch_varlen():
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch lacks it (< 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def keywords_of(fn) -> frozenset:
    """Names of the parameters of ``fn`` (empty when its signature cannot be read)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def cuda_capability_ok(index: int | None) -> bool:
    """True when CUDA device ``index`` (None: the current one) has compute capability >= 8.0,
    which the flash kernels of flash-attn 2 and of torch need."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def unavailable_reason(
    backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, dropout: float
) -> str | None:
    """Why ``backend`` cannot run on these tensors here, or None when it can.

    Parameters
    ----------
    backend : str
        "flash_attn", "varlen" or "sdpa".
    device, dtype : the device and dtype of query, key and value
    head_dim : int
        D, the last dimension of query/key/value.
    dropout : float
        The attention dropout that will be applied (0 outside training).
    """
    if backend == "sdpa":
        return None
    if backend == "flash_attn":
        if load_flash_attn() is None:
            return "the flash_attn package does not import"
    else:
        fn = load_torch_varlen()
        if fn is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
        if not keywords_of(fn) & {"window_size", "is_causal"}:
            return "torch's varlen_attn takes neither window_size nor is_causal (not causal)"
        if dropout > 0:
            return f"torch's varlen_attn has no attention dropout (dropout = {dropout})"
    if device.type != "cuda":
        return f"it runs on CUDA only, the tensors are on {device}"
    if dtype not in _HALF_DTYPES:
        return f"it needs float16 or bfloat16 tensors, got {dtype}"
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return f"it needs a head dim that is a multiple of 8, at most {_MAX_HEAD_DIM}: {head_dim}"
    if not cuda_capability_ok(device.index):
        return "it needs a GPU of compute capability 8.0 or newer"
    return None


def choose_backend(device: torch.device, dtype: torch.dtype, head_dim: int, dropout: float) -> str:
    """The backend to run: the one ``$AREAL_FAST_ATTN`` forces, else the first of flash_attn,
    varlen, sdpa that can run (see :func:`unavailable_reason`; CPU tensors: always sdpa).

    Raises
    ------
    ValueError
        A forced backend that cannot run on these tensors here (with the reason), or a bad
        value of the environment variable.
    """
    wanted = requested_backend()
    if wanted == "sdpa":
        return "sdpa"
    if wanted == "auto":
        if device.type != "cuda":
            return "sdpa"
        for backend in VARLEN_BACKENDS:
            if unavailable_reason(backend, device, dtype, head_dim, dropout) is None:
                return backend
        return "sdpa"
    reason = unavailable_reason(wanted, device, dtype, head_dim, dropout)
    if reason is not None:
        raise ValueError(f"{ATTN_ENV}={wanted} cannot run: {reason}")
    return wanted


def flash_attn_packed(query, key, value, cu_seqlens, max_seqlen, scale, dropout):
    """Causal attention of packed sequences through flash-attn's ``flash_attn_varlen_func``.

    Parameters
    ----------
    query : Tensor [T, H, D]
    key, value : Tensor [T, H_kv, D], H divisible by H_kv (the kernel shares key/value heads)
    cu_seqlens : Tensor [B+1] int32, on the tensors' device
    max_seqlen : int
        Length of the longest sequence (from the host; never read from the device).
    scale : float or None
        Softmax scale (None: 1/sqrt(D)).
    dropout : float
        Attention dropout probability.

    Returns
    -------
    Tensor [T, H, D], dtype of ``query``.
    """
    fn = load_flash_attn()
    return fn(
        query,
        key,
        value,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )


def torch_varlen_packed(query, key, value, cu_seqlens, max_seqlen, scale):
    """Causal attention of packed sequences through torch's ``varlen_attn``.

    The keywords this torch's ``varlen_attn`` lacks are made up for: causality through
    ``window_size=(-1, 0)`` (torch >= 2.11) or ``is_causal=True`` (older); without ``scale``
    the query is multiplied by ``scale·sqrt(D)``; without ``enable_gqa`` key and value heads
    are repeated (query head h reads key/value head h // (H / H_kv), as in SDPA's
    ``enable_gqa``).

    Parameters
    ----------
    query : Tensor [T, H, D]
    key, value : Tensor [T, H_kv, D], H divisible by H_kv
    cu_seqlens : Tensor [B+1] int32, on the tensors' device
    max_seqlen : int
        Length of the longest sequence (from the host; never read from the device).
    scale : float or None
        Softmax scale (None: 1/sqrt(D)).

    Returns
    -------
    Tensor [T, H, D], dtype of ``query``.
    """
    fn = load_torch_varlen()
    names = keywords_of(fn)
    kwargs = {}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0)  # a tuple: varlen_attn compares it to (-1, 0)
    else:
        kwargs["is_causal"] = True
    if scale is not None:
        if "scale" in names:
            kwargs["scale"] = scale
        else:
            query = query * (scale * query.shape[-1] ** 0.5)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            key, value = (_repeat_heads(t, groups) for t in (key, value))
    return fn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, H_kv, D] -> [T, H_kv·groups, D], each head repeated ``groups`` times in a row."""
    tokens, heads, dim = t.shape
    return t[:, :, None].expand(tokens, heads, groups, dim).reshape(tokens, heads * groups, dim)
