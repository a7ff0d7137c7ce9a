// Placeholder until the block-scaled FP8 GEMM lands.
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/runtime.h"

namespace forge::cuda {
void fp8_block_gemm(const ops::Fp8GemmParams&) { fail_message("fp8_gemm: block scaling is not implemented on the CUDA backend yet"); }
}  // namespace forge::cuda
