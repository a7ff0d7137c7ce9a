#!/usr/bin/env bash
# Training throughput of two forge binaries on the same model, interleaved on the same machine (A B A B ...),
# so that a refactor can show it changed nothing: the ratio of tokens/s, per round and as the median.
# Usage: bench/compare_builds.sh OLD_FORGE NEW_FORGE [ROUNDS]   (env: MODEL, DTYPE, STEPS, WARMUP)
#   e.g. bench/compare_builds.sh /tmp/base/build/bin/forge build/bin/forge 3
# Nothing else may run meanwhile: two OpenMP processes on the same cores slow each other 10-100x.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 ROUNDS=${3:-3}
MODEL=${MODEL:-bench/configs/llama-32m.json}
DTYPE=${DTYPE:-fp32}
STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
tokens_per_s() {
  "$1" bench --model "$MODEL" --dtype "$DTYPE" --steps "$STEPS" --warmup "$WARMUP" --peak-gflops 1 |
    /usr/bin/python3 -c 'import json,sys; print(next(json.loads(l) for l in sys.stdin if l.startswith("{"))["tokens_per_s"])'
}
ratios=()
for ((r = 1; r <= ROUNDS; ++r)); do
  old=$(tokens_per_s "$OLD")
  new=$(tokens_per_s "$NEW")
  ratio=$(/usr/bin/python3 -c "print(f'{$new / $old:.3f}')")
  ratios+=("$ratio")
  echo "round $r: old $old tokens/s, new $new tokens/s, new/old $ratio"
done
/usr/bin/python3 -c "import statistics,sys; r=[float(x) for x in sys.argv[1:]]; print(f'median new/old {statistics.median(r):.3f} over {len(r)} rounds ({min(r):.3f}..{max(r):.3f})')" "${ratios[@]}"
