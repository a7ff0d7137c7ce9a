#!/usr/bin/env bash
# The simulator against published Megatron-LM measurements (docs/simulator.md, "Accuracy on published GPU
# runs"): Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# (arXiv:2205.05198), Table 5: iteration times of GPT 22B, 175B, 530B and 1T on A100s (Selene), with full
# recompute and with sequence parallelism + selective recompute, in the layouts of its Table 3. The models are
# LLaMA twins of the GPTs (bench/sim/published/*.json: the same attention, a SwiGLU with the GPT MLP's FLOPs);
# the hardware is the shipped, published A100 profile (configs/hardware/a100.toml), not a measurement.
# Then SimuMax's own B200 validation runs (bench/sim/published/simumax-b200.txt: Megatron-LM on 8 B200s, measured
# and SimuMax-predicted) with the shipped, published B200 profile (configs/hardware/b200.toml): forge's and
# SimuMax's predictions of the same measurements side by side. Gradient buckets at forge's GPU default,
# Megatron's (max(40M, 1M x dp) fp32 elements: 160 MB here); the 4 MiB of CPUs would pay a ring's latency per
# bucket thousands of times a step.
#   bench/sim_published.sh     (about a minute; prints two markdown tables)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FORGE=$ROOT/build/bin/forge
DIR=$ROOT/bench/sim/published
echo "| model | GPUs | layout | recompute | measured (paper) | forge predicts | error | forge memory per GPU (weights + optimizer, activations) |"
echo "|---|---|---|---|---|---|---|---|"
# name gpus tp pp vpp global_batch micro_batch measured_full measured_seqsel
while read -r name gpus tp pp vpp batch mb full seqsel; do
  for policy in full seqsel; do
    if [[ $policy == full ]]; then
      extra=(--set train.recompute=full --set parallel.sequence_parallel=false)
      measured=$full
    else
      extra=(--set train.recompute=selective --set parallel.sequence_parallel=true)
      measured=$seqsel
    fi
    schedule=1f1b
    ((vpp > 1)) && schedule=interleaved
    out=$("$FORGE" plan estimate --cluster "$DIR/selene.toml" --ranks "$gpus" --set model.config="$DIR/$name.json" \
      --set data.seq_len=2048 --set parallel.tp="$tp" --set parallel.pp="$pp" --set parallel.vpp="$vpp" \
      --set parallel.schedule=$schedule --set parallel.dp=$((gpus / tp / pp)) --set train.micro_batch="$mb" \
      --set train.grad_accum=$((batch / (gpus / tp / pp) / mb)) "${extra[@]}" || true)
    step=$(sed -n 's/^time per step: \([0-9.]*\) ms.*/\1/p' <<<"$out")
    weights=$(sed -n 's/^  parameters, bf16 shadow, gradients *\(.*\)$/\1/p' <<<"$out")
    optimizer=$(sed -n 's/^  optimizer state (and FP8 state) *\(.*\)$/\1/p' <<<"$out")
    activations=$(sed -n 's/^  activations ([0-9]* in flight) *\(.*\)$/\1/p' <<<"$out")
    python3 - "$name" "$gpus" "tp$tp pp$pp vpp$vpp mb$mb x$((batch / (gpus / tp / pp) / mb))" "$policy" "$measured" "$step" \
      "$weights + $optimizer, $activations" <<'PY'
import sys
name, gpus, layout, policy, measured, step, memory = sys.argv[1:]
predicted = float(step) / 1e3
print(f"| {name} | {gpus} | {layout} | {'full' if policy == 'full' else 'seq + selective'} | {float(measured):.2f} s | "
      f"{predicted:.2f} s | {100 * (predicted / float(measured) - 1):+.1f}% | {memory} |")
PY
  done
done <<'EOF_CASES'
gpt-22b 8 8 1 1 4 4 1.42 1.10
gpt-175b 64 8 8 3 64 1 18.13 13.75
gpt-530b 280 8 35 3 280 1 49.05 37.83
gpt-1t 512 8 64 1 512 1 94.42 71.49
EOF_CASES

echo
echo "| model | layout (8 B200) | micro-batches | measured step | SimuMax | error | forge | error | measured peak | SimuMax | forge |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
ERRORS=$(mktemp)
grep -v '^#' "$DIR/simumax-b200.txt" | while read -r model layers tp pp dp mbc real_ms simumax_ms real_gib simumax_gib; do
  config=$DIR/$model-l$layers.json
  sp=false
  ((tp > 1)) && sp=true
  out=$("$FORGE" plan estimate --hardware b200 --ranks 8 --set model.config="$config" --set data.seq_len=4096 \
    --set parallel.tp="$tp" --set parallel.pp="$pp" --set parallel.dp="$dp" --set parallel.schedule=1f1b \
    --set parallel.sequence_parallel=$sp --set parallel.distributed_optimizer=true --set train.micro_batch=1 \
    --set train.grad_accum="$mbc" --set train.recompute=none || true)
  step=$(sed -n 's/^time per step: \([0-9.]*\) ms.*/\1/p' <<<"$out")
  memory=$(sed -n 's/^memory per device (pp rank [0-9]*): \(.*\)$/\1/p' <<<"$out")
  python3 - "$model-l$layers" "tp$tp pp$pp dp$dp" "$mbc" "$real_ms" "$simumax_ms" "$step" "$real_gib" "$simumax_gib" "$memory" <<'PY'
import sys
model, layout, mbc, real, simumax, forge, real_gib, simumax_gib, memory = sys.argv[1:]
real, simumax, forge = float(real), float(simumax), float(forge)
print(f"| {model} | {layout} | {mbc} | {real:.1f} ms | {simumax:.1f} ms | {100 * (simumax / real - 1):+.1f}% | "
      f"{forge:.1f} ms | {100 * (forge / real - 1):+.1f}% | {float(real_gib):.2f} GiB | {float(simumax_gib):.2f} GiB | {memory} |")
PY
  echo "$real_ms $simumax_ms $step" >>"$ERRORS"
done
python3 - "$ERRORS" <<'PY'
import sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
for name, i in (("SimuMax (measured B200 system file)", 1), ("forge (published b200 profile)", 2)):
    e = [r[i] / r[0] - 1 for r in rows]
    print(f"\n{name}: {len(e)} runs, mean |step error| {100 * sum(map(abs, e)) / len(e):.1f}%, "
          f"from {100 * min(e):+.1f}% to {100 * max(e):+.1f}%", end="")
print()
PY
rm -f "$ERRORS"
