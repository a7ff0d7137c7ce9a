#!/usr/bin/env bash
# One prepared run for a lent GPU (an H200, 15 minutes of device time in all, start-up included): build the
# CUDA targets, run the CUDA tests, then measure GEMM throughput beside cuBLAS. Every stage has its own
# timeout (configure 90 s, build 300 s, tests 120 s, benchmark 90 s: at most 10 minutes, typically 3 to 5),
# and the benchmark runs even when tests fail. The last line sums up.
#
#   bench/gpu/run_all.sh                   build in $BUILD (default build-gpu) and run
#   PREBUILT=build-gpubundle bench/gpu/run_all.sh
#                                          no build: run the binaries of a bundle made here by
#                                          bench/gpu/bundle.sh (for a machine without forge's build dependencies;
#                                          carry the bundle folder)
#
# Output: everything is tee'd to $OUT/run_all.log (OUT defaults to bench/gpu/out; on the device tool $OUT is the
# folder that comes back), the benchmark's JSON lines to $OUT/gemm.jsonl. Copy the numbers into RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/gpu/out}
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
PREBUILT=${PREBUILT:-}
mkdir -p "$OUT"
LOG=$OUT/run_all.log

main() {
start=$(date +%s)
stage() { printf '\n== %s (t+%ss)\n' "$*" "$(($(date +%s) - start))"; }
build_status="not run"
test_status="not run"
bench_status="not run"
summary() {
  printf '\n== summary (t+%ss): build %s, tests %s, benchmark %s; log %s, results %s\n' \
    "$(($(date +%s) - start))" "$build_status" "$test_status" "$bench_status" "$LOG" "$OUT/gemm.jsonl"
}
trap summary EXIT

stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv ||
  echo "nvidia-smi failed"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc on PATH"

if [[ -z $PREBUILT ]]; then
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
  timeout 90 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFORGE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  grep -E "forge: (CUDA|NCCL)" "$OUT/configure.log" || true

  stage "build (-j$JOBS): test_cuda test_comm_nccl forge_gpubench"
  build_status="failed (build)"
  timeout 300 ninja -C "$BUILD" -j"$JOBS" test_cuda test_comm_nccl forge_gpubench >"$OUT/build.log" 2>&1 ||
    { grep -E -A12 "FAILED|error" "$OUT/build.log" | head -60; exit 1; }
  build_status="ok"
  BIN=$BUILD/bin

  stage "tests: ctest -L cuda"
  test_status=0
  timeout 120 ctest --test-dir "$BUILD" -L cuda -j8 --output-on-failure --timeout 60 || test_status=$?
  [[ $test_status == 0 ]] && test_status="passed" || test_status="FAILED (ctest exit $test_status)"
else
  build_status="skipped (PREBUILT=$PREBUILT)"
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

  stage "tests: $BIN/test_cuda"
  test_status=0
  timeout 120 "$BIN/test_cuda" --gtest_brief=1 || test_status=$?
  [[ $test_status == 0 ]] && test_status="passed" || test_status="FAILED (test_cuda exit $test_status)"
  if [[ -x $BIN/test_comm_nccl ]] && command -v mpirun >/dev/null; then
    stage "tests: test_comm_nccl, 1 rank"
    nccl_status=0
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 60 mpirun -np 1 --oversubscribe \
      "$BIN/test_comm_nccl" || nccl_status=$?
    [[ $nccl_status == 0 ]] || test_status="$test_status, test_comm_nccl FAILED (exit $nccl_status)"
  fi
fi

stage "benchmark: GEMM TFLOP/s, forge vs cuBLAS"
bench_status=0
timeout 90 "$BIN/forge_gpubench" --json "$OUT/gemm.jsonl" || bench_status=$?
[[ $bench_status == 0 ]] && bench_status="ok" || bench_status="FAILED (exit $bench_status)"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
[[ $test_status == passed && $bench_status == ok ]]
}

# main's output goes to the terminal and the log; the script's exit status is main's (pipefail).
main 2>&1 | tee "$LOG"
