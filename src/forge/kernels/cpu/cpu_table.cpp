#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/profiler.h"

namespace forge::ops {

const OpTable& cpu_table() {
  static const OpTable table = {
      "cpu",
      cpu::gemm,
      cpu::fp8_gemm,
      cpu::rmsnorm_forward,
      cpu::rmsnorm_backward_input,
      cpu::rmsnorm_backward_weight,
      cpu::rope,
      cpu::swiglu_forward,
      cpu::swiglu_backward,
      cpu::attention_forward,
      cpu::attention_backward,
      cpu::embedding_forward,
      cpu::embedding_backward_weight,
      cpu::linear_cross_entropy_forward,
      cpu::linear_cross_entropy_backward,
      cpu::adamw,
      cpu::add_inplace,
      cpu::sum_squares,
      cpu::sum_squares_accumulate,
      cpu::scale_inplace,
      cpu::convert_to_bf16,
      cpu::convert_to_f32,
      cpu::amax,
      cpu::amax_to,
      cpu::fp8_cast_transpose,
      cpu::fp8_quantize_1x128,
      cpu::fp8_quantize_128x128,
      cpu::kv_append,
  };
  return table;
}

namespace {
const OpTable* g_override = nullptr;  // Device::cuda's replacement (one non-host device kind exists)
}  // namespace

void override_table(Device device, const OpTable* table) {
  FORGE_CHECK(device != Device::cpu, "override_table: the host's table cannot be replaced");
  g_override = table;
}

const OpTable& table(Device device) {
  if (const OpTable* profiled = profiled_table(device)) return *profiled;  // an op profile is open
  if (device == Device::cpu) return cpu_table();
  if (g_override) return *g_override;
#ifdef FORGE_HAVE_CUDA
  if (device == Device::cuda) return cuda_table();
#endif
  fail("no kernel backend is built for this device (CUDA backend not compiled in: configure with -DFORGE_CUDA=ON "
       "where nvcc is installed)");
}

}  // namespace forge::ops
