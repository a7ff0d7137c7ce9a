// Tensor: a typed, row-major, contiguous view into reference-counted storage. forge has no autograd;
// a Tensor is just memory with a shape. Strided access (q/k/v inside a fused qkv buffer) is expressed by
// the kernels' parameter structs, not by the Tensor.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/element_ptr.h"
#include "forge/core/error.h"

namespace forge {

enum class Device : uint8_t { cpu, cuda };

using Shape = std::vector<int64_t>;
std::string shape_string(const Shape& shape);
int64_t shape_numel(const Shape& shape);

// One allocation. CPU storage is 64-byte aligned; device storage comes from the device's backend
// (core/device.h), 256-byte aligned.
class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::cpu;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu);
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu; }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_bytes_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  float* f32() const;
  uint16_t* bf16() const;
  int32_t* i32() const;
  // An fp32 or bf16 tensor's elements, for the kernels that take either (core/element_ptr.h).
  Elements elements() const;

  // A view of `shape` starting `element_offset` elements into this tensor's memory (shares storage).
  Tensor view(int64_t element_offset, Shape shape) const;
  Tensor reshape(Shape shape) const;
  void fill_zero();
  // Same dtype and numel; either may live on any device (a copy to the host returns once the data is there).
  void copy_from(const Tensor& other);
  Tensor clone() const;
  // This tensor when it already lives on `device`, else a copy there.
  Tensor to(Device device) const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace forge
