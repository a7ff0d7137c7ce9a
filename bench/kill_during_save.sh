#!/usr/bin/env bash
# SIGKILL during a background checkpoint save, at random moments, TRIALS times, on the 32M bench LLaMA (a
# 378 MB state, whose background write takes seconds). Each trial trains with a periodic save every 2 steps
# and is killed at a random moment while a save's staging folder exists (the shard being written, the
# manifest not yet committed). Then:
#   - the newest checkpoint must be complete and byte-identical to the uninterrupted reference run's
#     checkpoint of the same step (or there is none yet), and
#   - `checkpoint.resume = auto` must resume from it and end on the reference's final checkpoint, byte for
#     byte.
# Prints one line per trial and a summary; exits non-zero if any trial lost anything.
# Usage: bench/kill_during_save.sh [FORGE_BINARY] [TRIALS]
set -euo pipefail
cd "$(dirname "$0")/.."
FORGE=$(realpath "${1:-build/bin/forge}")
TRIALS=${2:-30}
STEPS=8
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 2000); do echo "In the beginning was the word $((i % 97)), and the word was with the light."; done > "$work/corpus.txt"
common="--set model.config=bench/configs/llama-32m.json --set data.corpus=$work/corpus.txt --set data.tokenizer=bytes
  --set data.seq_len=64 --set train.micro_batch=1 --set train.steps=$STEPS --set train.warmup=1
  --set eval.batches=1 --set eval.every=0 --set data.heldout_fraction=0.01 --set log.peak_gflops=100
  --set sample.tokens=0 --set checkpoint.every=2 --set checkpoint.keep_last=0 --set resilience.snapshot_every=0"
"$FORGE" train $common --set log.run_dir="$work/ref" > "$work/ref.log" 2>&1
same_shards() {  # checkpoint folder A, reference step folder B
  for f in "$2"/shard-*.safetensors; do cmp -s "$f" "$1/$(basename "$f")" || return 1; done
}
lost=0
for t in $(seq "$TRIALS"); do
  run="$work/t$t"
  "$FORGE" train $common --set log.run_dir="$run" > "$work/t$t.log" 2>&1 &
  pid=$!
  # Wait for the first (or a later, at random) save to be in flight, then kill after a random delay.
  target=$((RANDOM % 3 + 1)) seen=0
  while kill -0 $pid 2>/dev/null; do
    if compgen -G "$run/checkpoint/.step-*.partial" > /dev/null; then
      seen=$((seen + 1))
      if [ $seen -ge $target ]; then
        sleep "0.$(printf '%03d' $((RANDOM % 1000)))"
        break
      fi
      while compgen -G "$run/checkpoint/.step-*.partial" > /dev/null && kill -0 $pid 2>/dev/null; do sleep 0.01; done
    fi
    sleep 0.01
  done
  staging=$(compgen -G "$run/checkpoint/.step-*.partial" || true)
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  latest=$(cat "$run/checkpoint/latest" 2>/dev/null || true)
  verdict=ok
  if [ -n "$latest" ] && ! same_shards "$run/checkpoint/$latest" "$work/ref/checkpoint/$latest"; then verdict="LOST: $latest differs"; fi
  "$FORGE" train $common --set log.run_dir="$run" --set checkpoint.resume=auto > "$work/t$t-resume.log" 2>&1 || verdict="LOST: resume failed"
  final=$(cat "$run/checkpoint/latest")
  same_shards "$run/checkpoint/$final" "$work/ref/checkpoint/step-$(printf '%08d' $STEPS)" || verdict="LOST: final differs"
  when="no save in flight"
  [ -n "$staging" ] && when="the save of $(basename "$staging" .partial | sed 's/^\.//') in flight"
  echo "trial $t: killed with $when; newest checkpoint ${latest:-none}; resumed to $final: $verdict"
  [ "$verdict" = ok ] || lost=$((lost + 1))
  rm -rf "$run"
done
echo "$TRIALS trials, $lost lost anything"
[ $lost -eq 0 ]
