// Block-scaled FP8 GEMM, DeepSeek-V3 fine-grained scaling (ops::Fp8GemmParams, block mode; kernels/ops.h):
// C[m,n] = alpha * sum_kb (A_kb B_kb^T)[m,n] * a_scale[m][kb] * b_scale(n, kb) + beta * C, for K-major
// operands (A stored [m,k], B stored [n,k] with trans_b), the layout FP8 tensor cores take.
//
// Design (the ideas of DeepGEMM's sm90 FP8 kernel, on warp-level MMAs): one CTA of 8 warps computes a
// 128 x 128 tile of C, each warp 64 x 32 of it. K runs in steps of 128, one scale block per step; a 5-stage
// cp.async pipeline keeps the next four steps' operand tiles (and their scales) in flight. Within a step the
// warp multiplies with mma.sync m16n8k32 (FP8 in, fp32 out) into a zeroed partial tile, then promotes it:
// acc += partial * (a_scale[row] * b_scale[col]), in fp32 registers. The tensor cores thus sum at most 128
// products before the fp32 accumulator takes over (DeepSeek's answer to their limited accumulator width), and
// every scale multiplies an fp32 partial sum, never an operand. A warpgroup (wgmma + TMA) kernel would be
// faster; this one aims at being right first.
//
// Shared memory: per stage A and B tiles of 128 rows x 128 bytes of K, each 16-byte chunk c of row r stored
// at chunk c ^ (r % 8), so that the eight 16-byte rows one ldmatrix phase reads lie in distinct banks; then
// the step's 128 row scales of A and 128 column scales of B. Ragged edges: rows of A past m, rows of B past n
// and bytes past k are zero-filled by the copies (never read: padding of a leading dimension may hold NaN
// codes), so the MMAs see zeros there; scales past m or n are zero; C is written only inside [m, n].
//
// Numerics: the order of the promotion matches the CPU kernel (the product of the two scales first, the
// blocks in K order); the promotion is one fused multiply-add where the CPU rounds the product first, and
// the tensor cores sum a block in their own order (on Hopper with a narrower internal accumulator), so
// results agree with the CPU to rounding, bitwise only where partial sums are exact. Deterministic: no
// atomics, no split-K; each output element's arithmetic depends on the problem alone. A bf16 C (c_dtype)
// takes the same fp32 epilogue, the old C widened exactly when beta != 0, and one round-to-nearest-even
// conversion on the store.
//
// Requirements, checked on the host before anything touches the GPU: lda and ldb multiples of 16 and a, b
// 16-byte aligned (16-byte vector copies); there is no slow fallback for unaligned operands. C needs only the
// alignment of its elements (pairs are stored as one 8-byte float2 or 4-byte bf16x2 where ldc is even and c
// aligned to a pair).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/fp8_block_mma.cuh"
#include "forge/kernels/cuda/runtime.h"

