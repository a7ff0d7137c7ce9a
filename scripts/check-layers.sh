#!/usr/bin/env bash
# The layering rule of docs/architecture.md: a source file under src/forge/<layer>/ includes headers of its
# own layer and of the layers it may use (the table below, closed transitively), never of a layer above; a
# module never reaches into a kernel backend (kernels/cpu, kernels/cuda) outside kernels/, and the backends
# do not include each other; models/ and nn/ carry no backend #ifdef. Prints one line per violation and exits
# non-zero when there is any.
#   scripts/check-layers.sh [ROOT]     check ROOT (default: the repository this script is in)
#   scripts/check-layers.sh --self-test   check that an upward include is caught
set -euo pipefail

# layer: the layers it may use directly (docs/architecture.md).
declare -A USES=(
  [core]=""
  [fp8]="core"
  [kernels]="core fp8"
  [comm]="core"
  [nn]="core fp8 kernels"
  [optim]="core kernels"
  [parallel]="core kernels comm nn optim"
  [data]="core"
  [ckpt]="core comm"
  [models]="nn parallel ckpt"
  [sim]="core parallel models"
  [train]="core fp8 kernels comm nn optim parallel models data ckpt sim report"
  [report]="core parallel"
)

# The transitive closure of USES for one layer.
closure() {
  local -A seen=()
  local queue=($1) layer dep
  while ((${#queue[@]})); do
    layer=${queue[0]}
    queue=("${queue[@]:1}")
    for dep in ${USES[$layer]:-}; do
      if [[ -z ${seen[$dep]:-} ]]; then
        seen[$dep]=1
        queue+=("$dep")
      fi
    done
  done
  echo "${!seen[@]}"
}

check() {
  local root=$1 violations=0 file layer target allowed line
  local -A allowed_of=()
  for layer in "${!USES[@]}"; do allowed_of[$layer]=" $layer $(closure "$layer") "; done
  while IFS= read -r file; do
    layer=${file#"$root"/src/forge/}
    layer=${layer%%/*}
    if [[ -z ${allowed_of[$layer]:-} ]]; then
      echo "$file: folder src/forge/$layer/ is not a layer of the table in scripts/check-layers.sh"
      violations=$((violations + 1))
      continue
    fi
    allowed=${allowed_of[$layer]}
    while IFS= read -r line; do
      target=${line#*\"forge/}
      target=${target%%/*}
      if [[ $allowed != *" $target "* ]]; then
        echo "$file: includes forge/$target/ (layer '$layer' may use: ${USES[$layer]:-nothing})"
        violations=$((violations + 1))
      fi
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]+"forge/' "$file" || true)
    # Backends: only kernels/ reaches into them, and they do not reach into each other.
    while IFS= read -r line; do
      target=$(sed -E 's/.*"forge\/kernels\/(cpu|cuda)\/.*/\1/' <<<"$line")
      if [[ $layer != kernels ]] || [[ $file == */kernels/cpu/* && $target == cuda ]] ||
         [[ $file == */kernels/cuda/* && $target == cpu ]]; then
        echo "$file: includes the $target backend directly (call the op table, kernels/ops.h)"
        violations=$((violations + 1))
      fi
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]+"forge/kernels/(cpu|cuda)/' "$file" || true)
    if [[ $layer == nn || $layer == models ]] && grep -qE '^[[:space:]]*#[[:space:]]*if.*(CUDA|__CUDACC__)' "$file"; then
      echo "$file: a backend #if in $layer/ (backends are sibling folders of kernels/)"
      violations=$((violations + 1))
    fi
  done < <(find "$root/src/forge" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sort)
  if ((violations)); then
    echo "layering: $violations violation(s)"
    return 1
  fi
  echo "layering: every include of $(find "$root/src/forge" -type f | wc -l) files points down"
}

self_test() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/src/forge/core" "$tmp/src/forge/train" "$tmp/src/forge/nn"
  printf '#include "forge/core/tensor.h"\n' >"$tmp/src/forge/nn/ok.h"
  printf '#pragma once\n' >"$tmp/src/forge/train/trainer.h"
  check "$tmp" >/dev/null || { echo "self-test: a clean tree was refused"; return 1; }
  printf '#include "forge/train/trainer.h"\n' >"$tmp/src/forge/core/upward.h"
  local out
  if out=$(check "$tmp"); then
    echo "self-test: an upward include (core -> train) was not caught"
    return 1
  fi
  [[ $out == *"core/upward.h: includes forge/train/"* ]] || { echo "self-test: unexpected report: $out"; return 1; }
  echo "self-test: the upward include core -> train is caught:"
  echo "$out" | head -1
}

if [[ ${1:-} == --self-test ]]; then
  self_test
else
  check "$(cd "${1:-$(dirname "$0")/..}" && pwd)"
fi
