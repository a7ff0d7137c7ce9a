#!/usr/bin/env bash
# Installs the Debian packages forge needs to build, run its default job and test.
# Idempotent: quiet and fast when everything is present. Run as root (or with sudo available).
#   scripts/install-deps.sh          build + run + test dependencies
#   scripts/install-deps.sh --bench  also PyTorch (python3-torch), the peer of bench/ and tests/reference/
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libdnnl-dev                       # oneDNN: CPU GEMM
  libgtest-dev libgmock-dev         # tests
  libbenchmark-dev                  # micro-benchmarks
  libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libfmt-dev zlib1g-dev
  libpcre2-dev                      # tokenizer pre-tokenizer patterns (Unicode properties, JIT)
  libicu-dev                        # tokenizer normalizers (NFC, NFKC, ...)
  libopenmpi-dev openmpi-bin        # multi-process runs and their tests (mpirun)
  bible-kjv                         # the default corpus
  chromium libpng-dev               # the report's browser test: headless Chromium renders it, libpng reads the screenshot
  libjpeg62-turbo-dev               # image decoding for multimodal data (with libpng-dev above)
)
if [[ "${1:-}" == "--bench" ]]; then
  packages+=(python3-torch python3-numpy python3-pil libopenblas0-pthread)  # OpenBLAS: PyTorch fp32 otherwise runs on reference BLAS; PIL: tests/reference/image_twin.py
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
