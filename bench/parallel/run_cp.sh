#!/usr/bin/env bash
# Context parallelism on this machine (docs/parallelism.md, "Context parallelism: measured"):
#   1. forge_cp_bench: one causal attention layer at a long sequence, forward + backward, one rank on the
#      whole sequence against cp ranks on their chunks (ring and all-to-all), with the ring's blocked time
#      split into waiting for the slower rank and for transfers, the transfers alone, and the replay of the
#      ring's schedule from the costs measured in the same run;
#   2. forge train at a long sequence: a LLaMA (hidden 256, 4 layers, 8 heads, 2 kv heads) at SEQ tokens,
#      one rank against cp = 2 (ring and all-to-all), one thread per rank: step time, the peak activation
#      memory per rank beside one rank's / cp, and the ring's blocked share from the run's own log.
#
# CAVEAT: one OpenMP thread per rank on a 2-core machine (the one-rank run has one core, each cp rank one);
# take the numbers on a quiet machine. MPI over shared memory moves a message inside the calls that test or
# wait for it: the ring tests its transfers between blocks, so the copy runs on the rank's own core between
# its attention blocks (hidden from the waits, not free).
#
# Usage: bench/parallel/run_cp.sh [BUILD_DIR]   (SEQ=4096, STEPS=6 by default; JSON=FILE: the layer's numbers)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
FORGE=$(realpath "$BUILD/bin/forge")
BENCH="$BUILD/bin/forge_cp_bench"
SEQ=${SEQ:-4096}
STEPS=${STEPS:-6}
for bin in "$FORGE" "$BENCH"; do
  if [[ ! -x $bin ]]; then
    echo "run_cp.sh: $bin not found; build it first: cmake --build $BUILD" >&2
    exit 1
  fi
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), load $(cut -d' ' -f1-3 /proc/loadavg)"

json=()
if [[ -n ${JSON:-} ]]; then json=(--json "$JSON"); fi
"${mpi[@]}" "$BENCH" --seq "$SEQ" --threads 1 "${json[@]}"

out=$(mktemp -d)
cat docs/*.md README.md > "$out/corpus.txt"
cat > "$out/model.json" <<JSON
{"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
 "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256, "max_position_embeddings": $SEQ}
JSON
common=(train --set model.config="$out/model.json" --set data.corpus="$out/corpus.txt" --set data.tokenizer=bytes
        --set data.seq_len="$SEQ" --set train.micro_batch=1 --set train.steps="$STEPS" --set train.warmup=2
        --set train.dtype=fp32 --set eval.every=0 --set eval.batches=1 --set data.heldout_fraction=0.05 --set sample.tokens=0 --set log.every=1
        --set log.peak_gflops=100 --set log.report=false --set train.threads=1)
OMP_NUM_THREADS=1 "$FORGE" "${common[@]}" --set log.run_dir="$out/one" > "$out/one.log" 2>&1
"${mpi[@]}" "$FORGE" "${common[@]}" --set parallel.cp=2 --set log.run_dir="$out/ring" > "$out/ring.log" 2>&1
"${mpi[@]}" "$FORGE" "${common[@]}" --set parallel.cp=2 --set parallel.cp_comm=a2a \
  --set log.run_dir="$out/a2a" > "$out/a2a.log" 2>&1

/usr/bin/python3 - "$out" "$SEQ" <<'PY'
import json, pathlib, re, statistics, sys
d, seq = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def run(name):
    steps = [json.loads(l) for l in (d / name / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "tokens_per_s" in s and s["step"] > 1]
    log = (d / f"{name}.log").read_text()
    act = float(re.search(r"peak activation memory ([0-9.]+) MiB", log).group(1))
    blocked = re.search(r"of which ([0-9.]+) s \(([0-9]+)%\) blocked", log)
    return statistics.median(s["tokens_per_s"] for s in steps), act, blocked.group(2) + "%" if blocked else "-"
one = run("one")
print(f"\nforge train, LLaMA hidden 256 x 4 layers, 8 heads (2 kv), one sequence of {seq} tokens per step, fp32,"
      " one thread per rank (median of the steps after the first)")
print(f"  {'':24} {'tokens/s':>9} {'vs one':>7} {'act. MiB/rank':>14} {'one / cp':>9} {'blocked':>8}")
for name, label, cp in (("one", "one rank", 1), ("ring", "cp 2 ring (p2p)", 2), ("a2a", "cp 2 all-to-all", 2)):
    tps, act, blocked = run(name)
    print(f"  {label:24} {tps:9.0f} {tps / one[0]:6.2f}x {act:14.1f} {one[1] / cp:9.1f} {blocked:>8}")
PY
rm -rf "$out"
