"""The demo model's cache entry is built once, also when several processes ask at once."""

from __future__ import annotations

import threading
import time

from areal_fast.models import loading


def test_concurrent_first_uses_build_the_demo_model_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_FAST_CACHE", str(tmp_path))
    builds = []

    def download(folder):
        builds.append(threading.get_ident())
        time.sleep(0.3)  # long enough for every other caller to arrive meanwhile
        folder.mkdir(parents=True)
        return folder / "demo.gguf"

    def dequantise(gguf, staged):
        staged.mkdir()
        (staged / "config.json").write_text("{}")
        (staged / "model.safetensors").write_bytes(b"weights of build %d" % len(builds))

    monkeypatch.setattr(loading, "_download_demo_gguf", download)
    monkeypatch.setattr(loading, "_dequantise_to_hf", dequantise)
    results, errors = [], []

    def use():
        try:
            results.append(loading.demo_model_dir())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(builds) == 1, "the cache entry was built more than once"
    assert (results[0] / "model.safetensors").read_bytes() == b"weights of build 1"
    assert [
        p.name for p in tmp_path.joinpath("models").iterdir() if not p.name.startswith(".")
    ] == ["SmolLM2-135M-Instruct"]
