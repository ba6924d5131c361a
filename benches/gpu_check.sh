#!/usr/bin/env bash
# One-shot GPU check for a lent CUDA machine: build the extension there (with nvcc),
# run the GPU tests, then the benchmarks; the summary table is printed last.
# Usage (from the repo root): bash benches/gpu_check.sh
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps --no-build-isolation . \
    || AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps . || status=1
  python3 -c "import areal_fast._C as c; print(c.build_info())" || status=1
  python3 -m pytest -q tests/test_segment_sum.py tests/ops tests/rl -x -p no:cacheprovider \
    || status=1
  python3 benches/bench_packing.py --repeats 3 | tee "$out/bench_packing.md" || status=1
} 2>&1 | tee "$log"
echo "gpu_check exit status: $status"
exit $status
