#!/usr/bin/env bash
# Collective bandwidth with 2 and 4 ranks on this machine (oversubscribed, one OpenMP thread per rank).
#   bench/comm/run.sh [build-dir (default: build)] [mpi|nccl (default: mpi)] [forge_comm_bench options...]
# The nccl backend needs a CUDA device per rank.
set -euo pipefail
build=${1:-build}
backend=${2:-mpi}
shift $(( $# < 2 ? $# : 2 ))
bench="$build/bin/forge_comm_bench"
if [[ ! -x $bench ]]; then
  echo "run.sh: $bench not found; build it first: ninja -C $build forge_comm_bench" >&2
  exit 1
fi
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
for ranks in 2 4; do
  mpirun -np "$ranks" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$bench" --backend "$backend" "$@"
  echo
done
