// PTX wrappers for the block-scaled FP8 GEMM (fp8_block_gemm.cu): asynchronous global-to-shared copies,
// ldmatrix and the warp-level FP8 tensor-core MMA. Device code only.
//
// mma.sync.aligned.m16n8k32.row.col.f32.<atype>.<btype>.f32 (PTX ISA 8.4+, sm_89+), per lane with
// g = lane / 4 and t = lane % 4 (PTX ISA "Matrix Fragments for mma.m16n8k32", .e4m3/.e5m2 types):
//   A (16 x 32, row-major)  4 x b32, 4 codes each, lowest byte first:
//       a[0] row g,     k 4t .. 4t+3        a[1] row g + 8, k 4t .. 4t+3
//       a[2] row g,     k 16+4t .. 16+4t+3  a[3] row g + 8, k 16+4t .. 16+4t+3
//   B (32 x 8, "col": stored n-major, K contiguous)  2 x b32:
//       b[0] column g,  k 4t .. 4t+3        b[1] column g,  k 16+4t .. 16+4t+3
//   C/D (16 x 8 fp32)  c[0], c[1] row g, columns 2t, 2t+1;  c[2], c[3] row g + 8, columns 2t, 2t+1.
//
// ldmatrix.m8n8.x4.b16 hands lane l, for each of its four 8x8 b16 matrices, the 32 bits at row l / 4, bytes
// 4 (l % 4) .. 4 (l % 4) + 3 of that matrix's 16-byte rows: exactly one A or B register above when a matrix
// is 8 rows (of M or N) by 16 bytes of K. Lanes 8i .. 8i + 7 give the row addresses of matrix i.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace forge::cuda::fp8_block {

// FP8 operand pair of one instantiation (E5M2 x E5M2 is refused on the host).
enum class MmaTypes { e4m3_e4m3, e4m3_e5m2, e5m2_e4m3 };

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies `bytes` (0..16) from global `source` to shared `destination` and zero-fills the rest of the 16;
// both addresses 16-byte aligned. With bytes = 0 nothing is read (source must still be a valid address).
__device__ __forceinline__ void copy_async_16(uint32_t destination, const void* source, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source), "r"(bytes)
               : "memory");
}

// One float: bytes 4 copies it, 0 writes a zero.
__device__ __forceinline__ void copy_async_4(uint32_t destination, const void* source, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(destination), "l"(source), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void load_matrix_x4(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// d += A B on one 16 x 8 x 32 tile (fragments as in the header comment).
template <MmaTypes kTypes>
__device__ __forceinline__ void mma_16x8x32(float (&d)[4], const uint32_t (&a)[4], const uint32_t b0,
                                            const uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kTypes == MmaTypes::e4m3_e4m3) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (kTypes == MmaTypes::e4m3_e5m2) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  // No FP8 tensor cores below sm_89: the host refuses such devices before launching.
  __trap();
#endif
}

}  // namespace forge::cuda::fp8_block
