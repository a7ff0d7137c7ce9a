#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/profiler.h"

namespace forge::ops {

const OpTable& cpu_table() {
#define FORGE_CPU_ENTRY(name, result, params, args) .name = cpu::name, .supports_##name = cpu::supports_##name,
  static const OpTable table = {.name = "cpu", FORGE_OPS(FORGE_CPU_ENTRY)};
#undef FORGE_CPU_ENTRY
  return table;
}

const char* op_name(OpId id) {
  static const char* const kNames[] = {
#define FORGE_OP_NAME(name, result, params, args) #name,
      FORGE_OPS(FORGE_OP_NAME)
#undef FORGE_OP_NAME
  };
  return kNames[static_cast<int>(id)];
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
