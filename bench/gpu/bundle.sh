#!/usr/bin/env bash
# Packs the GPU run's binaries, built here, with the shared libraries they load that a CUDA image may lack
# (oneDNN, fmt, toml++, pcre2, OpenMPI, ...), for run_all.sh's PREBUILT mode on a machine without forge's build
# dependencies. The C/C++ runtime and CUDA's own libraries (driver, cudart, cuBLAS, NCCL) are left to the
# device's image. Binaries are stripped; the bundle must stay under the device tool's 64 MiB carry limit.
#   bench/gpu/bundle.sh [BUILD_DIR (build-gpu)] [BUNDLE_DIR (build-gpubundle)]
# It also writes BUNDLE_DIR.tgz (oneDNN alone is about 40 MiB, so the folder itself is over the device tool's
# 64 MiB carry limit; the tarball is about a third of that): with the device tool carry [BUNDLE_DIR.tgz], command
# "PREBUILT=BUNDLE_DIR bench/gpu/run_all.sh ..." (run_all.sh unpacks BUNDLE_DIR.tgz where the folder is absent).
# Build BUILD_DIR portable (-DFORGE_NATIVE=OFF): -march=native code from this machine may not run on the
# device's CPU. Built on Debian 12 (glibc 2.36): the device image needs a glibc at least that new.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
BUNDLE=${2:-build-gpubundle}
case $BUNDLE in build*) ;; *) echo "bundle.sh: BUNDLE_DIR must start with 'build' (git-ignored, so it can be carried)"; exit 1 ;; esac
bins=("$BUILD/tests/test_cuda" "$BUILD/bin/forge" "$BUILD/bin/forge_gpubench" "$BUILD/bin/forge_gpubench_attention"
  "$BUILD/bin/forge_gpubench_fp8block" "$BUILD/bin/forge_gpubench_fp8cast")
[[ -x $BUILD/tests/test_comm_nccl ]] && bins+=("$BUILD/tests/test_comm_nccl")
for b in "${bins[@]}"; do [[ -x $b ]] || { echo "bundle.sh: $b is missing (build it first)"; exit 1; }; done
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for b in "${bins[@]}"; do strip -o "$BUNDLE/bin/$(basename "$b")" "$b"; done
ldd "${bins[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$BUNDLE/lib/"; done
strip --strip-unneeded "$BUNDLE"/lib/*.so* 2>/dev/null || true
ls -la "$BUNDLE/bin" "$BUNDLE/lib"
tar czf "$BUNDLE.tgz" "$BUNDLE"
size=$(du -sm "$BUNDLE.tgz" | cut -f1)
echo "bundle: $BUNDLE ($(du -sm "$BUNDLE" | cut -f1) MiB), $BUNDLE.tgz ${size} MiB"
((size < 50)) || echo "bundle.sh: WARNING: ${size} MiB is too close to the 64 MiB carry limit (working tree included)"
