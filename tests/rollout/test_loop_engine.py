"""LoopEngine (the request-level skeleton of the vLLM and server engines) on a fake asyncio
engine: queueing, continuous batching, both pause modes, weight versions, engine death."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_fast.rollout.engine import GenOutput, GenRequest
from areal_fast.rollout.loop_engine import EngineError, LoopEngine, spans_to_versions


class FakeEngine(LoopEngine):
    """One token per ``step_s`` per request; the token is the version it was made under."""

    def __init__(self, max_running=2, pause_mode="abort", step_s=0.01):
        super().__init__("fake engine", max_running, pause_mode, call_timeout=5.0)
        self.step_s, self.stepping, self.aborting = step_s, None, False
        self.entered: list[int] = []
        self.dead = None
        self.salts: list[str] = []

    async def _engine_open(self):
        self.stepping = asyncio.Event()
        self.stepping.set()

    async def _engine_generate(self, request, salt):
        self.entered.append(request.rid)
        self.salts.append(salt)
        tokens = []
        while len(tokens) < request.max_new_tokens:
            await self.stepping.wait()
            if self.aborting:
                return GenOutput(request.rid, tokens, [0.0] * len(tokens), list(tokens), "abort")
            await asyncio.sleep(self.step_s)
            tokens.append(self.version)
        return GenOutput(request.rid, tokens, [0.0] * len(tokens), list(tokens), "length")

    async def _engine_pause(self, keep):
        self.aborting = not keep
        self.stepping.clear()
        if not keep:
            self.stepping.set()  # let the running requests see the abort

    async def _engine_resume(self):
        self.aborting = False
        self.stepping.set()

    async def _engine_load_buffer(self, spec, version):
        pass

    async def _engine_close(self):
        pass

    def _engine_dead(self):
        return self.dead


def _collect(engine, n, timeout=10.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} of {n} outputs"
        out += engine.get_outputs(0.2)
    return {o.rid: o for o in out}


def _requests(rids, budget=5):
    return [GenRequest(r, [1, 2, 3], budget) for r in rids]


def test_at_most_max_running_inside_and_front_goes_first():
    engine = FakeEngine(max_running=2)
    engine.start()
    try:
        engine.submit(_requests(range(4)))
        engine.submit(_requests([10]), front=True)
        outs = _collect(engine, 5)
        assert set(outs) == {0, 1, 2, 3, 10}
        assert engine.entered[:2] == [0, 1] and engine.entered[2] == 10
        assert all(len(o.output_ids) == 5 and o.stop_reason == "length" for o in outs.values())
    finally:
        engine.close()


def test_abort_pause_returns_partials_and_keeps_the_queue():
    engine = FakeEngine(max_running=2, step_s=0.02)
    engine.start()
    try:
        engine.submit(_requests(range(5), budget=50))
        time.sleep(0.2)
        engine.pause(5.0)
        aborted = _collect(engine, 2)
        assert set(aborted) == {0, 1}
        assert all(
            o.stop_reason == "abort" and 0 < len(o.output_ids) < 50 for o in aborted.values()
        )
        assert engine.drop_queued() == 3
        engine.update_weights_from_buffer(None, 7)
        engine.resume()
        engine.submit(_requests([20], budget=3))
        after = _collect(engine, 1)
        assert after[20].versions == [7, 7, 7]
        assert engine.salts[-1] == "v7"  # the prefix cache is salted by the version
    finally:
        engine.close()


def test_keep_pause_continues_requests_under_the_new_version():
    engine = FakeEngine(max_running=2, pause_mode="keep", step_s=0.02)
    engine.start()
    try:
        engine.submit(_requests([0, 1], budget=30))
        time.sleep(0.2)
        engine.pause(5.0)
        assert engine.get_outputs(0.2) == []  # nothing came back: frozen inside
        engine.update_weights_from_buffer(None, 1)
        engine.resume()
        outs = _collect(engine, 2)
        for o in outs.values():
            seam = o.versions.index(1)
            assert 0 < seam < 30 and o.versions == [0] * seam + [1] * (30 - seam)
    finally:
        engine.close()


def test_updates_need_a_pause_and_bad_requests_are_named():
    engine = FakeEngine()
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="needs pause"):
            engine.update_weights_from_buffer(None, 1)
        with pytest.raises(ValueError, match=r"requests\[1\].max_new_tokens"):
            engine.submit([GenRequest(0, [1], 4), GenRequest(1, [1], 0)])
    finally:
        engine.close()


def test_a_dead_engine_fails_waiting_calls_at_once():
    engine = FakeEngine(max_running=1, pause_mode="keep", step_s=0.05)
    engine.start()
    try:
        engine.submit(_requests([0], budget=1000))
        time.sleep(0.2)
        engine.dead = "its process exited with code -9"
        start = time.monotonic()
        with pytest.raises(EngineError, match="fake engine: its process exited"):
            while True:
                engine.get_outputs(0.5)
        assert time.monotonic() - start < 3.0
        with pytest.raises(EngineError, match="its process exited"):
            engine.pause(60.0)
        assert EngineError.restartable
    finally:
        engine.close()


def test_spans_to_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5, 9) == [3, 3, 4, 4, 4]
    assert spans_to_versions(None, 3, 9) == [9, 9, 9]
    with pytest.raises(ValueError, match="'x' is not an integer"):
        spans_to_versions([{"version": "x", "start": 0, "end": 1}], 1, 0)
