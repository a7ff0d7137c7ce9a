#!/usr/bin/env bash
# Step time of each parallel layout on this machine, beside the one-rank run of the same global batch, and
# the data-parallel overlap ratio (the share of gradient-reduction time hidden behind backward).
#
# CAVEAT: on a 2-core machine every layout with more than 2 ranks oversubscribes the cores, and all ranks
# share one memory bus; the numbers show the communication and bookkeeping cost of each layout on one
# box, not the speed-up it gives on a cluster (where each rank has its own cores or GPU).
#
# This VM's speed drifts by +-20% over minutes (shared host), so every layout runs REPEAT times, the
# repeats interleaved, and the table shows the best and the median tokens/s of each.
#
# Usage: bench/parallel/run_layouts.sh [BUILD_DIR]   (STEPS=30, REPEAT=3 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
FORGE=$(realpath "$BUILD/bin/forge")
STEPS=${STEPS:-30}
REPEAT=${REPEAT:-3}
out=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cores=$(nproc)

# The default model (1.6M parameters, hidden 128, 6 layers) on the default corpus; 8 sequences of 256
# tokens per step in every layout (micro_batch x grad_accum x dp).
common=(--set train.steps="$STEPS" --set eval.every=0 --set sample.tokens=0 --set log.every=10
        --set data.seq_len=256 --set train.micro_batch=4 --set train.dtype=fp32 --set train.warmup=5
        --set checkpoint.every=0)

run() {  # name ranks accum settings...
  local name=$1 np=$2 accum=$3; shift 3
  local dir="$out/$name#$rep"
  local threads=$(( cores / np > 0 ? cores / np : 1 ))
  if [[ $np == 1 ]]; then
    "$FORGE" train "${common[@]}" --set train.grad_accum="$accum" --set log.run_dir="$dir" "$@" > "$dir.log" 2>&1
  else
    mpirun -np "$np" --oversubscribe --bind-to none -x OMP_NUM_THREADS=$threads \
      "$FORGE" train "${common[@]}" --set train.grad_accum="$accum" --set log.run_dir="$dir" \
      --set train.threads=$threads "$@" > "$dir.log" 2>&1
  fi
}

for rep in $(seq "$REPEAT"); do
run "1 rank"                1 2
run "tp 2"                  2 2 --set parallel.tp=2
run "tp 2 + sp"             2 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
run "dp 2"                  2 1
run "dp 2 + zero1"          2 1 --set parallel.distributed_optimizer=true
run "dp 2 no overlap"       2 1 --set parallel.overlap_grad_reduce=false
run "tp 2 x dp 2 (4 ranks)" 4 1 --set parallel.tp=2 --set parallel.sequence_parallel=true
run "tp 4 (4 ranks)"        4 2 --set parallel.tp=4
echo "repeat $rep of $REPEAT done"
done

/usr/bin/python3 - "$out" <<'PY'
import json, pathlib, re, sys
d = pathlib.Path(sys.argv[1])
import statistics
runs = {}
for log in sorted(d.glob("*.log"), key=lambda p: p.stat().st_mtime):
    name = log.stem.rsplit("#", 1)[0]
    recs = [json.loads(l) for l in (d / log.stem / "metrics.jsonl").read_text().splitlines()]
    # Tokens over time from the first log point on (the first step pays one-time costs).
    steps = [r for r in recs if "tokens_per_s" in r]
    first, last = steps[0], steps[-1]
    tps = (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])
    m = re.search(r"communication ([\d.]+) s, exposed ([\d.]+) s: (\d+)% overlapped", log.read_text())
    runs.setdefault(name, []).append((tps, last["loss"], int(m.group(3)) if m else None))
base_best = max(t for t, _, _ in runs["1 rank"])
base_median = statistics.median(t for t, _, _ in runs["1 rank"])
print(f"{'layout':<24}{'best tok/s':>11}{'vs 1 rank':>10}{'median':>9}{'vs 1 rank':>10}{'loss':>9}   dp overlap (median)")
for name, rs in runs.items():
    best = max(t for t, _, _ in rs)
    median = statistics.median(t for t, _, _ in rs)
    overlaps = [o for _, _, o in rs if o is not None]
    overlap = f"{statistics.median(overlaps):.0f}% hidden" if overlaps else ""
    print(f"{name:<24}{best:>11.0f}{best / base_best:>9.2f}x{median:>9.0f}{median / base_median:>9.2f}x"
          f"{rs[0][1]:>9.4f}   {overlap}")
PY
echo "logs in $out"
