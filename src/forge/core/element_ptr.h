// A pointer to activations that knows their element type: fp32, or bf16 (its bits as uint16_t). Kernel
// parameters that take either dtype hold these, so callers keep writing `p.q = qkv.f32()` or
// `p.q = qkv.bf16()` and `p.k = p.q + offset` (arithmetic steps whole elements of the pointer's type), and
// a kernel asks dtype() once and reads through f32() or bf16(), which give null for the other type (so a
// kernel that forgot to dispatch fails at once instead of reading the wrong bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "forge/core/dtype.h"

namespace forge {

template <bool kConst>
class ElementPtr {
  template <typename T>
  using Maybe = std::conditional_t<kConst, const T, T>;

 public:
  ElementPtr() = default;
  ElementPtr(std::nullptr_t) {}  // NOLINT(google-explicit-constructor): as a raw pointer's null
  ElementPtr(Maybe<float>* p) : data_(p), dtype_(DType::f32) {}      // NOLINT(google-explicit-constructor)
  ElementPtr(Maybe<uint16_t>* p) : data_(p), dtype_(DType::bf16) {}  // NOLINT(google-explicit-constructor)
  // A writable pointer passes where a read-only one is asked for.
  template <bool kOther, typename = std::enable_if_t<kConst && !kOther>>
  ElementPtr(const ElementPtr<kOther>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.get()), dtype_(other.dtype()) {}

  DType dtype() const { return dtype_; }
  Maybe<void>* get() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }
  Maybe<float>* f32() const { return dtype_ == DType::f32 ? static_cast<Maybe<float>*>(data_) : nullptr; }
  Maybe<uint16_t>* bf16() const {
    return dtype_ == DType::bf16 ? static_cast<Maybe<uint16_t>*>(data_) : nullptr;
  }

  ElementPtr operator+(int64_t elements) const {
    ElementPtr p = *this;
    if (data_) p.data_ = static_cast<Maybe<char>*>(data_) + elements * (dtype_ == DType::f32 ? 4 : 2);
    return p;
  }
  friend bool operator==(const ElementPtr& a, const ElementPtr& b) { return a.data_ == b.data_; }

 private:
  Maybe<void>* data_ = nullptr;
  DType dtype_ = DType::f32;
};

using ConstElements = ElementPtr<true>;  // read-only activations
using Elements = ElementPtr<false>;      // written activations

// f(typed pointer) for an fp32 or bf16 pointer (const float* / const uint16_t*, or the writable ones): nest
// them to instantiate a kernel for every combination of its tensors' dtypes (both backends' host code).
template <bool kConst, typename F>
void visit(ElementPtr<kConst> p, F&& f) {
  if (p.dtype() == DType::bf16)
    f(p.bf16());
  else
    f(p.f32());
}

}  // namespace forge
