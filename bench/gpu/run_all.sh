#!/usr/bin/env bash
# One prepared run for a lent GPU (an H200, 15 minutes of device time in all, start-up included): build the
# CUDA targets, run the CUDA tests, then measure kernels beside their peers and a LLaMA-3-8B-shaped training
# step. Stages run in order; name some to run only those (the device tool allows 10 minutes per command, so a
# lease runs two commands; the build folder survives between them):
#
#   bench/gpu/run_all.sh build test          configure + build (~3 min on 16 cores), ctest -L cuda (~1 min)
#   bench/gpu/run_all.sh bench train peer    kernel benchmarks (at most 4 min), training steps (at most 5 min),
#                                            PyTorch peers (at most 3 min; about 1)
#   bench/gpu/run_all.sh                     everything (over 10 minutes: not for one device-tool command)
#   BUILD=build bench/gpu/run_all.sh dry     no GPU: the training commands as dry runs of the device emulation
#                                            (about a minute each on 2 cores), before a lease
#   PREBUILT=build-gpubundle bench/gpu/run_all.sh test bench train peer
#                                            no build: the binaries of a bundle made here by bench/gpu/bundle.sh
#                                            (for a machine without forge's build dependencies; carry the bundle's
#                                            tarball, build-gpubundle.tgz, which is unpacked when the folder is absent)
#
# Stages: build, test (ctest -L cuda), bench (GEMM bf16/FP8 vs cuBLAS, block-scaled FP8 GEMM vs cuBLASLt
# per-tensor FP8, attention forward/backward, FP8 casts vs a device copy), train (`forge bench --device cuda` on
# bench/gpu/llama3-8b-4layers.json: hidden 4096, ffn 14336, 32 heads, 8 kv heads, vocab 128256, 4 layers,
# sequence 4096, $TRAIN_ACCUM (default 4) micro-batches of $TRAIN_BATCH (default 2) per optimizer step, in bf16
# and each FP8 recipe, and bf16 with one micro-batch per step; tokens/s, MFU, per-step losses; then DeepSeek-V3
# 50M in bf16 and FP8 block),
# peer (PyTorch on the same GPU, where the image has it: bench/torch_llama.py --device cuda on the same model and
# step in bf16 autocast, and bench/gpu/torch_attention.py, scaled_dot_product_attention at the attention
# bench's shapes). The last stage run prints bench/gpu/summarize.py's table: FP8 against bf16, forge against
# PyTorch.
# Every stage has its own timeout, and later stages run even when earlier ones fail. The last line sums up.
#
# Output: everything is tee'd to $OUT/run_all.log (OUT defaults to bench/gpu/out; on the device tool $OUT is the
# folder that comes back, at most 8 files); JSON lines to $OUT/{gemm,fp8block,attention,attention_torch,fp8cast,
# train}.jsonl (train.jsonl: forge's recipes and PyTorch's step). Configure and build logs and each training run's
# own output go to $SCRATCH (their errors and output are copied into the log). Copy the numbers into RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/gpu/out}
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
PREBUILT=${PREBUILT:-}
TRAIN_BATCH=${TRAIN_BATCH:-2}
TRAIN_ACCUM=${TRAIN_ACCUM:-4}
STAGES=${*:-build test bench train peer}
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}/forge-gpu-run}
mkdir -p "$OUT" "$SCRATCH"
LOG=$OUT/run_all.log
[[ -e $LOG ]] && LOG=$OUT/run_all.$(date +%H%M%S).log  # a second command of the same lease keeps the first's log
want() { [[ " $STAGES " == *" $1 "* ]]; }

