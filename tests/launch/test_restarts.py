"""Trainer-fault restarts (launch/restarts.py): which failure restarts the job, how often, and
what the run directory says when it ends."""

from __future__ import annotations

import pytest

from areal_fast.launch.config import ExperimentConfig
from areal_fast.launch.restarts import Attempt, trainer_fault, with_trainer_restarts
from areal_fast.launch.run_context import RunContext
from areal_fast.wire.handles import WorkerError


def _run(tmp_path, resume=False, max_restarts=2) -> RunContext:
    cfg = ExperimentConfig()
    cfg.resume = resume
    cfg.recovery.max_trainer_restarts = max_restarts
    return RunContext(cfg, show_progress=False, run_dir=tmp_path)


def _failing(errors: list[BaseException], seen: list[Attempt]):
    """An attempt that raises the next of ``errors`` and, once none is left, returns."""

    def attempt(current: Attempt) -> dict:
        seen.append(current)
        if errors:
            raise errors.pop(0)
        return {"attempts": len(seen)}

    return attempt


def test_trainer_fault_names_the_trainer_ranks():
    assert trainer_fault(WorkerError("x", "trainer"))
    assert trainer_fault(WorkerError("x", "trainer-1", died=True))
    assert not trainer_fault(WorkerError("x", "rollout-0", died=True))
    assert not trainer_fault(WorkerError("x"))


def test_each_trainer_fault_resumes_until_one_attempt_returns(tmp_path):
    seen: list[Attempt] = []
    errors = [WorkerError("step late", "trainer"), WorkerError("died", "trainer-1", True)]
    summary = with_trainer_restarts(_run(tmp_path), _failing(errors, seen))
    assert summary == {"attempts": 3}
    assert seen == [Attempt(False, 0), Attempt(True, 1), Attempt(True, 2)]
    assert not (tmp_path / "FAILED").exists()


def test_resume_true_resumes_the_first_attempt(tmp_path):
    seen: list[Attempt] = []
    with_trainer_restarts(_run(tmp_path, resume=True), _failing([], seen))
    assert seen == [Attempt(True, 0)]


def test_no_restart_left_names_the_key_and_writes_failed(tmp_path):
    seen: list[Attempt] = []
    errors = [WorkerError(f"trainer fault {i}\ndetail", "trainer") for i in range(3)]
    with pytest.raises(WorkerError) as info:
        with_trainer_restarts(_run(tmp_path, max_restarts=1), _failing(errors, seen))
    assert len(seen) == 2
    assert str(info.value) == (
        "trainer fault 1 (no trainer restart left: recovery.max_trainer_restarts = 1)"
    )
    assert info.value.worker == "trainer"
    assert (tmp_path / "FAILED").read_text() == f"WorkerError: {info.value}\n"


def test_a_rollout_fault_is_not_restarted(tmp_path):
    seen: list[Attempt] = []
    error = WorkerError("rollout worker 'rollout-0' died", "rollout-0", died=True)
    with pytest.raises(WorkerError) as info:
        with_trainer_restarts(_run(tmp_path), _failing([error], seen))
    assert info.value is error and len(seen) == 1
    assert (tmp_path / "FAILED").read_text() == "WorkerError: rollout worker 'rollout-0' died\n"


def test_other_errors_write_failed_but_an_interrupt_does_not(tmp_path):
    with pytest.raises(ValueError):
        with_trainer_restarts(_run(tmp_path), _failing([ValueError("bad value")], []))
    assert (tmp_path / "FAILED").read_text() == "ValueError: bad value\n"
    (tmp_path / "FAILED").unlink()
    with pytest.raises(KeyboardInterrupt):
        with_trainer_restarts(_run(tmp_path), _failing([KeyboardInterrupt()], []))
    assert not (tmp_path / "FAILED").exists()
