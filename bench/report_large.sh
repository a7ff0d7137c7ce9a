#!/usr/bin/env bash
# forge report on a large run: writes a metrics.jsonl of LINES logged steps (default 1,000,000; every field a
# real run writes, plus an evaluation every 1000 steps) into a scratch folder, then times `forge report` on it
# and prints the page's size. Usage: bench/report_large.sh [BUILD_DIR]   (LINES=... to change the size)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FORGE=${1:-build}/bin/forge
LINES=${LINES:-1000000}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/metrics.jsonl" "$LINES" <<'PY'
import json, math, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for s in range(1, int(sys.argv[2]) + 1):
        f.write(json.dumps({"elapsed_s": s * 0.1, "grad_norm": 0.5 + random.random() * 0.1,
                            "loss": 3 + 4 / math.sqrt(s) + random.random() * 0.1, "lr": 0.003,
                            "mfu": 0.4 + random.random() * 0.05, "peak_memory_bytes": 142606336.0, "step": s,
                            "tflops": 0.17, "tokens": s * 2048, "tokens_per_s": 16000 + random.random() * 1000}) + "\n")
        if s % 1000 == 0:
            f.write(json.dumps({"step": s, "eval_loss": 3 + 4 / math.sqrt(s), "eval_bits_per_byte": 1.5}) + "\n")
PY
echo "metrics.jsonl: $(du -h "$dir/metrics.jsonl" | cut -f1), $LINES logged steps"
"$FORGE" report "$dir" -o "$dir/report.html"
