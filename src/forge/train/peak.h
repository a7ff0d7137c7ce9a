// The machine's measured GEMM peak, the denominator of MFU on CPU (DESIGN.md, Performance accounting).
#pragma once

#include "forge/core/dtype.h"

namespace forge::train {

// Dense tensor-core peaks of the H100/H200 (SXM), in GFLOP/s: the MFU denominators of GPU runs.
constexpr double kHopperBf16PeakGflops = 989e3, kHopperFp8PeakGflops = 1979e3;

// GFLOP/s of a large square GEMM (fp32 or bf16 operands, fp32 accumulate) through the op table, best of
// a few repetitions after a warm-up. Takes well under a second on this class of CPU.
double measure_gemm_peak_gflops(DType dtype, int64_t size = 2048, int repetitions = 4);

}  // namespace forge::train
