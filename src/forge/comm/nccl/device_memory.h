// Device memory for the nccl backend's tests and benchmark, so that they need no CUDA headers (the CUDA
// kernel layer will bring its own allocator). Without NCCL, device_count() is 0 and the others fail.
#pragma once

#include <cstdint>

namespace forge::comm::nccl {

int device_count();  // CUDA devices visible to this process (0 without a driver or device)
void* device_alloc(int64_t bytes);
void device_free(void* ptr);
void copy_to_device(void* device_dst, const void* host_src, int64_t bytes);
void copy_to_host(void* host_dst, const void* device_src, int64_t bytes);

}  // namespace forge::comm::nccl
