#!/usr/bin/env bash
# Multimodal training throughput, forge against its PyTorch twin (bench/torch_llava.py: the same model from the
# same config.json, plain torch after Hugging Face's LLaVA) in the same run, both bf16 GEMMs (PyTorch: autocast)
# on every core:
#   1. the tiny job's model (configs/llava-tiny.json), 32 sequences of 96 tokens with one 32x32 image each;
#   2. a CLIP-ViT-B/16 encoder (bench/configs/llava-clip-vit-b16.json: 224x224 images, 196 patches, the
#      second-to-last layer's features) under a small LLaMA, 8 sequences of 256 tokens, the encoder trained.
# Prints tokens/s and images/s of each and the ratio forge / PyTorch.
#   bench/llava_throughput.sh     (about 4 minutes on 2 cores; needs python3-torch: make deps-bench)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FORGE=$ROOT/build/bin/forge
OUT=${OUT:-$(mktemp -d /tmp/forge-llava-bench.XXXXXX)}
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS

# forge's median tokens/s over the logged steps after the first few (metrics.jsonl).
forge_rate() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
rows = [r for r in rows if r["step"] > 3] or rows
tps = statistics.median(r["tokens_per_s"] for r in rows)
print(f"{tps:.1f} {tps / float(sys.argv[2]):.2f}")
PY
}

run_case() {  # name config images_dir seq batch steps
  local name=$1 config=$2 images=$3 seq=$4 batch=$5 steps=$6
  "$FORGE" train --config "$ROOT/configs/llava-tiny.toml" --set model.config="$config" \
    --set data.images="$images/train.jsonl" --set data.heldout_images="$images/heldout.jsonl" \
    --set data.seq_len="$seq" --set train.micro_batch="$batch" --set train.steps="$steps" --set train.warmup=2 \
    --set train.max_minutes=0 --set log.every=1 --set eval.every=0 --set eval.batches=1 \
    --set resilience.loss_spike=0 --set log.report=false --set checkpoint.overwrite=true --set sample.captions=0 \
    --set log.run_dir="$OUT/$name" >"$OUT/$name.log" 2>&1
  read -r forge_tps forge_ips < <(forge_rate "$OUT/$name" "$seq")
  local torch_json
  torch_json=$(/usr/bin/python3 "$ROOT/bench/torch_llava.py" "$config" --batch "$batch" --seq "$seq" \
    --steps "$((steps / 3 + 1))" --threads "$THREADS" | tail -1)
  python3 - "$name" "$forge_tps" "$forge_ips" "$torch_json" <<'PY'
import json, sys
name, tps, ips, torch = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
print(f"| {name} | {tps:.0f} | {ips:.1f} | {torch['tokens_per_s']:.0f} | {torch['images_per_s']:.1f} | "
      f"{tps / torch['tokens_per_s']:.2f}x |")
PY
}

"$FORGE" data synth-images --out "$OUT/shapes32" --count 1200 --size 32 >/dev/null
"$FORGE" data synth-images --out "$OUT/shapes224" --count 120 --size 224 >/dev/null
echo "| model | forge tokens/s | forge images/s | PyTorch tokens/s | PyTorch images/s | forge / PyTorch |"
echo "|---|---|---|---|---|---|"
run_case llava-tiny "$ROOT/configs/llava-tiny.json" "$OUT/shapes32" 96 32 30
run_case clip-vit-b16 "$ROOT/bench/configs/llava-clip-vit-b16.json" "$OUT/shapes224" 256 8 6
echo "(logs and runs in $OUT; $THREADS threads; $(python3 -c 'import platform; print(platform.processor() or platform.machine())'))"
