"""TensorBoard and wandb sinks end to end on the tiny model (an in-process ``areal-fast train``
of 2 steps, then a resume to step 3), read back with TensorBoard's event reader and from the
wandb offline run's records; and the one-line errors for a missing package."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from areal_fast.cli import main
from areal_fast.launch.config import ConfigError, load_config
from areal_fast.launch.log_sinks import split_record

REPO = Path(__file__).resolve().parents[2]
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # must never reach a file


def _args(model_dir, root, *extra):
    return [
        "train",
        "--config",
        str(REPO / "examples" / "arith.yaml"),
        "--no-progress",
        f"model.path={model_dir}",
        f"fileroot={root}",
        "total_steps=2",
        "batch_size=3",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6",
        "data.eval_size=4",
        "data.train_size=50",
        "threads=1",
        "checkpoint.every_steps=2",
        "checkpoint.final_model=false",
        "logging.tensorboard=true",
        "logging.wandb.mode=offline",
        "logging.wandb.project=sinks-test",
        *extra,
    ]


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


def _wandb_history(run_folder: Path) -> tuple[dict, dict[int, dict]]:
    """(config, {step: {key: value}}) of one offline run folder."""
    (file,) = run_folder.glob("run-*.wandb")
    config, history = {}, {}
    for record in _wandb_records(file):
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
    assert main(_args(tiny_model_dir, root, "resume=true", "total_steps=3")) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    before = json.loads((run / "eval_before.jsonl").read_text().splitlines()[0])
    assert [r["step"] for r in records] == [1, 2, 3] and "correct" in before

    # TensorBoard: one folder for both attempts, every numeric key at its step
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
    after = {e.step: e.value for e in events.Scalars("eval_after")}  # one per attempt
    assert sorted(after) == [2, 3] and after[3] == pytest.approx(summary["eval_after"])

    # wandb: one offline folder per attempt, the same run id, the config and every key
    folders = sorted((run / "wandb").glob("offline-run-*"))
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders)
    rows: dict[int, dict] = {}
    for folder in folders:
        config, history = _wandb_history(folder)
        assert config["total_steps"] in (2, 3) and config["logging"]["wandb"]["mode"] == "offline"
        assert config["model"]["path"] == str(tiny_model_dir) and config["batch_size"] == 3
        for step, row in history.items():
            rows.setdefault(step, {}).update(row)
    assert rows[0]["eval_before"] == pytest.approx(summary["eval_before"])
    assert rows[3]["eval_after"] == pytest.approx(summary["eval_after"])
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


@pytest.mark.parametrize(
    "override,package",
    [("logging.tensorboard=true", "tensorboard"), ("logging.wandb.mode=offline", "wandb")],
)
def test_missing_package_is_one_line_at_config_time(monkeypatch, override, package):
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    with pytest.raises(ConfigError) as err:
        load_config(str(REPO / "examples" / "arith.yaml"), [override])
    message = str(err.value)
    assert "\n" not in message and message.startswith(override.split("=")[0])
    assert f"needs the {package} package" in message and f"pip install '{package}>=" in message


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
