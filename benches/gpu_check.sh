#!/usr/bin/env bash
# One-shot GPU check for a lent CUDA machine: build the extension there (with nvcc),
# run the GPU tests, then the benchmarks; the summary tables are printed last.
# Usage (from the repo root): bash benches/gpu_check.sh
#
# Optional: Liger-Kernel as a comparison row of bench_logprobs.py. Put its wheel at
# benches/wheels/liger_kernel-<version>-py3-none-any.whl (e.g. `pip download --no-deps
# liger-kernel==0.8.5 -d benches/wheels`; the wheel is not committed) and it is installed
# here with --no-deps (it needs only torch and triton, which a CUDA torch brings).
# LOGPROBS_TIMEOUT (seconds, default 420) bounds the log-prob benchmark.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
{
  status=0
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps --no-build-isolation . \
    || AREAL_FAST_CUDA=1 python3 -m pip install -q --no-deps . || status=1
  python3 -c "import areal_fast._C as c; print(c.build_info())" || status=1
  python3 -m pytest -q tests/ops/test_segment.py -x -p no:cacheprovider || status=1
  python3 benches/bench_packing.py --repeats 3 | tee "$out/bench_packing.md" || status=1

  # Op and loss tests on the GPU (Triton / CUDA paths); -rs lists what was skipped and why.
  python3 -m pytest tests/ops tests/rl -q -rs -p no:cacheprovider || status=1

  # Log-probs / fused loss benchmark on the GPU, optional Liger-Kernel row.
  for whl in benches/wheels/liger_kernel-*.whl; do
    [ -e "$whl" ] || continue
    python3 -m pip install -q --no-deps "$whl" || echo "liger wheel $whl: install failed"
  done
  timeout "${LOGPROBS_TIMEOUT:-420}" python3 benches/bench_logprobs.py --device cuda \
    --json "$out/bench_logprobs_cuda.json" > "$out/bench_logprobs_cuda.md"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "bench_logprobs --device cuda: exit code $rc (124: timed out); partial results, if" \
         "any, are in $out/bench_logprobs_cuda.json"
    [ -s "$out/bench_logprobs_cuda.json" ] && python3 benches/bench_logprobs.py \
      --table "$out/bench_logprobs_cuda.json" > "$out/bench_logprobs_cuda.md"
    status=1
  fi
  exit $status
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -s "$out/bench_logprobs_cuda.md" ]; then
  echo
  echo "## bench_logprobs --device cuda"
  tee -a "$log" < "$out/bench_logprobs_cuda.md"
fi
echo "gpu_check exit status: $status"
exit $status
