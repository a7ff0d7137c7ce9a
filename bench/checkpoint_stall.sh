#!/usr/bin/env bash
# What saving a checkpoint and keeping an in-memory snapshot cost the training step, on the 32M bench LLaMA
# (weights + AdamW moments: 3 x 4 bytes x 31.5M parameters = 378 MB per save), in one run of this script:
#
#   sync      periodic saves written by the training thread (checkpoint.async = false)
#   async     periodic saves copied to host memory by the step, written in the background (the default)
#   nosave    no periodic save (the final one only): the baseline
#   snapshot  an in-memory snapshot after every step (resilience.snapshot_every = 1), no periodic save
#
# Reported: the median seconds of a synchronous save against the median seconds an asynchronous one blocked
# the step (the copy), both from metrics.jsonl, and their ratio (issue target: <= 5%); the training time
# each periodic save added over the nosave run (from the step records' elapsed_s, so the background
# writer's competition for the cores counts too); and the snapshot's cost per step.
# Each configuration runs REPEAT times, alternating, and medians are reported (this machine's step times
# wander by 10-20% from run to run).
# Usage: bench/checkpoint_stall.sh [FORGE_BINARY] [STEPS] [EVERY] [REPEAT]
set -euo pipefail
cd "$(dirname "$0")/.."
FORGE=${1:-build/bin/forge}
STEPS=${2:-24}
EVERY=${3:-4}
REPEAT=${4:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 2000); do echo "In the beginning was the word $((i % 97)), and the word was with the light."; done > "$work/corpus.txt"
common="--set model.config=bench/configs/llama-32m.json --set data.corpus=$work/corpus.txt --set data.tokenizer=bytes
  --set data.seq_len=128 --set train.micro_batch=2 --set train.steps=$STEPS --set train.warmup=1
  --set eval.batches=1 --set eval.every=0 --set data.heldout_fraction=0.01 --set log.peak_gflops=100
  --set sample.tokens=0 --set log.every=1 --set checkpoint.keep_last=2"
run() {  # label, extra settings
  "$FORGE" train $common --set log.run_dir="$work/$1" $2 > "$work/$1.log" 2>&1
}
for r in $(seq "$REPEAT"); do
  run "sync-$r" "--set checkpoint.every=$EVERY --set checkpoint.async=false --set resilience.snapshot_every=0"
  run "async-$r" "--set checkpoint.every=$EVERY --set checkpoint.async=true --set resilience.snapshot_every=0"
  run "nosave-$r" "--set checkpoint.every=0 --set resilience.snapshot_every=0"
  run "snapshot-$r" "--set checkpoint.every=0 --set resilience.snapshot_every=1"
done
/usr/bin/python3 - "$work" "$STEPS" "$EVERY" "$REPEAT" <<'PY'
import json, statistics, sys
work, steps, every, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
med = statistics.median
def records(label):
    return [json.loads(l) for l in open(f"{work}/{label}/metrics.jsonl")]
def training_seconds(label):  # from the end of step 1 to the end of the last step
    r = [x for x in records(label) if "loss" in x and "event" not in x]
    return r[-1]["elapsed_s"] - r[0]["elapsed_s"]
def periodic(label):
    return [x for x in records(label) if x.get("event") == "checkpoint" and x.get("reason") == "periodic"]
runs = range(1, repeat + 1)
saves = len(periodic("sync-1"))
sync_s = med(x["seconds"] for r in runs for x in periodic(f"sync-{r}"))
blocked_s = med(x["blocked_s"] for r in runs for x in periodic(f"async-{r}"))
written_s = med(x["seconds"] for r in runs for x in periodic(f"async-{r}"))
base = [training_seconds(f"nosave-{r}") for r in runs]
step_s = med(base) / (steps - 1)
added_sync = med((training_seconds(f"sync-{r}") - base[r - 1]) / saves for r in runs)
added_async = med((training_seconds(f"async-{r}") - base[r - 1]) / saves for r in runs)
snap = [[x for x in records(f"snapshot-{r}") if x.get("event") == "snapshots"][0] for r in runs]
snap_s = med(x["seconds_median"] for x in snap)
added_snap = med((training_seconds(f"snapshot-{r}") - base[r - 1]) / (steps - 1) for r in runs)
print(f"32M LLaMA, {steps} steps, a periodic save every {every} ({saves} saves of 378 MB), medians of {repeat} "
      f"runs each; one step {step_s*1e3:.0f} ms")
print(f"synchronous save: {sync_s*1e3:.0f} ms | asynchronous save blocked the step {blocked_s*1e3:.1f} ms (copy to "
      f"host), written in {written_s*1e3:.0f} ms in the background | blocked / synchronous = "
      f"{100*blocked_s/sync_s:.1f}%")
print(f"training time added per save over no saves: synchronous {added_sync*1e3:.0f} ms, asynchronous "
      f"{added_async*1e3:.0f} ms ({100*added_async/added_sync:.0f}% of synchronous: the background writer's "
      f"competition for the cores counts here)")
print(f"in-memory snapshot after every step: {snap_s*1e3:.1f} ms each ({100*snap_s/step_s:.0f}% of a step; "
      f"{snap[0]['host_bytes']/2**20:.0f} MiB of host memory held for 2 snapshots); training time added per "
      f"step {added_snap*1e3:.1f} ms; at the default snapshot_every = 50: {100*snap_s/50/step_s:.1f}% per step")
PY
