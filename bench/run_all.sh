#!/usr/bin/env bash
# End-to-end training throughput: forge fp32/bf16 beside PyTorch fp32/bf16-autocast on the same 32M LLaMA
# (vocab 8192, hidden 512, 8 layers, 8 heads, 4 kv heads, ffn 1408, seq 512, micro-batch 4), in one run,
# then the micro-benchmarks. Usage: bench/run_all.sh [BUILD_DIR]   (make bench)
# DEEPSEEK=1 adds DeepSeek-V3 (forge beside bench/torch_deepseek_v3.py, bf16, tiny and 52M configs).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
FORGE=$BUILD/bin/forge
CONFIG=bench/configs/llama-32m.json
STEPS=${STEPS:-4}
out=$(mktemp -d)

echo "== GEMM peaks (the MFU denominators)"
$FORGE bench | tee "$out/peaks.txt"
peak_bf16=$(awk '/peak bf16/ {print $4}' "$out/peaks.txt")
peak_fp32=$(awk '/peak fp32/ {print $4}' "$out/peaks.txt")

echo "== end-to-end training, batch 4 x 512 tokens"
$FORGE bench --model $CONFIG --dtype bf16 --steps "$STEPS" --peak-gflops "$peak_bf16" | tee "$out/forge_bf16.txt"
$FORGE bench --model $CONFIG --dtype fp32 --steps "$STEPS" --peak-gflops "$peak_fp32" | tee "$out/forge_fp32.txt"
/usr/bin/python3 bench/torch_llama.py $CONFIG --dtype bf16 --steps "$STEPS" --threads "$(nproc)" | tee "$out/torch_bf16.txt"
/usr/bin/python3 bench/torch_llama.py $CONFIG --dtype fp32 --steps 1 --threads "$(nproc)" | tee "$out/torch_fp32.txt"

/usr/bin/python3 - "$out" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
def load(name):
    return next(json.loads(l) for l in (d / name).read_text().splitlines() if l.startswith("{"))
fb, ff, tb, tf = (load(n) for n in ("forge_bf16.txt", "forge_fp32.txt", "torch_bf16.txt", "torch_fp32.txt"))
print("== summary")
print(f"{'engine':<22}{'tokens/s':>10}{'GFLOP/s':>10}{'MFU':>8}")
for name, r in (("forge bf16", fb), ("forge fp32", ff), ("pytorch bf16 autocast", tb), ("pytorch fp32", tf)):
    mfu = f"{100*r['mfu']:.1f}%" if "mfu" in r else ""
    print(f"{name:<22}{r['tokens_per_s']:>10.0f}{r['model_gflops']:>10.1f}{mfu:>8}")
print(f"forge bf16 / pytorch bf16: {fb['tokens_per_s']/tb['tokens_per_s']:.2f}x   "
      f"forge fp32 / pytorch fp32: {ff['tokens_per_s']/tf['tokens_per_s']:.2f}x")
PY

# DeepSeek-V3 (MLA, DeepSeekMoE, MTP) beside its PyTorch peer bench/torch_deepseek_v3.py, bf16, on the tiny config
# and the 52M one. Optional: DEEPSEEK=1 bench/run_all.sh (DS_BATCH x DS_SEQ tokens a step, default 4 x 512; both
# engines get the same DS_WARMUP untimed steps, default 1).
if [[ ${DEEPSEEK:-0} == 1 ]]; then
  DS_BATCH=${DS_BATCH:-4}
  DS_SEQ=${DS_SEQ:-512}
  DS_WARMUP=${DS_WARMUP:-1}
  echo "== DeepSeek-V3 training, bf16, batch $DS_BATCH x $DS_SEQ tokens"
  ds_names=()
  for ds in configs/deepseek-v3-tiny.json bench/configs/deepseek-v3-50m.json; do
    if [[ ! -f $ds ]]; then echo "($ds not found: skipped)"; continue; fi
    name=$(basename "$ds" .json)
    ds_names+=("$name")
    $FORGE bench --model "$ds" --dtype bf16 --batch "$DS_BATCH" --seq "$DS_SEQ" --steps "$STEPS" \
      --warmup "$DS_WARMUP" --peak-gflops "$peak_bf16" | tee "$out/forge_$name.txt"
    /usr/bin/python3 bench/torch_deepseek_v3.py "$ds" --dtype bf16 --batch "$DS_BATCH" --seq "$DS_SEQ" --steps "$STEPS" \
      --warmup "$DS_WARMUP" --threads "$(nproc)" --peak-gflops "$peak_bf16" | tee "$out/torch_$name.txt"
  done
  /usr/bin/python3 - "$out" "${ds_names[@]}" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
