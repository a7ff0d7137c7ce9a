#include "forge/kernels/cuda/device_allocator.h"

#include <cstdint>

#include "forge/core/device.h"
#include "forge/kernels/cuda/runtime.h"

namespace forge::cuda {
namespace {

void* raw_cuda_malloc(size_t bytes, void*) {
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, bytes);
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it: the allocator releases its cache and retries
    return nullptr;
  }
  FORGE_CUDA_CHECK(error);
  return ptr;
}

void raw_cuda_free(void* ptr, void*) { FORGE_CUDA_CHECK(cudaFree(ptr)); }

// Created on first use and never destroyed: cudaFree during static destruction may run after the CUDA
// runtime has shut down.
CachingAllocator& allocator() {
  static CachingAllocator* instance =
      new CachingAllocator(AllocatorBackend{raw_cuda_malloc, raw_cuda_free, nullptr, "device"});
  return *instance;
}

}  // namespace

void* device_alloc(size_t bytes) {
  // stream() fails with one line when no GPU is usable.
  return allocator().allocate(bytes, reinterpret_cast<uintptr_t>(stream()));
}

void device_free(void* ptr) { allocator().free(ptr); }

void empty_cache() { allocator().empty_cache(); }

CachingAllocatorStats allocator_stats() { return allocator().stats(); }

void reset_peak_allocated() { allocator().reset_peak(); }

namespace {

void zero_bytes(void* ptr, size_t bytes) { FORGE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream())); }

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  const bool to_host = dst_device == Device::cpu, from_host = src_device == Device::cpu;
  const cudaMemcpyKind kind = to_host ? (from_host ? cudaMemcpyHostToHost : cudaMemcpyDeviceToHost)
                                      : (from_host ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice);
  FORGE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream()));
  // Pageable host memory makes the runtime stage the copy, but only a synchronisation guarantees that a host
  // destination holds the data (and that a host source may be freed) when this returns.
  if (to_host || from_host) synchronize();
}

void pin_host(void* ptr, size_t bytes) {
  FORGE_CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
}
void unpin_host(void* ptr) { FORGE_CUDA_CHECK(cudaHostUnregister(ptr)); }

}  // namespace

const DeviceMemory& device_memory_interface() {
  static const DeviceMemory memory{"cuda",
                                   device_alloc,
                                   device_free,
                                   zero_bytes,
                                   copy_bytes,
                                   synchronize,
                                   device_count,
                                   select_device,
                                   [] { return static_cast<void*>(stream()); },
                                   [] { return allocator_stats().peak_allocated_bytes; },
                                   reset_peak_allocated,
                                   pin_host,
                                   unpin_host};
  return memory;
}

bool device_memory_usable() { return available(); }

}  // namespace forge::cuda
