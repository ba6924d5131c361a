"""TensorBoard and wandb sinks end to end on the tiny model (an in-process ``areal-fast train``
of 2 steps), read back with TensorBoard's event reader and from the wandb offline run's
records; resume and failure of the sinks themselves; the one-line errors for a missing
package or a wandb run that cannot start."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from linked_job import tiny_job_args  # noqa: E402 - beside this file

from areal_fast.cli import main
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.log_sinks import split_record

REPO = Path(__file__).resolve().parents[2]
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # must never reach a file


def _args(model_dir, root, *extra):
    return tiny_job_args(
        model_dir,
        root,
        "trial0",
        2,
        "batch_size=3",
        "data.eval_size=4",
        "data.train_size=50",
        "checkpoint.every_steps=2",
        "checkpoint.final_model=false",
        "logging.tensorboard=true",
        "logging.wandb.mode=offline",
        "logging.wandb.project=sinks-test",
        *extra,
    )


def _wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file (wandb's own ``Record`` message; the file
    is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte
    header of CRC, length and kind: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _finished_records(run_folder: Path, timeout: float = 30.0) -> list:
    """The records of a finished offline run: ``run.finish()`` may return before wandb's
    service process has written the file out, so wait for its ``exit`` record."""
    (file,) = run_folder.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(file)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{file} has no exit record after {timeout} s"
        time.sleep(0.1)


def _wandb_history(run_folder: Path) -> tuple[dict, dict[int, dict]]:
    """(config, {step: {key: value}}) of one finished offline run folder."""
    config, history = {}, {}
    for record in _finished_records(run_folder):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            row = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                for i in record.history.item
            }
            history.setdefault(row["_step"], {}).update(row)
    return config, history


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb kept on this machine: offline, its folders under tmp_path, a fake API key."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        folder = tmp_path / name.lower()
        folder.mkdir()
        monkeypatch.setenv(name, str(folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)


def test_tensorboard_and_wandb_get_every_step(tiny_model_dir, tmp_path, offline_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path / "runs"
    assert main(_args(tiny_model_dir, root)) == 0
    run = root / "grpo-arith" / "trial0"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    before = json.loads((run / "eval_before.jsonl").read_text().splitlines()[0])
    assert [r["step"] for r in records] == [1, 2] and "correct" in before

    # TensorBoard: every numeric key at its step
    events = EventAccumulator(
        str(run / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    events.Reload()
    for record in records:
        step, scalars, histograms = split_record(record)
        assert "loss" in scalars and "staleness_hist" in histograms
        for key, value in scalars.items():
            (point,) = [e for e in events.Scalars(key) if e.step == step]
            assert point.value == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)
        (hist,) = [h for h in events.Histograms("staleness_hist") if h.step == step]
        counts = record["staleness_hist"]
        assert hist.histogram_value.num == sum(counts) == record["trained_tokens"]
        assert list(hist.histogram_value.bucket) == counts
        assert hist.histogram_value.max == max(k for k, c in enumerate(counts) if c)
    assert "step" not in events.Tags()["scalars"]
    (eval_before,) = events.Scalars("eval_before")
    assert (eval_before.step, eval_before.value) == (0, pytest.approx(summary["eval_before"]))
    (eval_after,) = events.Scalars("eval_after")
    assert (eval_after.step, eval_after.value) == (2, pytest.approx(summary["eval_after"]))

    # wandb: the offline run folder (named by the kept run id), the config and every key
    run_id = (run / "wandb" / "run_id").read_text().strip()
    (folder,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    config, rows = _wandb_history(folder)
    assert config["total_steps"] == 2 and config["logging"]["wandb"]["mode"] == "offline"
    assert config["model"]["path"] == str(tiny_model_dir) and config["batch_size"] == 3
    assert rows[0]["eval_before"] == pytest.approx(summary["eval_before"])
    assert rows[2]["eval_after"] == pytest.approx(summary["eval_after"])
    for record in records:
        step, scalars, _ = split_record(record)
        for key, value in scalars.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-12), (key, step)
        counts = record["staleness_hist"]
        assert rows[step]["staleness_hist/values"] == counts
        assert rows[step]["staleness_hist/bins"] == [k - 0.5 for k in range(len(counts) + 1)]
    for file in run.rglob("*"):
        if file.is_file() and not file.is_symlink():
            assert FAKE_KEY.encode() not in file.read_bytes(), file


def test_missing_package_fails_before_the_run_directory(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(_args(tiny_model_dir, tmp_path)) == 2
    assert not (tmp_path / "grpo-arith").exists()


def test_bad_wandb_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"^logging\.wandb\.mode = 'cloud' is not one of"):
        load_config(None, ["logging.wandb.mode=cloud"])
    with pytest.raises(ConfigError, match=r"^logging\.wandb\.project = ' ' is empty"):
        load_config(None, ['logging.wandb.project=" "'])
    with pytest.raises(ConfigError, match=r"unknown config key 'logging.wandb.api_key'"):
        load_config(None, ["logging.wandb.api_key=secret"])


def test_split_record_takes_every_numeric_key():
    record = {"step": 4, "loss": 0.5, "eval_accuracy": 1, "flag": True, "note": "x"}
    record["staleness_hist"] = [3, 0, 2]
    step, scalars, histograms = split_record(record)
    assert step == 4 and histograms == {"staleness_hist": [3, 0, 2]}
    assert scalars == {"loss": 0.5, "eval_accuracy": 1.0, "flag": 1.0}


def _config(tensorboard=True, wandb="offline"):
    from areal_fast.launch.config import ExperimentConfig, LoggingConfig, WandbConfig

    return ExperimentConfig(logging=LoggingConfig(tensorboard, WandbConfig(mode=wandb)))


def _scalars(folder: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def test_sinks_are_closed_when_the_run_fails(tmp_path, offline_wandb):
    from areal_fast.launch.log_sinks import LogSinks

    with pytest.raises(RuntimeError, match="trainer broke"):
        with LogSinks(_config(), tmp_path, None) as sinks:
            sinks.log_step({"step": 1, "loss": 0.5, "staleness_hist": [3, 1]})
            raise RuntimeError("trainer broke")
    assert sinks.sinks == []
    assert _scalars(tmp_path / "tensorboard", "loss") == [(1, 0.5)]
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    _, history = _wandb_history(folder)
    assert history[1]["loss"] == 0.5 and history[1]["staleness_hist/values"] == [3, 1]
    records = _finished_records(folder)
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert [e.exit_code for e in exits] == [1]  # finished, marked failed


def test_tensorboard_resume_shows_the_retrained_steps_only(tmp_path):
    from areal_fast.launch.log_sinks import LogSinks

    cfg = _config(wandb="disabled")
    with LogSinks(cfg, tmp_path, None) as sinks:
        sinks.log_eval("eval_before", 0, 0.25)
        for step in (1, 2, 3):
            sinks.log_step({"step": step, "loss": float(step)})
    with LogSinks(cfg, tmp_path, 1) as sinks:  # resumed from the checkpoint of step 1
        for step in (2, 3, 4):
            sinks.log_step({"step": step, "loss": 10.0 * step})
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one event file per attempt
    assert _scalars(tmp_path / "tensorboard", "loss") == [(1, 1), (2, 20), (3, 30), (4, 40)]
    assert _scalars(tmp_path / "tensorboard", "eval_before") == [(0, 0.25)]
    with LogSinks(cfg, tmp_path, 0) as sinks:  # no checkpoint: the run starts again
        sinks.log_step({"step": 1, "loss": 7.0})
    assert _scalars(tmp_path / "tensorboard", "loss") == [(1, 7.0)]


def test_wandb_start_failure_is_one_line(tmp_path, offline_wandb, monkeypatch):
    import wandb

    from areal_fast.launch.log_sinks import LogSinks

    def no_login(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.\nmore")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(ConfigError) as err:
        LogSinks(_config(wandb="online"), tmp_path, None)
    message = str(err.value)
    assert message.startswith("logging.wandb.mode = 'online': wandb could not start the run")
    assert "No API key configured" in message and "\n" not in message


def test_wandb_resume_continues_the_run_id(tmp_path, offline_wandb):
    from areal_fast.launch.log_sinks import LogSinks

    cfg = _config(tensorboard=False)
    with LogSinks(cfg, tmp_path, None) as sinks:
        sinks.log_step({"step": 1, "loss": 1.0})
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()
    with LogSinks(cfg, tmp_path, 1) as sinks:
        sinks.log_step({"step": 2, "loss": 2.0})
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"), key=lambda f: f.stat().st_mtime)
    assert len(folders) == 2 and all(f"-{run_id}" in f.name for f in folders)
    assert [sorted(_wandb_history(f)[1]) for f in folders] == [[1], [2]]
    with LogSinks(cfg, tmp_path / "new", None):  # a new run: a new id
        pass
    assert (tmp_path / "new" / "wandb" / "run_id").read_text().strip() != run_id
