#!/usr/bin/env bash
# Expert parallelism's overlap on 2 ranks (ep 2), one OpenMP thread each (forge_ep_bench; docs/performance.md,
# "Expert parallelism: the overlap, measured"): one MoE layer's step with parallel.ep_overlap on and off and
# the share of the all-to-all wait hidden, and DualPipeV's overlapped pair interleaved against its F and B
# run apart, each beside the replay's prediction from costs measured in the same run.
#
# CAVEAT: take the numbers on a quiet machine (see run_pipeline.sh).
#
# Usage: bench/parallel/run_ep.sh [BUILD_DIR] [forge_ep_bench options...]   (JSON=FILE also writes the numbers)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
shift $(( $# < 1 ? $# : 1 ))
bench="$BUILD/bin/forge_ep_bench"
if [[ ! -x $bench ]]; then
  echo "run_ep.sh: $bench not found; build it first: cmake --build $BUILD --target forge_ep_bench" >&2
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
