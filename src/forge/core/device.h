// Memory of a device other than the host, as the core sees it. Tensor storage on a device is allocated,
// zeroed and copied through this interface; the device's backend (kernels/cuda for Device::cuda) provides it,
// so the core includes no vendor header and a binary without that backend fails with one line when a tensor
// is asked for there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "forge/core/tensor.h"

namespace forge {

struct DeviceMemory {
  const char* name;              // "cuda"
  void* (*alloc)(size_t bytes);  // never null for bytes > 0: throws forge::Error instead
  void (*free)(void* ptr);
  void (*zero)(void* ptr, size_t bytes);  // ordered with the device's kernels
  // Either side may be host or device memory. Ordered with the device's kernels; returns once a host
  // destination holds the data and once a host source may be reused.
  void (*copy)(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
  void (*synchronize)();  // waits for all of the device's queued work
  // One device per process: how many this process sees, choosing one (before the first allocation), and the
  // stream its kernels run on (a cudaStream_t for CUDA), for communicators that must wait for that work.
  int (*device_count)();
  void (*select_device)(int ordinal);
  void* (*stream)();
  // Peak bytes allocated on the device since the last reset_peak() (activation memory of a step).
  int64_t (*peak_allocated)();
  void (*reset_peak)();
  // Page-locks (pins) a host range for fast copies to and from the device (CUDA: cudaHostRegister), and
  // releases it; for host buffers that stay and move every step (an offloaded optimizer's state). A pinned
  // range must be unpinned before it is freed.
  void (*pin_host)(void* ptr, size_t bytes);
  void (*unpin_host)(void* ptr);
};

// The device's memory interface; fails with one line when its backend is not built into this binary.
const DeviceMemory& device_memory(Device device);
// Replaces the memory interface of a (non-host) device, null to restore its backend's: how the device
// emulation of kernels/emulated_device.h runs a device's code paths on a machine without one. The device is
// then usable. Returns the replacement it displaces (null: none), so that overrides nest (the op profiler
// times copies and memsets this way, over the backend's interface or an emulation's). Not thread-safe with
// respect to running work: install before, remove after.
const DeviceMemory* override_device_memory(Device device, const DeviceMemory* memory);
// Whether the device's backend is built in and a device is usable (false for the CPU: it needs no backend).
bool device_usable(Device device);
const char* device_name(Device device);
// "cpu" or "cuda"; anything else fails naming the value.
Device device_from_name(std::string_view name);

}  // namespace forge
