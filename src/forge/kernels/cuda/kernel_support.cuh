// Helpers shared by the CUDA backend's elementwise, norm, embedding and optimizer kernels (.cu files only):
// host-side parameter checks, launch sizing, scratch memory and a fixed-order block sum.
//
// Determinism: forge promises bitwise-reproducible results, so nothing here uses floating-point atomics or
// sizes a reduction by the device's SM count; every summation order is a function of the problem size alone.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "forge/core/element_ptr.h"
#include "forge/kernels/cuda/device_allocator.h"
#include "forge/kernels/cuda/runtime.h"

namespace forge::cuda::detail {

constexpr int kWarpSize = 32;

// Host side. fail_message rather than forge::fail: nvcc cannot compile fmt's format checks (runtime.h).
// Callers test first and build the message only on failure: checks run on every launch.
[[noreturn]] inline void fail_op(const char* op, const std::string& what) {
  fail_message(std::string(op) + ": " + what);
}
// For the support predicates (OpTable::supports_<op>): a refusal, "op: what" into *reason when one is asked for,
// and false. A kernel runs its own predicate first:
//   if (std::string why; !supports_op(p, &why)) fail_message(why);
inline bool refuse(std::string* reason, const char* op, const std::string& what) {
  if (reason) *reason = std::string(op) + ": " + what;
  return false;
}
inline bool pointer_set(const void* pointer, const char* op, const char* name, std::string* reason) {
  return pointer != nullptr || refuse(reason, op, std::string(name) + " is null");
}
inline bool pointer_set(ConstElements pointer, const char* op, const char* name, std::string* reason) {
  return pointer_set(pointer.get(), op, name, reason);
}

// Blocks for a grid-stride loop over n items with `threads` per block. The cap only bounds the launch;
// grid-stride loops make the result independent of it.
inline unsigned grid_blocks(int64_t n, int threads, int64_t max_blocks = int64_t{1} << 16) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + threads - 1) / threads, 1, max_blocks));
}

// Device side: loads and stores of a kernel templated on its tensors' element type, fp32 as it is, bf16 (bits
// in uint16_t) widened on load and rounded once on store with the CPU's integer recipe (core/dtype.h's
// float_to_bf16: nearest even, NaN kept quiet), so both backends write the same bits.
__device__ __forceinline__ float load_element(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_element(const uint16_t* p, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}
__device__ __forceinline__ void store_element(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_element(uint16_t* p, int64_t i, float v) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  p[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}

// Scratch device memory for work on stream(), from the backend's caching allocator (device_allocator.h).
// Blocks are stream-ordered: freeing one as soon as the kernels that use it are queued is safe, since the
// next user of the block runs on the same stream, after them.
class StreamScratch {
 public:
  explicit StreamScratch(size_t bytes) : data_(device_alloc(bytes)) {}
  ~StreamScratch() { device_free(data_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  template <typename T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + byte_offset);
  }

 private:
  void* data_;
};

// Rounds byte counts up so that several arrays can share one scratch allocation with aligned starts.
constexpr size_t align_bytes(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Device side.

// Butterfly sum over a warp. Floating-point addition is commutative, so every lane adds the same two
// operands at every level and all lanes end with the bitwise-same total.
template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Sum of one value per thread over the block, in an order fixed by the thread index; every thread gets the
// total. blockDim.x must be a multiple of 32 (at most 1024) and every thread of the block must call it.
// warp_sums holds blockDim.x / 32 entries of shared memory; it may be reused by the next call.
template <typename T>
__device__ __forceinline__ T block_sum(T value, T* warp_sums) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, warps = blockDim.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  // Every warp reduces the warp sums itself (same operands, same order): no second broadcast barrier.
  T total = lane < warps ? warp_sums[lane] : T(0);
  total = warp_sum(total);
  __syncthreads();  // the next call may overwrite warp_sums
  return total;
}

// exp(x) as cpu::simd_exp computes it, with the FMA pattern g++ gives that code, in two parts: exp(x) = p * scale
// (scale = 2^k), so that callers can fuse the last multiply as the CPU build does (sigmoid's 1 + p * 2^k).
// x is clamped to [-87, 88]; below -87 `underflow` is set and the CPU's result is 0.
struct ExpParts {
  float p, scale;
  bool underflow;
};
__device__ __forceinline__ ExpParts exp_parts_like_cpu(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // x = k ln2 + r; adding and subtracting 1.5 * 2^23 rounds x / ln2 to the nearest integer.
  const float k = __fadd_rn(__fmaf_rn(x, 1.44269504f, 12582912.0f), -12582912.0f);
  float r = __fmaf_rn(-k, 0.693145752f, x);
  r = __fmaf_rn(-k, 1.42860677e-6f, r);
  float p = __fmaf_rn(r, 1.98412698e-4f, 1.38888889e-3f);
  p = __fmaf_rn(p, r, 8.33333333e-3f);
  p = __fmaf_rn(p, r, 4.16666667e-2f);
  p = __fmaf_rn(p, r, 1.66666667e-1f);
  p = __fmaf_rn(p, r, 0.5f);
  p = __fmaf_rn(p, r, 1.0f);
  p = __fmaf_rn(p, r, 1.0f);
  return {p, __int_as_float((static_cast<int>(k) + 127) << 23), underflow};
}

}  // namespace forge::cuda::detail