namespace forge::cuda {
namespace {

using fp8_block::MmaTypes;

constexpr int kBlockM = 128, kBlockN = 128;
constexpr int kBlockK = 128;  // one K step = one scale block
static_assert(kBlockK == ops::kFp8BlockSize, "a K step must be one scale block");
constexpr int kStages = 5;
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;  // 2 x 4 warps
constexpr int kWarpM = 64, kWarpN = 32;
static_assert((kBlockM / kWarpM) * (kBlockN / kWarpN) * 32 == kThreads, "warps must cover the tile");
constexpr int kMmaTilesM = kWarpM / 16, kMmaTilesN = kWarpN / 8;  // m16n8 tiles per warp: 4 x 4
constexpr int kChunksPerRow = kBlockK / 16;                       // 16-byte chunks per tile row
constexpr int kTileBytes = kBlockM * kBlockK;                     // one operand's codes per stage
static_assert(kBlockM == kBlockN, "A and B tiles share one copy loop");
static_assert(kBlockM + kBlockN == kThreads, "one thread per scale in the copy loop");
constexpr int kCopiesPerThread = kTileBytes / 16 / kThreads;  // 16-byte chunks per operand per thread
constexpr int kScaleBytes = (kBlockM + kBlockN) * static_cast<int>(sizeof(float));
constexpr int kStageBytes = 2 * kTileBytes + kScaleBytes;
constexpr int kSharedBytes = kStages * kStageBytes;  // 165 KiB of the 227 KiB a block may have on sm_90
static_assert(kStageBytes % 128 == 0, "stages must keep 16-byte alignment");
// Tiles are rasterised in groups of kGroupM tile rows: the CTAs resident at once share A and B tiles in L2.
constexpr int64_t kGroupM = 16;

// POD launch parameters.
struct Args {
  const uint8_t* a;
  const uint8_t* b;
  void* c;  // float, or __nv_bfloat16 when c_bf16
  const float* a_scales;
  const float* b_scales;
  int64_t m, n, k, lda, ldb, ldc;
  int64_t tiles_m, tiles_n;
  int k_blocks;
  bool b_scales_per_128_columns;  // block_128x128: one scale per 128 columns of C (rows of B)
  float alpha, beta;
  bool c_bf16;    // C holds bf16 (else fp32)
  bool read_c;    // beta != 0 (beta = 0 never reads C, which may hold NaN)
  bool vector_c;  // ldc even and c aligned to a pair of elements: float2 / bf16x2 accesses to C
};

template <MmaTypes kTypes>
__global__ void __launch_bounds__(kThreads, 1) fp8_block_gemm_nt_kernel(const Args p) {
  using namespace fp8_block;
  extern __shared__ __align__(128) uint8_t shared[];
  const int thread = static_cast<int>(threadIdx.x), lane = thread % 32, warp = thread / 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;

  // This CTA's tile: groups of kGroupM tile rows, tile rows fastest within a group.
  const int64_t tile = blockIdx.x;
  const int64_t group_tiles = kGroupM * p.tiles_n;
  const int64_t first_m = tile / group_tiles * kGroupM;
  const int64_t group_m = p.tiles_m - first_m < kGroupM ? p.tiles_m - first_m : kGroupM;
  const int64_t in_group = tile % group_tiles;
  const int64_t row0 = (first_m + in_group % group_m) * kBlockM;
  const int64_t col0 = in_group / group_m * kBlockN;

  // Issues the copies of K step kb into `stage` (one commit group per step, committed by the caller).
  auto load_stage = [&](int stage, int kb) {
    uint8_t* base = shared + stage * kStageBytes;
    const uint32_t a_tile = shared_address(base), b_tile = a_tile + kTileBytes;
    float* scales = reinterpret_cast<float*>(base + 2 * kTileBytes);
    const int64_t k0 = int64_t{kb} * kBlockK;
#pragma unroll
    for (int i = 0; i < kCopiesPerThread; ++i) {
      const int chunk = thread + i * kThreads;
      const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
      const uint32_t offset = r * kBlockK + ((c ^ (r % 8)) * 16);
      const int64_t kk = k0 + c * 16;
      const int64_t k_left = p.k - kk;  // bytes of this row's chunk inside k: 16, fewer in the last, or none
      const int k_bytes = k_left >= 16 ? 16 : k_left > 0 ? static_cast<int>(k_left) : 0;
      const int64_t a_row = row0 + r, b_row = col0 + r;
      const int a_bytes = a_row < p.m ? k_bytes : 0, b_bytes = b_row < p.n ? k_bytes : 0;
      copy_async_16(a_tile + offset, a_bytes > 0 ? p.a + a_row * p.lda + kk : p.a, a_bytes);
      copy_async_16(b_tile + offset, b_bytes > 0 ? p.b + b_row * p.ldb + kk : p.b, b_bytes);
    }
    if (thread < kBlockM) {  // A: a_scales [m][k_blocks]
      const int64_t row = row0 + thread;
      const bool inside = row < p.m;
      copy_async_4(shared_address(scales + thread), inside ? p.a_scales + row * p.k_blocks + kb : p.a_scales,
                   inside ? 4 : 0);
    } else {  // B: [n][k_blocks] (1x128 tiles) or [ceil(n/128)][k_blocks] (128x128 blocks)
      const int j = thread - kBlockM;
      const int64_t col = col0 + j;
      const bool inside = col < p.n;
      const int64_t index = (p.b_scales_per_128_columns ? col / ops::kFp8BlockSize : col) * p.k_blocks + kb;
      copy_async_4(shared_address(scales + kBlockM + j), inside ? p.b_scales + index : p.b_scales,
                   inside ? 4 : 0);
    }
  };

  // fp32 accumulators start at -0: -0 + x is x for every x, so the first promotion is exactly the CPU's
  // first scaled partial (including its sign of zero).
  float acc[kMmaTilesM][kMmaTilesN][4];
#pragma unroll
  for (int mi = 0; mi < kMmaTilesM; ++mi)
#pragma unroll
    for (int ni = 0; ni < kMmaTilesN; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = -0.0f;

  const int k_blocks = p.k_blocks;
  // Prologue: steps 0 .. kStages-2 in flight; a group is committed even when empty, so that the wait below
  // always means "step kb has landed".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_blocks) load_stage(s, s);
    copy_async_commit();
  }

  // ldmatrix row addresses of this lane (modulo the 16-row and 32-byte steps added in the loop). A, x4 per
  // m16 tile: matrices (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi) = a[0..3].
  // B, x4 per pair of n8 tiles: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi) = b[0], b[1] of
  // the first tile, then of the second. Every such row is a multiple of 8 plus lane % 8: its swizzle is
  // lane % 8.
  const int a_lane_row = warp_m * kWarpM + lane % 8 + (lane / 8) % 2 * 8;
  const int a_lane_chunk = lane / 16;
  const int b_lane_row = warp_n * kWarpN + lane % 8 + lane / 16 * 8;
  const int b_lane_chunk = (lane / 8) % 2;
  const int swizzle = lane % 8;
  const int group = lane / 4, quad = lane % 4;  // accumulator fragment: rows group (+8), columns 2 quad (+1)

  for (int kb = 0; kb < k_blocks; ++kb) {
    copy_async_wait<kStages - 2>();  // this thread's copies of step kb have landed
    __syncthreads();                 // everyone's have; and everyone is done with step kb-1's stage
    {
      const int next = kb + kStages - 1;  // refills the stage step kb-1 used
      if (next < k_blocks) load_stage(next % kStages, next);
      copy_async_commit();
    }

    const uint8_t* base = shared + (kb % kStages) * kStageBytes;
    const uint32_t a_tile = shared_address(base), b_tile = a_tile + kTileBytes;
    float partial[kMmaTilesM][kMmaTilesN][4];
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi)
#pragma unroll
      for (int ni = 0; ni < kMmaTilesN; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[mi][ni][e] = 0.0f;

#pragma unroll 1
    for (int ks = 0; ks < kBlockK / 32; ++ks) {
      uint32_t a_frag[kMmaTilesM][4];
      uint32_t b_frag[kMmaTilesN / 2][4];
#pragma unroll
      for (int mi = 0; mi < kMmaTilesM; ++mi)
        load_matrix_x4(a_tile + (a_lane_row + mi * 16) * kBlockK + (((2 * ks + a_lane_chunk) ^ swizzle) * 16),
                       a_frag[mi]);
#pragma unroll
      for (int pair = 0; pair < kMmaTilesN / 2; ++pair)
        load_matrix_x4(
            b_tile + (b_lane_row + pair * 16) * kBlockK + (((2 * ks + b_lane_chunk) ^ swizzle) * 16),
            b_frag[pair]);
#pragma unroll
      for (int mi = 0; mi < kMmaTilesM; ++mi)
#pragma unroll
        for (int ni = 0; ni < kMmaTilesN; ++ni)
          mma_16x8x32<kTypes>(partial[mi][ni], a_frag[mi], b_frag[ni / 2][(ni % 2) * 2],
                              b_frag[ni / 2][(ni % 2) * 2 + 1]);
    }

    // Promotion with this step's scales (read before the barrier that lets the stage be refilled).
    const float* a_scale = reinterpret_cast<const float*>(base + 2 * kTileBytes);
    const float* b_scale = a_scale + kBlockM;
#pragma unroll
    for (int mi = 0; mi < kMmaTilesM; ++mi) {
      const int r = warp_m * kWarpM + mi * 16 + group;
      const float a_low = a_scale[r], a_high = a_scale[r + 8];
#pragma unroll
      for (int ni = 0; ni < kMmaTilesN; ++ni) {
        const int col = warp_n * kWarpN + ni * 8 + 2 * quad;
        const float b0 = b_scale[col], b1 = b_scale[col + 1];
        float(&d)[4] = acc[mi][ni];
        const float(&s)[4] = partial[mi][ni];
        d[0] = __fmaf_rn(s[0], __fmul_rn(a_low, b0), d[0]);
        d[1] = __fmaf_rn(s[1], __fmul_rn(a_low, b1), d[1]);
        d[2] = __fmaf_rn(s[2], __fmul_rn(a_high, b0), d[2]);
        d[3] = __fmaf_rn(s[3], __fmul_rn(a_high, b1), d[3]);
      }
    }
  }
  copy_async_wait<0>();  // only empty groups can remain; leave nothing in flight

  // C = alpha * acc + beta * C inside [m, n] in fp32; the CPU's expression (beta = 0 never reads C). A bf16 C
  // is read widened (exact) and written rounded to nearest even, once.
  const float alpha = p.alpha, beta = p.beta;
  auto finish = [&](float v, float old) {
    const float scaled = __fmul_rn(alpha, v);
    return p.read_c ? __fadd_rn(scaled, __fmul_rn(beta, old)) : scaled;
  };
#pragma unroll
  for (int mi = 0; mi < kMmaTilesM; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + warp_m * kWarpM + mi * 16 + group + half * 8;
      if (row >= p.m) continue;
#pragma unroll
      for (int ni = 0; ni < kMmaTilesN; ++ni) {
        const int64_t col = col0 + warp_n * kWarpN + ni * 8 + 2 * quad;
        if (col >= p.n) continue;
        const float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
        const bool pair = col + 1 < p.n;
        if (p.c_bf16) {
          __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.c) + row * p.ldc + col;
          if (pair && p.vector_c) {
            float2 old = make_float2(0.0f, 0.0f);
            if (p.read_c) old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out));
            *reinterpret_cast<__nv_bfloat162*>(out) =
                __floats2bfloat162_rn(finish(v0, old.x), finish(v1, old.y));
          } else {
            out[0] = __float2bfloat16_rn(finish(v0, p.read_c ? __bfloat162float(out[0]) : 0.0f));
            if (pair) out[1] = __float2bfloat16_rn(finish(v1, p.read_c ? __bfloat162float(out[1]) : 0.0f));
          }
        } else {
          float* out = static_cast<float*>(p.c) + row * p.ldc + col;
          if (pair && p.vector_c) {
            float2 old = make_float2(0.0f, 0.0f);
            if (p.read_c) old = *reinterpret_cast<const float2*>(out);
            *reinterpret_cast<float2*>(out) = make_float2(finish(v0, old.x), finish(v1, old.y));
          } else {
            out[0] = finish(v0, p.read_c ? out[0] : 0.0f);
            if (pair) out[1] = finish(v1, p.read_c ? out[1] : 0.0f);
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Host side

[[noreturn]] void fail_block(const std::string& what) { fail_message("fp8_gemm (block scaling): " + what); }
bool refuse_block(std::string* reason, const std::string& what) {
  if (reason) *reason = "fp8_gemm (block scaling): " + what;
  return false;
}

bool is_fp8(DType dtype) { return dtype == DType::e4m3 || dtype == DType::e5m2; }
std::string name(DType dtype) { return std::string(dtype_name(dtype)); }
std::string str(int64_t x) { return std::to_string(x); }
uintptr_t address(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); }

// Every check that needs no GPU, in the order a caller would fix them.
bool supported(const ops::Fp8GemmParams& p, std::string* reason) {
  if (p.scaling != ops::Fp8Scaling::block)
    return refuse_block(reason, "called with per-tensor scaling (fp8_gemm runs that through cuBLASLt)");
  if (p.accumulator_bits != 0)
    return refuse_block(
        reason,
        "limited-precision accumulation (accumulator_bits = " + std::to_string(p.accumulator_bits) +
            ") is the CPU's model of the tensor cores; the CUDA kernel accumulates every block in fp32");
  if (p.m <= 0 || p.n <= 0 || p.k <= 0)
    return refuse_block(reason, "empty problem m=" + str(p.m) + " n=" + str(p.n) + " k=" + str(p.k));
  if (!is_fp8(p.a_dtype) || !is_fp8(p.b_dtype))
    return refuse_block(reason, "a_dtype and b_dtype must be e4m3 or e5m2, got " + name(p.a_dtype) + " and " +
                                    name(p.b_dtype));
  if (p.a_dtype == DType::e5m2 && p.b_dtype == DType::e5m2)
    return refuse_block(
        reason,
        "e5m2 x e5m2 is not supported (E4M3 x E4M3, E4M3 x E5M2 or E5M2 x E4M3; one operand must be e4m3)");
  if (p.trans_a || !p.trans_b)
    return refuse_block(
        reason,
        std::string("the ") + (p.trans_a ? "T" : "N") + (p.trans_b ? "T" : "N") + " orientation (A stored " +
            (p.trans_a ? "[k,m]" : "[m,k]") + ", B stored " + (p.trans_b ? "[n,k]" : "[k,n]") +
            ") is not supported on CUDA: the operands must be K-major, trans_a = false and trans_b = true "
            "(A stored [m,k], B stored [n,k]); pass transposed copies");
  if (p.c_dtype != DType::f32 && p.c_dtype != DType::bf16)
    return refuse_block(reason, "c_dtype must be fp32 or bf16, got " + name(p.c_dtype));
  if (!p.a || !p.b || !p.c) return refuse_block(reason, "null operand pointer (a, b or c)");
  if (!p.a_scales || !p.b_scales)
    return refuse_block(reason, std::string("a_scales and b_scales must be set (got ") +
                                    (p.a_scales ? "set" : "null") + " and " + (p.b_scales ? "set" : "null") +
                                    ")");
  if (p.b_block != ops::Fp8BlockScales::tile_1x128 && p.b_block != ops::Fp8BlockScales::block_128x128)
    return refuse_block(reason, "unknown b_block " + std::to_string(static_cast<int>(p.b_block)));
  if (p.lda < p.k)
    return refuse_block(reason, "lda " + str(p.lda) + " is smaller than A's " + str(p.k) + " stored columns");
  if (p.ldb < p.k)
    return refuse_block(reason, "ldb " + str(p.ldb) + " is smaller than B's " + str(p.k) + " stored columns");
  if (p.ldc < p.n) return refuse_block(reason, "ldc " + str(p.ldc) + " is smaller than n " + str(p.n));
  if (p.lda % 16 != 0 || p.ldb % 16 != 0 || address(p.a) % 16 != 0 || address(p.b) % 16 != 0)
    return refuse_block(reason, "the kernel copies operands in 16-byte vectors: lda " + str(p.lda) +
                                    " and ldb " + str(p.ldb) +
                                    " must be multiples of 16 and a, b 16-byte aligned (a % 16 = " +
                                    str(address(p.a) % 16) + ", b % 16 = " + str(address(p.b) % 16) + ")");
  if (address(p.c) % dtype_size(p.c_dtype) != 0)
    return refuse_block(reason, "c must be aligned to its " + std::to_string(dtype_size(p.c_dtype)) +
                                    "-byte " + name(p.c_dtype) +
                                    " elements (c % 16 = " + str(address(p.c) % 16) + ")");
  if (address(p.a_scales) % 4 != 0 || address(p.b_scales) % 4 != 0)
    return refuse_block(reason, "a_scales and b_scales must be 4-byte aligned floats");
  constexpr int64_t kMaxTiles = 0x7fffffff;
  const int64_t tiles_m = (p.m + kBlockM - 1) / kBlockM, tiles_n = (p.n + kBlockN - 1) / kBlockN;
  if (tiles_m > kMaxTiles / tiles_n || p.k > int64_t{0x7fffffff})
    return refuse_block(
        reason, "problem too large for one launch: m=" + str(p.m) + " n=" + str(p.n) + " k=" + str(p.k));
  return true;
}

// A host pointer would fault on the device and poison the context for the whole process: one driver query
// per pointer first (no synchronisation).
void check_device_pointer(const char* what, const void* pointer) {
  cudaPointerAttributes attributes{};
  FORGE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, pointer));
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    fail_block(std::string(what) + " is not device memory; the CUDA backend takes device pointers");
}

template <MmaTypes kTypes>
void launch(const Args& args, unsigned grid) {
  static const bool configured = [] {
    FORGE_CUDA_CHECK(cudaFuncSetAttribute(fp8_block_gemm_nt_kernel<kTypes>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    return true;
  }();
  (void)configured;
  fp8_block_gemm_nt_kernel<kTypes><<<grid, kThreads, kSharedBytes, stream()>>>(args);
  FORGE_CUDA_CHECK_LAUNCH("fp8_block_gemm_nt_kernel");
}

}  // namespace

bool supports_fp8_block_gemm(const ops::Fp8GemmParams& p, std::string* reason) { return supported(p, reason); }

void fp8_block_gemm(const ops::Fp8GemmParams& p) {
  if (std::string why; !supported(p, &why)) fail_message(why);
  if (!available()) fail_block(describe_device());
  static const int capability = compute_capability();
  if (capability < 89)
    fail_block("needs FP8 tensor cores (compute capability 8.9 or newer): " + describe_device());
  check_device_pointer("a", p.a);
  check_device_pointer("b", p.b);
  check_device_pointer("c", p.c);
  check_device_pointer("a_scales", p.a_scales);
  check_device_pointer("b_scales", p.b_scales);

  Args args{};
  args.a = p.a, args.b = p.b, args.c = p.c;
  args.a_scales = p.a_scales, args.b_scales = p.b_scales;
  args.m = p.m, args.n = p.n, args.k = p.k;
  args.lda = p.lda, args.ldb = p.ldb, args.ldc = p.ldc;
  args.tiles_m = (p.m + kBlockM - 1) / kBlockM, args.tiles_n = (p.n + kBlockN - 1) / kBlockN;
  args.k_blocks = static_cast<int>((p.k + kBlockK - 1) / kBlockK);
  args.b_scales_per_128_columns = p.b_block == ops::Fp8BlockScales::block_128x128;
  args.alpha = p.alpha, args.beta = p.beta;
  args.c_bf16 = p.c_dtype == DType::bf16;
  args.read_c = p.beta != 0.0f;
  args.vector_c = p.ldc % 2 == 0 && address(p.c) % (2 * dtype_size(p.c_dtype)) == 0;
  const auto grid = static_cast<unsigned>(args.tiles_m * args.tiles_n);
  if (p.a_dtype == DType::e4m3 && p.b_dtype == DType::e4m3)
    launch<MmaTypes::e4m3_e4m3>(args, grid);
  else if (p.a_dtype == DType::e4m3)
    launch<MmaTypes::e4m3_e5m2>(args, grid);
  else
    launch<MmaTypes::e5m2_e4m3>(args, grid);
}

}  // namespace forge::cuda
