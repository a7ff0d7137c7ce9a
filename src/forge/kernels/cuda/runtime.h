// The CUDA runtime as forge's CUDA backend uses it: whether a GPU is usable, the one compute stream every
// kernel of this process is launched on, error checking that turns a CUDA error into one forge::Error line,
// and DeviceBuffer, an owning device allocation for tests and benchmarks.
//
// Compiled only with FORGE_CUDA (CMake: -DFORGE_CUDA=ON, the default where nvcc is found). The build machine
// needs no GPU: available() is false there (no driver or no device) and the CUDA tests skip.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace forge::cuda {

// True when the driver loads and at least one device is visible (queried once; never throws).
bool available();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)", or why none is usable.
std::string describe_device();
// Compute capability of device 0 as major * 10 + minor (90 for Hopper); 0 when unavailable.
int compute_capability();
// Devices visible to this process (0 when none is usable).
int device_count();
// Makes `ordinal` this process's device (one GPU per process: the local rank's). Must come before the first
// stream(), allocation or kernel; selecting another device afterwards fails with one line.
void select_device(int ordinal);

// The stream every op of this process runs on (created on first use, non-blocking with respect to the
// legacy default stream). Ops are asynchronous: synchronize() before reading results on the host.
cudaStream_t stream();
void synchronize();

// Throws forge::Error "CUDA error in <what> (<file>:<line>): <name>: <description>".
[[noreturn]] void fail_cuda(cudaError_t error, const char* what, const char* file, int line);
// Throws forge::Error with this message. For .cu files: nvcc's front end cannot compile fmt's compile-time
// format checks, so device-code files never call forge::fail / FORGE_CHECK (core/error.h) themselves.
[[noreturn]] void fail_message(const std::string& message);

#define FORGE_CUDA_CHECK(call)                                                         \
  do {                                                                                 \
    const cudaError_t forge_cuda_error_ = (call);                                      \
    if (forge_cuda_error_ != cudaSuccess)                                              \
      ::forge::cuda::fail_cuda(forge_cuda_error_, #call, __FILE__, __LINE__);          \
  } while (0)

// Checks the last kernel launch (launch errors surface here; execution errors at the next synchronisation).
#define FORGE_CUDA_CHECK_LAUNCH(what) FORGE_CUDA_CHECK(cudaPeekAtLastError())

// An owning device allocation (cudaMalloc / cudaFree) with host copies, for tests and benchmarks.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  // Synchronous copies on stream() (they wait for the stream's earlier work).
  void upload(const void* host, size_t bytes);
  void download(void* host, size_t bytes) const;
  void zero();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace forge::cuda