def load(name):
    return next(json.loads(l) for l in (d / name).read_text().splitlines() if l.startswith("{"))
print("== DeepSeek-V3 summary (bf16)")
print(f"{'model':<20}{'engine':<10}{'tokens/s':>10}{'GFLOP/s':>10}{'MFU':>8}{'loss':>9}")
for model in sys.argv[2:]:
    f, t = load(f"forge_{model}.txt"), load(f"torch_{model}.txt")
    for engine, r in (("forge", f), ("pytorch", t)):
        mfu = f"{100*r['mfu']:.1f}%" if "mfu" in r else ""
        print(f"{model:<20}{engine:<10}{r['tokens_per_s']:>10.0f}{r['model_gflops']:>10.1f}{mfu:>8}{r['losses'][-1]:>9.3f}")
    print(f"{model:<20}forge / pytorch: {f['tokens_per_s']/t['tokens_per_s']:.2f}x")
PY
fi

if [[ -x $BUILD/bin/forge_microbench ]]; then
  echo "== micro-benchmarks"
  $BUILD/bin/forge_microbench --benchmark_min_time=0.2 2>&1 | grep -v "^\*\*\*"
fi

# Tokenizer encode throughput beside Hugging Face tokenizers (its Rust library through the Node binding)
# on the same text and tokenizer. Optional: needs node and `npm ci` in tests/reference/tokenizer.
REF=tests/reference/tokenizer
if [[ -x $BUILD/bin/forge_microbench && -f data/kjv.txt && -d $REF/node_modules/tokenizers ]] && command -v node >/dev/null; then
  echo "== tokenizer encode, KJV, 4096-token byte-level BPE, one thread: forge vs Hugging Face tokenizers"
  $FORGE tokenizer train --input data/kjv.txt --vocab-size 4096 --special-token '<|endoftext|>' \
    --output "$out/kjv4096.json" > "$out/train_tok.txt"
  head -1 "$out/train_tok.txt"
  FORGE_BENCH_TOKENIZER="$out/kjv4096.json" $BUILD/bin/forge_microbench --benchmark_filter='BM_TokenizerEncodeKjv/' \
    --benchmark_min_time=1 --benchmark_format=json 2>/dev/null > "$out/forge_tok.json"
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node $REF/bench_encode.js "$out/kjv4096.json" data/kjv.txt 5 \
    > "$out/hf_tok.json"
  /usr/bin/python3 - "$out" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
forge = json.loads((d / "forge_tok.json").read_text())["benchmarks"][0]
hf = json.loads((d / "hf_tok.json").read_text())
forge_mb = forge["bytes_per_second"] / 1e6
print(f"forge {forge_mb:.1f} MB/s ({forge['tokens']:.0f} tokens, the text as one string)")
print(f"hf tokenizers {hf['version']}: {hf['mb_per_s']:.1f} MB/s as one string ({hf['tokens']} tokens), "
      f"{hf['lines_mb_per_s']:.1f} MB/s line by line in one encodeBatch ({hf['lines']} lines)")
print(f"forge / hf: {forge_mb / hf['mb_per_s']:.1f}x (one string), {forge_mb / hf['lines_mb_per_s']:.1f}x (hf by lines)")
PY
fi
rm -rf "$out"
