#!/usr/bin/env bash
# The simulator's accuracy on this machine (docs/simulator.md, "Accuracy on forge's own runs"): calibrates
# this machine's profiles with forge plan calibrate (one rank with every core; two ranks at once with one
# thread each, under mpirun, which also times the link between them), then trains each run of the grid for a
# few steps with log.hardware_profile and prints its predicted and measured step time and peak memory, one
# table row per run, then the mean and largest errors. Run it alone on the machine (other work skews both).
# The grid runs REPEATS times over (default 3) and each run counts the median of its rounds' median steps: on
# a shared machine the same run measured 330, 339 and 450 ms back to back, and slow spells last minutes, so a
# run's repeats are one round of the grid apart (calibrate does the same with its --repeats rounds and costs
# each op at the median of its samples: typical against typical, neither side the luckiest).
#   bench/sim_accuracy.sh [OUT_DIR]     (default build/sim_accuracy; about 25 minutes on 2 cores)
#   RUNS='llama-(none|full)' bench/sim_accuracy.sh   reruns only the runs whose names match (their profiles are
#                                                    kept unless deleted), keeping the other rows
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FORGE=$ROOT/build/bin/forge
OUT=${1:-$ROOT/build/sim_accuracy}
STEPS=${STEPS:-10}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPI=(mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
LLAMA=$ROOT/bench/sim/llama-20m.json
DS=$ROOT/bench/sim/deepseek-v3-small.json
SEQ=256

calibrate() {  # name model np args...
  local name=$1 model=$2 np=$3
  shift 3
  [[ -f $OUT/$name.toml ]] && return
  if ((np > 1)); then
    "${MPI[@]}" "$FORGE" plan calibrate --model "$model" --seq-len $SEQ --out "$OUT/$name.toml" "$@" >/dev/null
  else
    "$FORGE" plan calibrate --model "$model" --seq-len $SEQ --out "$OUT/$name.toml" "$@" >/dev/null
  fi
  echo "calibrated $OUT/$name.toml" >&2
}
calibrate llama-1 "$LLAMA" 1 --micro-batch 2,4,8 --tp 1 --recompute none,selective,full --fp8 off,delayed
calibrate llama-2 "$LLAMA" 2 --micro-batch 2,4 --tp 1,2 --pp 1,2 --recompute none,full
calibrate ds-1 "$DS" 1 --micro-batch 4 --tp 1 --recompute none,full --capacity-factor 0,1 --pad-to-capacity
calibrate ds-2 "$DS" 2 --micro-batch 4 --tp 1 --pp 1 --recompute none --capacity-factor 1 --pad-to-capacity
calibrate llama-cp "$LLAMA" 2 --micro-batch 4 --tp 1 --cp 2 --recompute none
calibrate ds-cp "$DS" 2 --micro-batch 4 --tp 1 --cp 2 --recompute none --capacity-factor 1 --pad-to-capacity
# The DeepSeek-V3 runs fix their expert shapes (capacity factor 1, every expert's rows padded to it, as
# SimuMax's and Megatron's MoE benchmarks do): the simulator routes as a balanced router, and an untrained
# router is far from one (ds-dropless shows what that costs).
PAD=(--set moe.capacity_factor=1 --set moe.pad_to_capacity=true)

ROWS=$OUT/rows.jsonl
RUNS=${RUNS:-}
if [[ -n $RUNS && -f $ROWS ]]; then
  python3 - "$ROWS" "$RUNS" <<'PY'
import json, re, sys
path, pattern = sys.argv[1:]
keep = [l for l in open(path) if not re.fullmatch(pattern, json.loads(l)["name"])]
open(path, "w").writelines(keep)
PY
else
  : >"$ROWS"
fi
run() {  # name profile np model args...
  local name=$1 profile=$2 np=$3 model=$4
  shift 4
  [[ -z $RUNS || $name =~ ^($RUNS)$ ]] || return 0
  local dir=$OUT/runs/$name
  rm -rf "$dir"
  local cmd=("$FORGE" train --set model.config="$model" --set data.seq_len=$SEQ --set data.tokenizer=bytes
    --set train.steps=$STEPS --set train.warmup=2 --set log.every=1 --set eval.every=0 --set sample.tokens=0
    --set log.run_dir="$dir" --set log.hardware_profile="$OUT/$profile.toml" --set train.micro_batch=4 "$@")
  if ((np > 1)); then "${MPI[@]}" "${cmd[@]}" >"$OUT/$name.log" 2>&1; else "${cmd[@]}" >"$OUT/$name.log" 2>&1; fi
  python3 - "$dir/metrics.jsonl" "$name" "$np" "$*" >>"$ROWS" <<'PY'
import json, sys
path, name, np, args = sys.argv[1:]
for line in open(path):
    r = json.loads(line)
    if r.get("event") == "prediction_check":
        r.update(name=name, ranks=int(np), args=args)
        print(json.dumps(r))
PY
  echo "ran $name (round $((round + 1)) of $REPEATS)" >&2
}
grid() {
# One rank, every core.
run llama-none llama-1 1 "$LLAMA"
run llama-selective llama-1 1 "$LLAMA" --set train.recompute=selective
run llama-full llama-1 1 "$LLAMA" --set train.recompute=full
run llama-mb2 llama-1 1 "$LLAMA" --set train.micro_batch=2
run llama-mb8 llama-1 1 "$LLAMA" --set train.micro_batch=8
run llama-accum2 llama-1 1 "$LLAMA" --set train.grad_accum=2
run llama-fp8 llama-1 1 "$LLAMA" --set fp8.recipe=delayed
run ds-none ds-1 1 "$DS" "${PAD[@]}"
run ds-full ds-1 1 "$DS" "${PAD[@]}" --set train.recompute=full
run ds-dropless ds-1 1 "$DS"
# Two ranks, one thread each.
run llama-tp2 llama-2 2 "$LLAMA" --set parallel.tp=2
run llama-tp2-sp llama-2 2 "$LLAMA" --set parallel.tp=2 --set parallel.sequence_parallel=true
run llama-dp2 llama-2 2 "$LLAMA" --set parallel.dp=2
run llama-dp2-zero llama-2 2 "$LLAMA" --set parallel.dp=2 --set parallel.distributed_optimizer=true
run llama-dp2-mb2 llama-2 2 "$LLAMA" --set parallel.dp=2 --set train.micro_batch=2 --set train.grad_accum=2
for schedule in 1f1b interleaved zb-h1 zbv dualpipev dualpipe; do
  vpp=1
  [[ $schedule == interleaved ]] && vpp=2
  run "llama-pp2-$schedule" llama-2 2 "$LLAMA" --set parallel.pp=2 --set parallel.schedule=$schedule \
    --set parallel.vpp=$vpp --set train.grad_accum=4 --set train.micro_batch=2
done
run llama-pp2-full llama-2 2 "$LLAMA" --set parallel.pp=2 --set train.grad_accum=4 --set train.micro_batch=2 \
  --set train.recompute=full
run ds-dp2 ds-2 2 "$DS" "${PAD[@]}" --set parallel.dp=2
run ds-ep2 ds-2 2 "$DS" "${PAD[@]}" --set parallel.dp=2 --set parallel.ep=2
# Two micro-batches: the step runs them as an overlapped F&B pair (each one's all-to-alls under the other's
# compute).
run ds-ep2-accum2 ds-2 2 "$DS" "${PAD[@]}" --set parallel.dp=2 --set parallel.ep=2 --set train.grad_accum=2
# Context parallelism: every sequence over the two ranks.
run llama-cp2 llama-cp 2 "$LLAMA" --set parallel.cp=2
run llama-cp2-a2a llama-cp 2 "$LLAMA" --set parallel.cp=2 --set parallel.cp_comm=a2a
run ds-cp2 ds-cp 2 "$DS" "${PAD[@]}" --set parallel.cp=2
}
for ((round = 0; round < REPEATS; ++round)); do grid; done

python3 - "$ROWS" <<'PY'
import json, sys
rounds = {}
for l in open(sys.argv[1]):
    r = json.loads(l)
    rounds.setdefault(r["name"], []).append(r)
rows = []
for name, rs in rounds.items():  # the median round of each run (the slower middle one of an even count)
    rs.sort(key=lambda r: r["step_s_measured"])
    rows.append(rs[len(rs) // 2])
print("| run | ranks | settings | step predicted | step measured | error | peak predicted | peak measured | error |")
print("|---|---|---|---|---|---|---|---|---|")
te, me = [], []
for r in rows:
    t = r["step_s_predicted"] / r["step_s_measured"] - 1
    m = r["memory_bytes_predicted"] / r["memory_bytes_measured"] - 1
    te.append(t); me.append(m)
    print(f"| {r['name']} | {r['ranks']} | `{r['args'].split('.json ',1)[-1] if '.json' in r['args'] else r['args']}` | "
          f"{1e3*r['step_s_predicted']:.1f} ms | {1e3*r['step_s_measured']:.1f} ms | {100*t:+.1f}% | "
          f"{r['memory_bytes_predicted']/2**20:.1f} MiB | {r['memory_bytes_measured']/2**20:.1f} MiB | {100*m:+.1f}% |")
if rows:
    print()
    print(f"{len(rows)} runs: step time mean |error| {100*sum(map(abs,te))/len(te):.1f}%, max {100*max(map(abs,te)):.1f}%; "
          f"peak memory mean |error| {100*sum(map(abs,me))/len(me):.1f}%, max {100*max(map(abs,me)):.1f}%")
    # Ranking: every pair of runs of one model on the same ranks whose measured steps differ by more than 5%
    # (closer pairs are within the machine's noise): is the faster one predicted faster?
    pairs = right = 0
    for a in rows:
        for b in rows:
            if a["name"] < b["name"] and a["ranks"] == b["ranks"] and a["name"][:2] == b["name"][:2]:
                ma, mb = a["step_s_measured"], b["step_s_measured"]
                if abs(ma / mb - 1) > 0.05:
                    pairs += 1
                    right += (ma < mb) == (a["step_s_predicted"] < b["step_s_predicted"])
    print(f"ranking: {right} of {pairs} pairs of runs (same model and ranks, measured more than 5% apart) "
          f"predicted in the measured order")
    pp = [r for r in rows if r["name"].startswith("llama-pp2-") and r["name"] != "llama-pp2-full"]
    order = lambda key: " < ".join(r["name"][len("llama-pp2-"):] for r in sorted(pp, key=lambda r: r[key]))
    print(f"pp2 schedules, predicted fastest first: {order('step_s_predicted')}; measured: {order('step_s_measured')}")
PY
