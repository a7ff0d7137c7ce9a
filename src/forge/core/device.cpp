#include "forge/core/device.h"

#include <utility>

namespace forge {

#ifdef FORGE_HAVE_CUDA
namespace cuda {
// Defined by the CUDA backend (kernels/cuda/device_allocator.cpp).
const DeviceMemory& device_memory_interface();
bool device_memory_usable();
}  // namespace cuda
#endif

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

Device device_from_name(std::string_view name) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda") return Device::cuda;
  fail("unknown device '{}' (expected cpu or cuda)", name);
}

namespace {
const DeviceMemory* g_override = nullptr;  // Device::cuda's replacement (one non-host device kind exists)
}  // namespace

const DeviceMemory* override_device_memory(Device device, const DeviceMemory* memory) {
  FORGE_CHECK(device != Device::cpu, "override_device_memory: the host's memory has no device interface");
  return std::exchange(g_override, memory);
}

const DeviceMemory& device_memory(Device device) {
  FORGE_CHECK(device != Device::cpu, "device_memory: the host's memory needs no device interface");
  if (g_override) return *g_override;
#ifdef FORGE_HAVE_CUDA
  return cuda::device_memory_interface();
#else
  fail("{} tensors need the CUDA backend, which this binary was built without (configure with -DFORGE_CUDA=ON "
       "where nvcc is installed)",
       device_name(device));
#endif
}

bool device_usable(Device device) {
  if (device == Device::cpu || g_override) return true;
#ifdef FORGE_HAVE_CUDA
  return cuda::device_memory_usable();
#else
  return false;
#endif
}

}  // namespace forge
