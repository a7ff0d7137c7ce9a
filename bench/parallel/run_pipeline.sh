#!/usr/bin/env bash
# Pipeline schedules on 2 ranks, measured against the replay of their own measured per-action costs
# (forge_pipeline_bench; docs/performance.md, "Pipeline schedules: measured against the replay"): for 1f1b,
# interleaved (vpp 2), zb-h1, zbv, dualpipe and dualpipev, the step time and bubble of the executor beside
# the replay's makespan and bubble, the F&B pair against F + B apart, and ZB-V against DualPipeV without an
# overlap. One OpenMP thread per rank, so that each rank is one compute resource as the replay assumes.
#
# CAVEAT: take the numbers on a quiet machine. On a shared 2-core VM any other process steals time from one
# rank or the other, the costs (timed first) and the steps (timed after) then see different machines, and
# measured / replay says nothing about the replay.
#
# Usage: bench/parallel/run_pipeline.sh [BUILD_DIR] [forge_pipeline_bench options...]
#   (default: --micro-batches 8 --reps 5 --warmup 1 --steps 5; JSON=FILE also writes the numbers to FILE)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
shift $(( $# < 1 ? $# : 1 ))
bench="$BUILD/bin/forge_pipeline_bench"
if [[ ! -x $bench ]]; then
  echo "run_pipeline.sh: $bench not found; build it first: cmake --build $BUILD --target forge_pipeline_bench" >&2
  exit 1
fi
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
json=()
if [[ -n ${JSON:-} ]]; then
  json=(--json "$JSON")
fi
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), load $(cut -d' ' -f1-3 /proc/loadavg)"
mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$bench" --threads 1 "${json[@]}" "$@"
