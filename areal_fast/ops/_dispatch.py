"""Choice of implementation for the ops that have several (torch, native C++, Triton).

``impl`` arguments and the ``AREAL_FAST_IMPL`` environment variable take one of
``"auto"`` (the default: the fastest available for the tensor's device), ``"torch"`` (the
chunked torch implementation, every device), ``"native"`` (the C++ kernels of
``areal_fast._C``; CPU) or ``"triton"`` (the Triton kernels of ``areal_fast.kernels``; CUDA,
or the CPU under ``TRITON_INTERPRET=1``, which is how the tests run them). An explicit
argument wins over the environment variable. A forced implementation that cannot run raises
instead of silently falling back, so a test that forces one really exercises it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from areal_fast._native import load_native

IMPL_ENV = "AREAL_FAST_IMPL"
IMPLS = ("auto", "torch", "native", "triton")


def requested_impl(impl: str | None) -> str:
    """The implementation asked for: ``impl`` if given, else ``$AREAL_FAST_IMPL``, else auto.

    Raises
    ------
    ValueError
        ``impl`` (or the environment variable, named in the message) is not one of IMPLS.
    """
    source = "impl"
    if impl is None:
        impl, source = os.environ.get(IMPL_ENV, "").strip().lower() or "auto", IMPL_ENV
    if impl not in IMPLS:
        raise ValueError(f"{source} = {impl!r} is not one of {IMPLS}")
    return impl


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton is importable (it still needs a GPU or ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def native_has(symbol: str) -> bool:
    """True when the compiled extension is loaded and exports ``symbol``."""
    native = load_native()
    return native is not None and hasattr(native, symbol)


def resolve_impl(impl: str | None, device: torch.device, native_symbol: str) -> str:
    """The implementation to run on ``device``: "torch", "native" or "triton".

    Auto picks Triton on CUDA (when importable), the native kernels on the CPU (when the
    extension exports ``native_symbol``), and the torch implementation otherwise.

    Raises
    ------
    ValueError
        A forced implementation that cannot run on ``device`` here (with the reason).
    """
    wanted = requested_impl(impl)
    on_cuda = device.type == "cuda"
    if wanted == "auto":
        if on_cuda and triton_available():
            return "triton"
        if device.type == "cpu" and native_has(native_symbol):
            return "native"
        return "torch"
    if wanted == "native":
        if device.type != "cpu":
            raise ValueError(f"impl='native' runs on the CPU only, tensors are on {device}")
        if not native_has(native_symbol):
            raise ValueError(
                f"impl='native' needs areal_fast._C with {native_symbol} "
                f"(extension missing, disabled or too old)"
            )
    if wanted == "triton":
        if not triton_available():
            raise ValueError("impl='triton' needs the triton package")
        if not on_cuda and not triton_interpreted():
            raise ValueError(f"impl='triton' on {device} needs TRITON_INTERPRET=1")
    return wanted
