"""``signals_held``: a SIGINT or SIGTERM inside the block acts at its end, as the handlers
in place before it would have; none is lost, none acts twice."""

from __future__ import annotations

import os
import signal

import pytest

from areal_fast._signals import signals_held


def test_sigint_in_the_block_raises_at_its_end():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("after the signal")  # the block goes on
        steps.append("after the block")  # not reached
    assert steps == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_goes_to_the_handler_in_place_once():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == []
        assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the handler is back
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_block_that_raises_drops_the_signal():
    with pytest.raises(ValueError, match="failing"):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("failing")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nothing_held_without_a_signal():
    with signals_held():
        value = 1 + 1
    assert value == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
