#include "forge/kernels/cuda/cuda_kernels.h"

namespace forge {
namespace ops {

const OpTable& cuda_table() {
  static const OpTable table = {
      "cuda",
      cuda::gemm,
      cuda::fp8_gemm,
      cuda::rmsnorm_forward,
      cuda::rmsnorm_backward_input,
      cuda::rmsnorm_backward_weight,
      cuda::rope,
      cuda::swiglu_forward,
      cuda::swiglu_backward,
      cuda::attention_forward,
      cuda::attention_backward,
      cuda::embedding_forward,
      cuda::embedding_backward_weight,
      cuda::linear_cross_entropy_forward,
      cuda::linear_cross_entropy_backward,
      cuda::adamw,
      cuda::add_inplace,
      cuda::sum_squares,
      cuda::sum_squares_accumulate,
      cuda::scale_inplace,
      cuda::convert_to_bf16,
      cuda::convert_to_f32,
      cuda::amax,
      cuda::amax_to,
      cuda::fp8_cast_transpose,
      cuda::fp8_quantize_1x128,
      cuda::fp8_quantize_128x128,
      cuda::kv_append,
  };
  return table;
}

}  // namespace ops
}  // namespace forge
