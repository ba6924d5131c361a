#!/usr/bin/env bash
# One-shot GPU check of weight sync (at most ~8 minutes on one H200): build the extension
# with nvcc, run the sync tests on the GPU (CUDA pack/unpack kernel, CUDA IPC into a second
# process), then the benchmarks: pack/unpack kernel bandwidth against the device-to-device
# copy bandwidth of the same run (goal >= 80 %), and CUDA-IPC zero-copy sync of the
# 135M- and 1.5B-shaped state dicts into a second process on the same GPU.
# Usage (from the repo root): bash benches/gpu_weight_sync.sh    (results under $OUT)
set -uo pipefail
out="${OUT:-/tmp/gpu_weight_sync}"
mkdir -p "$out"
log="$out/gpu_weight_sync.log"
{
  status=0
  nvidia-smi --query-gpu=name,memory.total,driver_version,uuid --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps --no-build-isolation . \
    || AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps . || status=1
  python3 -c "import areal_fast._C as c; print(c.build_info())" || status=1
  python3 -m pip install -q hypothesis safetensors 2>/dev/null
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/sync/test_buckets.py \
    tests/sync/test_gloo_sync.py -k "cuda or bit_exact or fp32_trainer" || status=1
  timeout 120 python3 benches/bench_bucket_pack.py --device cuda \
    --json "$out/bucket_pack_cuda.json" > "$out/bucket_pack_cuda.md" || status=1
  timeout 150 python3 benches/bench_weight_sync.py --transport cuda-ipc --engines 1 \
    --repeats 3 --json "$out/weight_sync_cuda_ipc.json" > "$out/weight_sync_cuda_ipc.md" \
    || status=1
  exit $status
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
for table in bucket_pack_cuda weight_sync_cuda_ipc; do
  if [ -s "$out/$table.md" ]; then
    echo
    echo "## $table"
    tee -a "$log" < "$out/$table.md"
  fi
done
echo "gpu_weight_sync exit status: $status"
exit $status