main() {
start=$(date +%s)
stage() { printf '\n== %s (t+%ss)\n' "$*" "$(($(date +%s) - start))"; }
build_status="not run"
test_status="not run"
bench_status="not run"
train_status="not run"
peer_status="not run"
dry_status="not run"
summary() {
  printf '\n== summary (t+%ss, stages: %s): build %s, tests %s, benchmarks %s, training %s, peers %s, dry runs %s; log %s\n' \
    "$(($(date +%s) - start))" "$STAGES" "$build_status" "$test_status" "$bench_status" "$train_status" \
    "$peer_status" "$dry_status" "$LOG"
}
trap summary EXIT

stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv ||
  echo "nvidia-smi failed"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc on PATH"
git log --oneline -1 2>/dev/null || true

if [[ -n $PREBUILT ]]; then
  build_status="skipped (PREBUILT=$PREBUILT)"
  if [[ ! -d $PREBUILT && -f $PREBUILT.tgz ]]; then
    echo "unpacking $PREBUILT.tgz"
    tar xzf "$PREBUILT.tgz"
  fi
  [[ -d $PREBUILT/lib ]] && export LD_LIBRARY_PATH=$PWD/$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  BIN=$PREBUILT/bin
  # CUDA's libraries come from the image, wherever it keeps them (the toolkit, or Python's nvidia-* wheels).
  for lib in $(ldd "$BIN"/* 2>/dev/null | awk '/not found/ {print $1}' | sort -u); do
    dir=$(timeout 30 find /usr/local /usr/lib /opt -xdev -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
    if [[ -n $dir ]]; then
      echo "$lib: from $dir"
      export LD_LIBRARY_PATH=$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    else
      echo "$lib: not found on this machine"
    fi
  done
else
  BIN=$BUILD/bin
fi
# The training runs (FP8 recipe, micro-batches per step) of the train stage, and of the dry stage.
TRAIN_RUNS=("off 1" "off $TRAIN_ACCUM" "delayed $TRAIN_ACCUM" "current $TRAIN_ACCUM" "block $TRAIN_ACCUM")
# And DeepSeek-V3's (bench/configs/deepseek-v3-50m.json: MLA, 16 routed experts, MTP) in bf16 and with its own
# FP8 recipe (block, every expert in FP8), 8 sequences of 2048 per step; their JSON lines go to
# $OUT/train_deepseek.jsonl.
DEEPSEEK_ARGS="--model bench/configs/deepseek-v3-50m.json --device cuda --batch 8 --seq 2048"
TARGETS="test_cuda test_comm_nccl forge_gpubench forge_gpubench_attention forge_gpubench_fp8block forge_gpubench_fp8cast forge_cli"

if want build && [[ -z $PREBUILT ]]; then
  stage "preflight: forge's build dependencies"
  missing=()
  for header in dnnl.hpp fmt/format.h toml++/toml.hpp pcre2.h CLI/CLI.hpp mpi.h gtest/gtest.h benchmark/benchmark.h \
    nlohmann/json.hpp zlib.h nccl.h cublasLt.h; do
    found=$(find /usr/include /usr/local/include /usr/local/cuda/include /usr/lib/x86_64-linux-gnu/openmpi/include \
      -path "*/$header" -print -quit 2>/dev/null || true)
    [[ -n $found ]] || missing+=("$header")
  done
  if ((${#missing[@]})); then
    echo "missing headers: ${missing[*]} (configure will fail; see PREBUILT above)"
  else
    echo "all found"
  fi

  stage "configure"
  build_status="failed (configure)"
  # Hopper (sm_90a: wgmma, FP8 tensor cores), stated here so that a cached build dir cannot pick another.
  if timeout 90 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a >"$SCRATCH/configure.log" 2>&1; then
    grep -E "forge: (CUDA|NCCL)" "$SCRATCH/configure.log" || true
    # Only targets this configuration has (test_comm_nccl needs NCCL): ninja stops at an unknown target.
    known=$(ninja -C "$BUILD" -t targets all 2>/dev/null | cut -d: -f1)
    TARGETS=$(for t in $TARGETS; do grep -qx "$t" <<<"$known" && echo "$t"; done | xargs)
    stage "build (-j$JOBS): $TARGETS"
    build_status="failed (build)"
    # -k 0: build every target that can be built, so one broken benchmark does not stop the tests.
    if timeout 420 ninja -C "$BUILD" -j"$JOBS" -k 0 $TARGETS >"$SCRATCH/build.log" 2>&1; then
      build_status="ok"
    else
      grep -E -A12 "FAILED|error" "$SCRATCH/build.log" | head -80
    fi
  else
    tail -30 "$SCRATCH/configure.log"
  fi
fi

if want test; then
  if [[ -z $PREBUILT ]]; then
    stage "tests: ctest -L cuda"
    test_status=0
    timeout 200 ctest --test-dir "$BUILD" -L cuda -j4 --output-on-failure --timeout 120 || test_status=$?
    [[ $test_status == 0 ]] && test_status="passed" || test_status="FAILED (ctest exit $test_status)"
  else
    stage "tests: $BIN/test_cuda"
    test_status=0
    timeout 200 "$BIN/test_cuda" --gtest_brief=1 || test_status=$?
    [[ $test_status == 0 ]] && test_status="passed" || test_status="FAILED (test_cuda exit $test_status)"
    if [[ -x $BIN/test_comm_nccl ]] && command -v mpirun >/dev/null; then
      stage "tests: test_comm_nccl, 1 rank"
      nccl_status=0
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 60 mpirun -np 1 --oversubscribe \
        "$BIN/test_comm_nccl" || nccl_status=$?
      [[ $nccl_status == 0 ]] || test_status="$test_status, test_comm_nccl FAILED (exit $nccl_status)"
    fi
  fi
fi

# run_bench NAME SECONDS BINARY ARGS...: one benchmark with its own timeout; failures are counted, not fatal.
failures=()
run_bench() {
  local name=$1 seconds=$2 binary=$3
  shift 3
  stage "benchmark: $name"
  if [[ ! -x $binary ]]; then
    echo "$binary was not built"
    failures+=("$name (not built)")
    return
  fi
  local status=0
  timeout "$seconds" "$binary" "$@" || status=$?
  ((status == 0)) || failures+=("$name (exit $status)")
}

if want bench; then
  run_bench "GEMM TFLOP/s, forge vs cuBLAS" 80 "$BIN/forge_gpubench" --json "$OUT/gemm.jsonl"
  run_bench "block-scaled FP8 GEMM vs cuBLASLt per-tensor FP8" 60 "$BIN/forge_gpubench_fp8block" --json "$OUT/fp8block.jsonl"
  run_bench "attention forward/backward TFLOP/s" 60 "$BIN/forge_gpubench_attention" --json "$OUT/attention.jsonl"
  run_bench "FP8 casts GB/s vs a device copy" 40 "$BIN/forge_gpubench_fp8cast" --json "$OUT/fp8cast.jsonl"
  ((${#failures[@]})) && bench_status="FAILED: ${failures[*]}" || bench_status="ok"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
fi

if want train; then
  failures=()
  : >"$OUT/train.jsonl"
  # Each FP8 recipe and bf16 with $TRAIN_ACCUM micro-batches per optimizer step (as training accumulates), and
  # bf16 with one (the optimizer's pass over 1.9 billion parameters then weighs on every 8192 tokens).
  for run in "${TRAIN_RUNS[@]}"; do
    read -r recipe accum <<<"$run"
    stage "training step, LLaMA-3-8B shape (4 layers), $accum x batch $TRAIN_BATCH x 4096, fp8 $recipe"
    status=0
    timeout 75 "$BIN/forge" bench --model bench/gpu/llama3-8b-4layers.json --device cuda --batch "$TRAIN_BATCH" \
      --grad-accum "$accum" --seq 4096 --warmup 2 --steps 5 --profile-steps 1 --fp8 "$recipe" \
      >"$SCRATCH/train_$recipe.txt" 2>&1 ||
      status=$?
    cat "$SCRATCH/train_$recipe.txt"
    grep '^{' "$SCRATCH/train_$recipe.txt" >>"$OUT/train.jsonl" || true
    ((status == 0)) || failures+=("fp8 $recipe x$accum (exit $status)")
  done
  : >"$OUT/train_deepseek.jsonl"
  for recipe in off block; do
    stage "training step, DeepSeek-V3 50M, 8 x 2048, fp8 $recipe"
    status=0
    # shellcheck disable=SC2086
    timeout 60 "$BIN/forge" bench $DEEPSEEK_ARGS --warmup 2 --steps 5 --fp8 "$recipe" \
      >"$SCRATCH/train_deepseek_$recipe.txt" 2>&1 || status=$?
    cat "$SCRATCH/train_deepseek_$recipe.txt"
    grep '^{' "$SCRATCH/train_deepseek_$recipe.txt" >>"$OUT/train_deepseek.jsonl" || true
    ((status == 0)) || failures+=("deepseek fp8 $recipe (exit $status)")
  done
  ((${#failures[@]})) && train_status="FAILED: ${failures[*]}" || train_status="ok"
fi
if want dry; then
  # No GPU needed: the train stage's exact commands as dry runs of the device emulation (docs/cuda.md): every op
  # checks its pointers and the CUDA kernels' parameter limits without computing, and host code that touches
  # device memory faults. For a CPU machine before a lease: BUILD=build bench/gpu/run_all.sh dry
  failures=()
  for run in "${TRAIN_RUNS[@]}"; do
    read -r recipe accum <<<"$run"
    stage "dry run on the host: LLaMA-3-8B shape (4 layers), $accum x batch $TRAIN_BATCH x 4096, fp8 $recipe"
    status=0
    FORGE_EMULATE_DEVICE=dry timeout 600 "$BIN/forge" bench --model bench/gpu/llama3-8b-4layers.json --device cuda \
      --batch "$TRAIN_BATCH" --grad-accum "$accum" --seq 4096 --warmup 0 --steps 1 --fp8 "$recipe" \
      >"$SCRATCH/dry_$recipe.txt" 2>&1 || status=$?
    grep -E "^forge: (dry run|error)|host code touched" "$SCRATCH/dry_$recipe.txt" || tail -5 "$SCRATCH/dry_$recipe.txt"
    ((status == 0)) || failures+=("fp8 $recipe x$accum (exit $status)")
  done
  for recipe in off block; do
    stage "dry run on the host: DeepSeek-V3 50M, 8 x 2048, fp8 $recipe"
    status=0
    # shellcheck disable=SC2086
    FORGE_EMULATE_DEVICE=dry timeout 600 "$BIN/forge" bench $DEEPSEEK_ARGS --warmup 0 --steps 1 --fp8 "$recipe" \
      >"$SCRATCH/dry_deepseek_$recipe.txt" 2>&1 || status=$?
    grep -E "^forge: (dry run|error)|host code touched" "$SCRATCH/dry_deepseek_$recipe.txt" ||
      tail -5 "$SCRATCH/dry_deepseek_$recipe.txt"
    ((status == 0)) || failures+=("deepseek fp8 $recipe (exit $status)")
  done
  ((${#failures[@]})) && dry_status="FAILED: ${failures[*]}" || dry_status="ok"
fi
if want peer; then
  if command -v python3 >/dev/null && python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    failures=()
    stage "peer: PyTorch scaled_dot_product_attention at the attention bench's shapes"
    status=0
    timeout 60 python3 bench/gpu/torch_attention.py --samples 8 --batch 4 --json "$OUT/attention_torch.jsonl" || status=$?
    ((status == 0)) || failures+=("attention (exit $status)")
    stage "peer: PyTorch training step, LLaMA-3-8B shape (4 layers), $TRAIN_ACCUM x batch $TRAIN_BATCH x 4096, bf16"
    status=0
    timeout 120 python3 bench/torch_llama.py bench/gpu/llama3-8b-4layers.json --device cuda --batch "$TRAIN_BATCH" \
      --grad-accum "$TRAIN_ACCUM" --seq 4096 --warmup 2 --steps 5 >"$SCRATCH/train_torch.txt" 2>&1 || status=$?
    cat "$SCRATCH/train_torch.txt"
    [[ -e $OUT/train.jsonl ]] && grep -v '"engine": "pytorch"' "$OUT/train.jsonl" >"$SCRATCH/train.jsonl" &&
      cp "$SCRATCH/train.jsonl" "$OUT/train.jsonl"  # a rerun replaces the peer's line
    grep '^{' "$SCRATCH/train_torch.txt" >>"$OUT/train.jsonl" || true
    ((status == 0)) || failures+=("training step (exit $status)")
    ((${#failures[@]})) && peer_status="FAILED: ${failures[*]}" || peer_status="ok"
  else
    peer_status="skipped (no python3 with a CUDA PyTorch)"
    echo "$peer_status"
  fi
fi

if want bench || want train || want peer; then
  stage "summary of the measurements"
  command -v python3 >/dev/null && python3 bench/gpu/summarize.py "$OUT" || echo "(python3 missing: see the JSON lines)"
fi
[[ $test_status != FAILED* && $bench_status != FAILED* && $train_status != FAILED* && $peer_status != FAILED* &&
  $dry_status != FAILED* ]]
}

# main's output goes to the terminal and the log; the script's exit status is main's (pipefail).
main 2>&1 | tee "$LOG"
