// The machine's measured GEMM peak, the denominator of MFU on CPU (DESIGN.md, Performance accounting).
#pragma once

#include "forge/core/dtype.h"

namespace forge {

// GFLOP/s of a large square GEMM (fp32 or bf16 operands, fp32 accumulate) through the op table, best of
// a few repetitions after a warm-up. Takes well under a second on this class of CPU.
double measure_gemm_peak_gflops(DType dtype, int64_t size = 2048, int repetitions = 4);

}  // namespace forge
