#include "forge/kernels/cuda/cuda_kernels.h"

namespace forge::ops {

const OpTable& cuda_table() {
#define FORGE_CUDA_ENTRY(name, result, params, args) .name = cuda::name, .supports_##name = cuda::supports_##name,
  static const OpTable table = {.name = "cuda", FORGE_OPS(FORGE_CUDA_ENTRY)};
#undef FORGE_CUDA_ENTRY
  return table;
}

}  // namespace forge::ops
