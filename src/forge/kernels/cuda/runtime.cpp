#include "forge/kernels/cuda/runtime.h"

#include "forge/core/error.h"

namespace forge::cuda {

bool available() {
  static const bool usable = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no driver" / "no device" error
      return false;
    }
    return count > 0;
  }();
  return usable;
}

int compute_capability() {
  if (!available()) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return 0;
  return prop.major * 10 + prop.minor;
}

int device_count() {
  if (!available()) return 0;
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

namespace {
bool g_stream_created = false;
}  // namespace

void select_device(int ordinal) {
  const int count = device_count();
  if (ordinal < 0 || ordinal >= count)
    fail("select_device: device {} does not exist ({} visible: {})", ordinal, count, describe_device());
  int current = 0;
  FORGE_CUDA_CHECK(cudaGetDevice(&current));
  if (g_stream_created && current != ordinal)
    fail("select_device: device {} requested after this process started using device {}", ordinal, current);
  FORGE_CUDA_CHECK(cudaSetDevice(ordinal));
}

std::string describe_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no usable GPU ({})", cudaGetErrorString(e));
  }
  if (count == 0) return "no GPU visible";
  cudaDeviceProp prop{};
  FORGE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB){}", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                     static_cast<double>(prop.totalGlobalMem) / (1 << 30),
                     count > 1 ? fmt::format(", {} devices", count) : std::string());
}

cudaStream_t stream() {
  static cudaStream_t s = [] {
    if (!available()) fail("no usable GPU: {}", describe_device());
    cudaStream_t created = nullptr;
    FORGE_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    g_stream_created = true;
    return created;
  }();
  return s;
}

void synchronize() { FORGE_CUDA_CHECK(cudaStreamSynchronize(stream())); }

void fail_cuda(cudaError_t error, const char* what, const char* file, int line) {
  fail("CUDA error in {} ({}:{}): {}: {}", what, file, line, cudaGetErrorName(error), cudaGetErrorString(error));
}

void fail_message(const std::string& message) { throw Error(message); }

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (!available()) fail("DeviceBuffer of {} bytes: no usable GPU ({})", bytes, describe_device());
  FORGE_CUDA_CHECK(cudaMalloc(&data_, bytes == 0 ? 1 : bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr, other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = other.data_, bytes_ = other.bytes_;
    other.data_ = nullptr, other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes) {
  FORGE_CHECK(bytes <= bytes_, "DeviceBuffer::upload: {} bytes into a buffer of {}", bytes, bytes_);
  FORGE_CUDA_CHECK(cudaMemcpyAsync(data_, host, bytes, cudaMemcpyHostToDevice, stream()));
  synchronize();
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  FORGE_CHECK(bytes <= bytes_, "DeviceBuffer::download: {} bytes from a buffer of {}", bytes, bytes_);
  FORGE_CUDA_CHECK(cudaMemcpyAsync(host, data_, bytes, cudaMemcpyDeviceToHost, stream()));
  synchronize();
}

void DeviceBuffer::zero() {
  FORGE_CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes_, stream()));
  synchronize();
}

}  // namespace forge::cuda
