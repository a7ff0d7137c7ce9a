#include "forge/kernels/cuda/cuda_kernels.h"

namespace forge {
namespace cuda {
namespace {
[[noreturn]] void not_yet(const char* op) {
  fail("{} is not implemented on the CUDA backend yet (run it on the CPU backend)", op);
}
}  // namespace

void attention_forward(const ops::AttentionParams&) { not_yet("attention_forward"); }
void attention_backward(const ops::AttentionParams&) { not_yet("attention_backward"); }
void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams&) { not_yet("linear_cross_entropy_forward"); }
void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams&) { not_yet("linear_cross_entropy_backward"); }

}  // namespace cuda

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
      cuda::scale_inplace,
  };
  return table;
}

}  // namespace ops
}  // namespace forge
