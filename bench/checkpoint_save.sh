#!/usr/bin/env bash
# The cost of a checkpoint save, this forge against another build (e.g. the commit before step folders), in
# one run on the 32M bench LLaMA (weights + AdamW moments: 3 x 4 bytes x 31.5M parameters = 378 MB per save).
# Each binary trains 6 steps twice: with checkpoint.every = 1 (5 periodic saves + the final one) and with
# checkpoint.every = 0 (the final one only); the difference of the wall times over 5 is the cost of one save.
# The two builds alternate, REPEAT times, and the medians are compared.
# Usage: bench/checkpoint_save.sh NEW_FORGE OLD_FORGE [REPEAT]
set -euo pipefail
cd "$(dirname "$0")/.."
NEW=$1 OLD=$2 REPEAT=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 2000); do echo "In the beginning was the word $((i % 97)), and the word was with the light."; done > "$work/corpus.txt"
common="--set model.config=bench/configs/llama-32m.json --set data.corpus=$work/corpus.txt --set data.tokenizer=bytes
  --set data.seq_len=128 --set train.micro_batch=1 --set train.steps=6 --set train.warmup=1 --set eval.batches=1
  --set data.heldout_fraction=0.01 --set log.peak_gflops=100 --set sample.tokens=0 --set log.every=100"
run() {  # binary every label -> seconds
  local dir="$work/run-$3"
  rm -rf "$dir"
  local start end
  start=$(date +%s.%N)
  "$1" train $common --set checkpoint.every="$2" --set log.run_dir="$dir" > "$work/$3.log" 2>&1
  end=$(date +%s.%N)
  echo "$end - $start" | bc
}
for r in $(seq "$REPEAT"); do
  for build in new old; do
    bin=$NEW; [ $build = old ] && bin=$OLD
    with=$(run "$bin" 1 "$build-$r-with")
    without=$(run "$bin" 0 "$build-$r-without")
    echo "$build $with $without" | tee -a "$work/times.txt"
  done
done
grep -h "checkpoint saved" "$work"/new-*-with.log | sed 's/.*, \([0-9.]*\) s)$/\1/' > "$work/new_printed.txt" || true
/usr/bin/python3 - "$work/times.txt" "$work/new_printed.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
per = {b: statistics.median((float(w) - float(o)) / 5 for name, w, o in rows if name == b) for b in ("new", "old")}
printed = [float(x) for x in open(sys.argv[2]) if x.strip()]
print(f"one save (378 MB), median of {len(rows) // 2} pairs of runs: new {per['new']:.3f} s, old {per['old']:.3f} s, "
      f"ratio new/old {per['new'] / per['old']:.2f}")
if printed:
    print(f"new build's own timing of its saves: median {statistics.median(printed):.3f} s over {len(printed)} saves")
PY
