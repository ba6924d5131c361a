"""Which implementation an op runs: the ``impl`` argument, ``AREAL_FAST_IMPL``, the device."""

import pytest
import torch

from areal_fast.ops import _dispatch
from areal_fast.ops._dispatch import IMPL_ENV, requested_impl, resolve_impl

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def available(monkeypatch):
    """Set what this machine has: (triton importable, native symbol present)."""
    monkeypatch.delenv(IMPL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def set_(triton: bool, native: bool) -> None:
        monkeypatch.setattr(_dispatch, "triton_available", lambda: triton)
        monkeypatch.setattr(_dispatch, "native_has", lambda symbol: native)

    return set_


def test_argument_then_environment_then_auto(monkeypatch):
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert requested_impl(None) == "auto"
    monkeypatch.setenv(IMPL_ENV, " Torch ")
    assert requested_impl(None) == "torch"
    assert requested_impl("native") == "native"  # the argument wins
    monkeypatch.setenv(IMPL_ENV, "fast")
    with pytest.raises(ValueError, match=r"^AREAL_FAST_IMPL = 'fast' is not one of"):
        requested_impl(None)
    with pytest.raises(ValueError, match=r"^impl = 'cuda' is not one of"):
        requested_impl("cuda")


@pytest.mark.parametrize(
    "triton,native,device,expected",
    [
        (True, True, CUDA, "triton"),
        (False, True, CUDA, "torch"),
        (True, True, CPU, "native"),
        (True, False, CPU, "torch"),
    ],
)
def test_auto_picks_the_fastest_available(available, triton, native, device, expected):
    available(triton, native)
    assert resolve_impl(None, device, "rows_forward") == expected


def test_forced_implementations_that_cannot_run_say_why(available, monkeypatch):
    available(False, False)
    assert resolve_impl("torch", CUDA, "x") == "torch"
    with pytest.raises(ValueError, match="runs on the CPU only, tensors are on cuda:0"):
        resolve_impl("native", CUDA, "x")
    with pytest.raises(ValueError, match="needs areal_fast._C with rows_forward"):
        resolve_impl("native", CPU, "rows_forward")
    with pytest.raises(ValueError, match="needs the triton package"):
        resolve_impl("triton", CUDA, "x")
    available(True, True)
    assert resolve_impl("native", CPU, "x") == "native"
    with pytest.raises(ValueError, match="on cpu needs TRITON_INTERPRET=1"):
        resolve_impl("triton", CPU, "x")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", CPU, "x") == "triton"
