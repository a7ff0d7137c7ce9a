// Device memory for the CUDA backend: one process-wide CachingAllocator (core/caching_allocator.h) over
// cudaMalloc / cudaFree, stream-ordered on cuda::stream(), the stream every op runs on. A block freed here
// is reused by later work on that stream without synchronisation; memory is returned to the driver only by
// empty_cache() or when an allocation would otherwise run out (cudaFree synchronises the device).
#pragma once

#include <cstddef>

#include "forge/core/caching_allocator.h"

namespace forge::cuda {

// At least `bytes` of device memory (256-byte aligned, as cudaMalloc's), for work on cuda::stream(); nullptr
// for 0 bytes. Throws forge::Error when no GPU is usable or the device is out of memory.
void* device_alloc(size_t bytes);
// Returns a pointer from device_alloc (nullptr is ignored; anything else throws forge::Error).
void device_free(void* ptr);
// Releases the cached blocks to the driver.
void empty_cache();
CachingAllocatorStats allocator_stats();
void reset_peak_allocated();

}  // namespace forge::cuda
