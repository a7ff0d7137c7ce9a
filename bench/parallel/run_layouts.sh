#!/usr/bin/env bash
# Step time of each parallel layout on this machine, beside the one-rank run of the same global batch, and
# the data-parallel overlap ratio (the share of gradient-reduction time hidden behind backward).
#
# CAVEAT: on a 2-core machine every layout with more than 2 ranks oversubscribes the cores, and all ranks
# share one memory bus; the numbers show the communication and bookkeeping cost of each layout on one
# box, not the speed-up it gives on a cluster (where each rank has its own cores or GPU).
#
# Usage: bench/parallel/run_layouts.sh [BUILD_DIR]   (STEPS=30 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
FORGE=$(realpath "$BUILD/bin/forge")
STEPS=${STEPS:-30}
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
  local dir="$out/$name"
  local threads=$(( cores / np > 0 ? cores / np : 1 ))
  if [[ $np == 1 ]]; then
    "$FORGE" train "${common[@]}" --set train.grad_accum="$accum" --set log.run_dir="$dir" "$@" > "$dir.log" 2>&1
  else
    mpirun -np "$np" --oversubscribe --bind-to none -x OMP_NUM_THREADS=$threads \
      "$FORGE" train "${common[@]}" --set train.grad_accum="$accum" --set log.run_dir="$dir" \
      --set train.threads=$threads "$@" > "$dir.log" 2>&1
  fi
  echo "$name done"
}

run "1 rank"                1 2
run "tp 2"                  2 2 --set parallel.tp=2
run "tp 2 + sp"             2 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
run "dp 2"                  2 1
run "dp 2 + zero1"          2 1 --set parallel.distributed_optimizer=true
run "dp 2 no overlap"       2 1 --set parallel.overlap_grad_reduce=false
run "tp 2 x dp 2 (4 ranks)" 4 1 --set parallel.tp=2 --set parallel.sequence_parallel=true
run "tp 4 (4 ranks)"        4 2 --set parallel.tp=4

/usr/bin/python3 - "$out" <<'PY'
import json, pathlib, re, sys
d = pathlib.Path(sys.argv[1])
rows = []
for log in sorted(d.glob("*.log"), key=lambda p: p.stat().st_mtime):
    name = log.stem
    recs = [json.loads(l) for l in (d / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_s" in r]
    last = steps[-1]  # the interval after the first log point: steady state
    text = log.read_text()
    m = re.search(r"communication ([\d.]+) s, exposed ([\d.]+) s: (\d+)% overlapped", text)
    overlap = f"{m.group(3)}% ({m.group(2)} of {m.group(1)} s exposed)" if m else ""
    rows.append((name, last["tokens_per_s"], last["loss"], overlap))
base = rows[0][1]
print(f"{'layout':<24}{'tokens/s':>10}{'vs 1 rank':>11}{'loss':>9}   dp overlap")
for name, tps, loss, overlap in rows:
    print(f"{name:<24}{tps:>10.0f}{tps / base:>10.2f}x{loss:>9.4f}   {overlap}")
PY
echo "logs in $out"
