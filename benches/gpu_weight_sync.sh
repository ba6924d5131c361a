#!/usr/bin/env bash
# One-shot GPU check of weight sync (about 4 minutes on one H200): build the extension with
# nvcc, run the sync tests on the GPU (CUDA pack/unpack kernel, CUDA IPC into a second
# process), then the benchmarks: pack/unpack kernel bandwidth against the device-to-device
# copy bandwidth of the same run (goal >= 80 %), for the default kernel build and one with
# larger tiles (AREAL_FAST_BUCKET_TILE_BYTES, more bytes in flight per thread), and CUDA-IPC
# zero-copy sync of the 135M- and 1.5B-shaped state dicts into a second process.
# Usage (from the repo root): bash benches/gpu_weight_sync.sh    (results under $OUT)
set -uo pipefail
out="${OUT:-/tmp/gpu_weight_sync}"
mkdir -p "$out"
log="$out/gpu_weight_sync.log"

install_here() {
  # Build and install, then put the built module next to the sources too: pytest run from
  # the repository root imports areal_fast from the working tree.
  AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps --no-build-isolation . || return 1
  so="$(cd /tmp && python3 -c 'import areal_fast._C as c; print(c.__file__)')" || return 1
  cp "$so" areal_fast/ && python3 -c "import areal_fast._C as c; print(c.build_info())"
}

{
  status=0
  nvidia-smi --query-gpu=name,memory.total,driver_version,uuid --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [ -z "${ONLY_VARIANTS:-}" ]; then
    SECONDS=0
    install_here || status=1
    echo "build: ${SECONDS} s"
    timeout 180 python3 -m pytest -q -rs -p no:cacheprovider -W error::RuntimeWarning \
      tests/sync/test_buckets.py tests/sync/test_sender.py -k "cuda" || status=1
    timeout 120 python3 benches/bench_bucket_pack.py --device cuda --impls native,torch \
      --json "$out/bucket_pack_cuda.json" > "$out/bucket_pack_cuda.md" || status=1
    timeout 150 python3 benches/bench_weight_sync.py --transport cuda-ipc --engines 1 \
      --repeats 5 --json "$out/weight_sync_cuda_ipc.json" > "$out/weight_sync_cuda_ipc.md" \
      || status=1
  fi
  # Kernel variants TILE_BYTES-BLOCKS_PER_SM (default build: 16384-8), e.g.
  # BUCKET_VARIANTS="16384-4 32768-4"; see csrc/cuda/bucket_pack.cu for measured ones.
  for variant in ${BUCKET_VARIANTS:-}; do
    tile="${variant%%-*}" blocks="${variant##*-}"
    AREAL_FAST_BUCKET_TILE_BYTES=$tile AREAL_FAST_BUCKET_BLOCKS_PER_SM=$blocks install_here \
      || status=1
    timeout 90 python3 benches/bench_bucket_pack.py --device cuda --impls native \
      --json "$out/bucket_pack_cuda_$variant.json" > "$out/bucket_pack_cuda_$variant.md" \
      || status=1
  done
  if grep -q "bucket_copy CUDA kernel failed" "$log"; then
    echo "the CUDA pack kernel failed and torch copies were timed instead"; status=1
  fi
  exit $status
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
for md in "$out"/bucket_pack_cuda*.md "$out"/weight_sync_cuda_ipc.md; do
  table="$(basename "$md" .md)"
  if [ -s "$out/$table.md" ]; then
    echo
    echo "## $table"
    grep "^|" "$out/$table.md" | tee -a "$log"
  fi
done
echo "gpu_weight_sync exit status: $status"
exit $status
