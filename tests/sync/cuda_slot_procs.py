"""Process body of the CUDA-slot test (imported by a spawned child): an HF engine on the
trainer's GPU installs versions from the trainer's CUDA slots and reports CRC-32s."""

from __future__ import annotations

import traceback
import zlib


def crc(named) -> str:
    """CRC-32 of the bytes of (name, tensor) pairs in order (read back to the host)."""
    import torch

    value = 0
    for _, tensor in named:
        value = zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy(), value)
    return f"{value:08x}"


def engine_installs(model_dir: str, updates, out) -> None:
    """Build an HFEngine (bfloat16, cuda) from ``model_dir``; for each encoded UpdateWeights in
    ``updates`` (msgpack bytes from the controller codec, never pickled), install it through
    :class:`WorkerWeights` and put ``(version, crc of the engine's parameters, seconds)`` on
    ``out``; ``("error", traceback)`` on failure."""
    try:
        from areal_fast.models.loading import load_causal_lm, load_tokenizer
        from areal_fast.rollout.hf_engine import HFEngine
        from areal_fast.wire.codec import decode_message
        from areal_fast.workers.rollout_weights import WorkerWeights

        model = load_causal_lm(model_dir, "bfloat16", device="cuda")
        engine = HFEngine(model, load_tokenizer(model_dir), max_batch_size=4)
        sent = []

        class Conn:
            def send(self, message):
                sent.append(message)

        weights = WorkerWeights(engine, Conn(), post=lambda item: None, host="127.0.0.1")
        assert weights.gpu, "the engine reports no GPU"
        for raw in updates:
            message = decode_message(raw)
            weights.on_update(message)
            out.put((message.version, crc(engine.model.named_parameters()), sent[-1].seconds))
        weights.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put(("error", traceback.format_exc()))
