#!/usr/bin/env bash
# FP8 convergence study: trains the default model (configs/default.toml) once per precision setting — BF16
# and each FP8 scaling recipe — for the same number of steps on the same data and seed, then compares the
# final held-out losses with bench/fp8/report.py (report.md: the table and the verdict) and draws every curve
# with `forge report` (report.html, and charts/*.svg for report.md).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bench/fp8/convergence.sh [BUILD_DIR]        (BUILD_DIR defaults to build; run from anywhere)

Trains configs/default.toml once per setting, then writes the comparison: bench/fp8/report.py the table
(REPORT_DIR/report.md), forge report the page of every run overlaid (REPORT_DIR/report.html) and its charts
(REPORT_DIR/charts/*.svg, shown in report.md). The settings:
  bf16         --set fp8.recipe=off       (the baseline)
  delayed      --set fp8.recipe=delayed
  current      --set fp8.recipe=current
  block        --set fp8.recipe=block
  bf16-seed2   --set fp8.recipe=off --set model.seed=4321   (the noise floor: bf16 from another init)
  block-acc14  --set fp8.recipe=block --set fp8.accumulator_bits=14   (not run by default: the H100
               tensor cores' ~14-bit accumulator, promoted to fp32 every 128 elements of K)

Environment:
  STEPS=2000            optimizer steps per run
  EVAL_EVERY=250        held-out evaluation every this many steps
  OUT=runs/fp8-convergence
                        one run directory per setting: OUT/<name>/{metrics.jsonl,train.log,...}
  RECIPES="bf16 delayed current block bf16-seed2"
                        the settings to train (a space-separated list of the names above)
  EXTRA=""              extra arguments appended to every forge command, e.g. "--set train.threads=8"
  FORCE=1               retrain runs that already finished (by default a run whose metrics.jsonl has a
                        final record is skipped, and an interrupted one resumes from its checkpoint)
  REPORT_DIR=docs/fp8-convergence
                        where report.md, report.html and charts/ go
  TOLERANCE=0.01        allowed relative difference of the final held-out loss from bf16

Exit status: 0 when every run finished within tolerance of bf16, else non-zero (see report.md).
USAGE
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  -*) echo "convergence.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
if (($# > 1)); then
  echo "convergence.sh: expected at most one argument, BUILD_DIR (see --help)" >&2
  exit 2
fi

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUILD_DIR=${1:-build}
FORGE=$BUILD_DIR/bin/forge
STEPS=${STEPS:-2000}
EVAL_EVERY=${EVAL_EVERY:-250}
OUT=${OUT:-runs/fp8-convergence}
RECIPES=${RECIPES:-bf16 delayed current block bf16-seed2}
EXTRA=${EXTRA:-}
FORCE=${FORCE:-0}
REPORT_DIR=${REPORT_DIR:-docs/fp8-convergence}
TOLERANCE=${TOLERANCE:-0.01}

for value in "$STEPS" "$EVAL_EVERY"; do
  if ! [[ $value =~ ^[0-9]+$ ]]; then
    echo "convergence.sh: STEPS and EVAL_EVERY must be non-negative integers, got '$value'" >&2
    exit 2
  fi
done
if ((STEPS == 0)); then
  # train.steps=0 would mean "as many as fit in max_minutes", and max_minutes=0 means no limit.
  echo "convergence.sh: STEPS must be positive" >&2
  exit 2
fi

# The overrides of each setting (space-separated section.key=value).
declare -A SETTING=([bf16]="fp8.recipe=off" [delayed]="fp8.recipe=delayed" [current]="fp8.recipe=current"
  [block]="fp8.recipe=block" [bf16-seed2]="fp8.recipe=off model.seed=4321"
  [block-acc14]="fp8.recipe=block fp8.accumulator_bits=14")
read -r -a recipes <<<"$RECIPES"
if ((${#recipes[@]} == 0)); then
  echo "convergence.sh: RECIPES is empty" >&2
  exit 2
fi
for name in "${recipes[@]}"; do
  if [[ -z ${SETTING[$name]+set} ]]; then
    echo "convergence.sh: unknown setting '$name' in RECIPES (expected some of: ${!SETTING[*]})" >&2
    exit 2
  fi
done
read -r -a extra <<<"$EXTRA"

# A run is done when its last held-out evaluation (the record marked "final") was written.
finished() {
  [[ -f $1/metrics.jsonl ]] && grep -Eq '"final" *: *true' "$1/metrics.jsonl"
}

# Let a Ctrl-C reach forge (it saves a checkpoint and exits with 130), then stop the study instead of
# starting the next run. tee -i keeps logging while forge writes its last lines.
trap 'echo "convergence.sh: interrupted; rerun the same command to resume" >&2; exit 130' INT

failed=()
for name in "${recipes[@]}"; do
  run_dir=$OUT/$name
  if [[ $FORCE != 1 ]] && finished "$run_dir"; then
    echo "== $name: already finished ($run_dir/metrics.jsonl has a final record; FORCE=1 retrains)"
    continue
  fi
  if [[ ! -x $FORGE ]]; then
    echo "convergence.sh: $FORGE not found or not executable (build it, or pass BUILD_DIR)" >&2
    exit 2
  fi
  mkdir -p "$run_dir"
  # Without FORCE an interrupted run continues from the checkpoint Ctrl-C saved (metrics.jsonl is appended
  # to, and report.py keeps the last record of each step); with FORCE the run starts over.
  resume=(--set checkpoint.resume=auto)
  [[ $FORCE == 1 ]] && resume=() && rm -f "$run_dir/train.log"
  overrides=()
  for assignment in ${SETTING[$name]}; do overrides+=(--set "$assignment"); done
  cmd=("$FORGE" train --config configs/default.toml "${overrides[@]}"
    --set "train.steps=$STEPS" --set train.max_minutes=0 --set "eval.every=$EVAL_EVERY"
    --set sample.tokens=0 --set checkpoint.every=0 --set log.every=10 --set "log.run_dir=$run_dir"
    "${resume[@]}" "${extra[@]}")
  echo "== $name: $STEPS steps -> $run_dir"
  printf '$ %s\n' "${cmd[*]}" >>"$run_dir/train.log"
  status=0
  "${cmd[@]}" 2>&1 | tee -i -a "$run_dir/train.log" || status=$?
  if ((status != 0)); then
    echo "convergence.sh: run '$name' failed with status $status (see $run_dir/train.log)" >&2
    failed+=("$name")
  fi
done

report_status=0
python3 bench/fp8/report.py "$OUT" --baseline bf16 --out "$REPORT_DIR" --tolerance "$TOLERANCE" || report_status=$?
# Every run in OUT that has metrics (as report.py takes them), bf16 first: the baseline the others are drawn
# against.
report_runs=()
[[ -f $OUT/bf16/metrics.jsonl ]] && report_runs+=("$OUT/bf16")
for dir in "$OUT"/*/; do
  dir=${dir%/}
  [[ -f $dir/metrics.jsonl && $dir != "$OUT/bf16" ]] && report_runs+=("$dir")
done
if ((${#report_runs[@]} > 0)); then
  baseline=()
  [[ -f $OUT/bf16/metrics.jsonl ]] && baseline=(--baseline bf16)
  "$FORGE" report "${report_runs[@]}" "${baseline[@]}" --title "FP8 convergence: recipes vs BF16" \
    --output "$REPORT_DIR/report.html" --svg-dir "$REPORT_DIR/charts" || report_status=$?
fi
if ((${#failed[@]} > 0)); then
  echo "convergence.sh: failed runs: ${failed[*]}" >&2
  ((report_status != 0)) || report_status=1
fi
exit "$report_status"
