// The few hardware primitives the attention kernels are written in: bf16 packing, ldmatrix, the bf16
// tensor-core MMA (mma.sync m16n8k16, fp32 accumulation), cp.async copies into shared memory, and quad
// reductions. Everything else in attention_*.cuh is plain CUDA C++ over these, so that a host harness can
// stand in for this file (classic include guard, not #pragma once: a harness defines the guard and its own
// versions).
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4; a 32-bit register holds two bf16, the lower-indexed element in the low half:
//   A (16 x 16, row-major) a[0] = (g, 2t..2t+1)  a[1] = (g+8, 2t..)  a[2] = (g, 2t+8..)  a[3] = (g+8, 2t+8..)
//   B (16 x 8, "col")      b[0] = (k 2t..2t+1, n g)                  b[1] = (k 2t+8..2t+9, n g)
//   C (16 x 8, fp32)       c[0..1] = (g, 2t..2t+1)                   c[2..3] = (g+8, 2t..2t+1)
// ldmatrix.x4 loads four 8x8 bf16 matrices; lane l gives the address of row l % 8 of matrix l / 8 and gets,
// in register j, elements (l / 4, 2 (l % 4) .. +1) of matrix j; with .trans, elements (2 (l % 4) .. +1, l /
// 4).
#ifndef FORGE_KERNELS_CUDA_ATTENTION_DEVICE_CUH
#define FORGE_KERNELS_CUDA_ATTENTION_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace forge::cuda::attention {

// Two floats rounded to bf16 (nearest even), `low` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Element i of an output that holds fp32, or bf16 (rounded to nearest even) when `bf16`.
__device__ __forceinline__ void store_output(void* base, bool bf16, int64_t i, float x) {
  if (bf16)
    static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(x);
  else
    static_cast<float*>(base)[i] = x;
}

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The "memory" clobbers keep the compiler from moving shared-memory traffic across these and __syncthreads().
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address))
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address))
               : "memory");
}

// d += A B for one 16x8x16 tile: bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; zeros instead when !valid (the source is then not read, but must
// still be a mapped address: callers pass the tensor's base). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of this thread's committed groups are still in flight. A __syncthreads()
// must follow before other threads read what the finished groups wrote.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ char* dynamic_shared_memory() {
  extern __shared__ __align__(128) char attention_shared[];
  return attention_shared;
}

// Reductions over the four lanes of a quad (the lanes that hold one row of an MMA accumulator). Every lane
// adds or compares the same two operands at every level, so all four end bitwise equal.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

}  // namespace forge::cuda::attention

#endif  // FORGE_KERNELS_CUDA_ATTENTION_DEVICE_CUH
