#include "forge/core/tensor.h"

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "forge/core/device.h"
#include "forge/core/memory.h"

namespace forge {

std::string shape_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {
std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};

// Activations are allocated and freed every micro-batch. glibc would hand large blocks back to the
// kernel (mmap/munmap) and page-fault them in again each step; keeping them in the heap makes reuse free.
const bool g_malloc_tuned = [] {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();
}  // namespace

namespace {
std::atomic<int64_t> g_limit_bytes{0};
std::string g_limit_setting;  // changed only between runs, never while tensors are allocated concurrently
constexpr double kMiB = 1048576.0;
}  // namespace

void set_host_memory_limit(int64_t bytes, std::string setting) {
  g_limit_bytes.store(bytes > 0 ? bytes : 0);
  g_limit_setting = std::move(setting);
}
int64_t host_memory_limit() { return g_limit_bytes.load(); }

ScopedHostMemoryLimit::ScopedHostMemoryLimit(int64_t bytes, std::string setting)
    : previous_(g_limit_bytes.load()), previous_setting_(g_limit_setting) {
  set_host_memory_limit(bytes, std::move(setting));
}
ScopedHostMemoryLimit::~ScopedHostMemoryLimit() { set_host_memory_limit(previous_, previous_setting_); }

MemoryStats memory_stats() { return {g_live_bytes.load(), g_peak_bytes.load()}; }
void reset_peak_memory() { g_peak_bytes.store(g_live_bytes.load()); }

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (device != Device::cpu) {
    // Device memory is counted by its backend's allocator (kernels/cuda/device_allocator.h).
    data_ = bytes == 0 ? nullptr : device_memory(device).alloc(bytes);
    return;
  }
  size_t rounded = (bytes + 63) / 64 * 64;
  data_ = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!data_) throw OutOfMemory(fmt::format("out of memory allocating {} bytes", bytes));
  int64_t live = g_live_bytes.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  if (const int64_t limit = g_limit_bytes.load(); limit > 0 && live > limit) {
    g_live_bytes.fetch_sub(static_cast<int64_t>(bytes));
    std::free(data_);
    data_ = nullptr;
    throw OutOfMemory(fmt::format(
        "out of memory: {:.2f} MiB more would take this process's tensors to {:.2f} MiB, over the {:.2f} MiB "
        "limit{}",
        static_cast<double>(bytes) / kMiB, static_cast<double>(live) / kMiB,
        static_cast<double>(limit) / kMiB, g_limit_setting.empty() ? "" : " (" + g_limit_setting + ")"));
  }
  int64_t peak = g_peak_bytes.load();
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
}

Storage::~Storage() {
  if (device_ != Device::cpu) {
    if (data_) device_memory(device_).free(data_);
    return;
  }
  std::free(data_);
  g_live_bytes.fetch_sub(static_cast<int64_t>(bytes_));
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t d : shape)
    if (d < 0) fail("tensor shape {} has a negative dimension", shape_string(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(t.numel()) * dtype_size(dtype), device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.fill_zero();
  return t;
}

float* Tensor::f32() const {
  FORGE_CHECK(dtype_ == DType::f32, "tensor is {}, not fp32", dtype_name(dtype_));
  return data<float>();
}
uint16_t* Tensor::bf16() const {
  FORGE_CHECK(dtype_ == DType::bf16, "tensor is {}, not bf16", dtype_name(dtype_));
  return data<uint16_t>();
}
Elements Tensor::elements() const {
  if (dtype_ == DType::bf16) return data<uint16_t>();
  FORGE_CHECK(dtype_ == DType::f32, "tensor is {}, not fp32 or bf16", dtype_name(dtype_));
  return data<float>();
}
int32_t* Tensor::i32() const {
  FORGE_CHECK(dtype_ == DType::i32, "tensor is {}, not int32", dtype_name(dtype_));
  return data<int32_t>();
}

Tensor Tensor::view(int64_t element_offset, Shape shape) const {
  size_t elem = dtype_size(dtype_);
  size_t end = (element_offset + shape_numel(shape)) * elem;
  FORGE_CHECK(element_offset >= 0 && offset_bytes_ + end <= storage_->bytes(),
              "view {} at offset {} exceeds storage", shape_string(shape), element_offset);
  Tensor t = *this;
  t.offset_bytes_ = offset_bytes_ + element_offset * elem;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  FORGE_CHECK(shape_numel(shape) == numel(), "reshape {} -> {}", shape_string(shape_), shape_string(shape));
  return view(0, std::move(shape));
}

void Tensor::fill_zero() {
  if (bytes() == 0) return;
  if (device() == Device::cpu)
    std::memset(raw(), 0, bytes());
  else
    device_memory(device()).zero(raw(), bytes());
}

void Tensor::copy_from(const Tensor& other) {
  FORGE_CHECK(other.dtype_ == dtype_ && other.numel() == numel(), "copy_from {} {} -> {} {}",
              dtype_name(other.dtype_), shape_string(other.shape_), dtype_name(dtype_), shape_string(shape_));
  if (bytes() == 0) return;
  if (device() == Device::cpu && other.device() == Device::cpu)
    std::memcpy(raw(), other.raw(), bytes());
  else
    device_memory(device() == Device::cpu ? other.device() : device())
        .copy(raw(), device(), other.raw(), other.device(), bytes());
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  if (!defined() || device == this->device()) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

}  // namespace forge
