// Output projection fused with softmax cross-entropy on device memory, chunked over the vocabulary exactly as
// the CPU kernel (cpu/linear_cross_entropy.cpp): per chunk, cuBLASLt writes the logits [rows, width] into
// the workspace (with keep_logits each chunk into its own block, which backward then reads instead of
// computing the chunk again), then one block per row
//   forward   folds the chunk's max and sum of exponentials into the row's running (max, sum) and picks up
//             the target logit when the target falls in the chunk; the last real chunk writes lse and loss
//             (and the target and max logits when asked: the running max is the row's max logit);
//   backward  turns the logits into dlogits = (softmax - onehot) * grad_scale (in place in fp32, or into the
//             workspace's bf16 area under bf16 GEMMs, as the CPU converts them), which feed
//             dhidden (+)= dlogits @ W[chunk] (the first chunk overwrites) and dweight[chunk] += dlogits^T @
//             h.
// The running (max, sum, target logit) of each row lives in a small scratch between chunks.
//
// Row kernels read the logits in groups of four columns (one float4 where the row is 16-byte aligned). Each
// thread folds its groups in increasing order into an online (max, sum) pair, merged over the block in a
// fixed tree: the result depends on the chunk width only, never on the SM count or on the alignment (the
// scalar path reads the same groups). The exponential is the CPU's simd_exp (cpu/simd_exp.h, as in
// swiglu.cu), so equal logits give equal dlogits on both backends.
//
// Targets live on the device. A target at or past the global vocabulary fails like on the CPU, naming the
// first such row: one small kernel and one synchronisation per call, before anything is written.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::kWarpSize;

constexpr int kMaxThreads = 1024;
// Float4 groups per thread before a row's block grows by a warp (a chunk of 8192 columns gets 256 threads).
constexpr int64_t kGroupsPerThread = 8;
// Groups each thread loads before it processes them, to keep several loads in flight.
constexpr int kUnroll = 4;
constexpr int kCheckThreads = 256;
constexpr unsigned long long kNoBadRow = ~0ull;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMinNormal = std::numeric_limits<float>::min();

// ---------------------------------------------------------------------------------------------------------------
// Device side

// cpu::simd_exp with the FMA pattern g++ gives it (see swiglu.cu): about 2 ulp, 0 below x = -87 (never a
// denormal), exp(88) above 88, NaN propagates; exp(0) = 1 exactly and exp(-inf) = 0.
__device__ __forceinline__ float exp_like_cpu(float x) {
  const detail::ExpParts e = detail::exp_parts_like_cpu(x);
  return e.underflow ? 0.0f : __fmul_rn(e.p, e.scale);
}

// core/dtype.h's encode_bf16: round to nearest even, NaN stays a quiet NaN.
__device__ __forceinline__ uint32_t bf16_bits(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// Columns [j, j + 4) of a row, those at or past `end` replaced by `fill`. `vector` promises that the row
// start is 16-byte aligned (j is a multiple of 4).
__device__ __forceinline__ float4 load_group(const float* row, int64_t j, int64_t end, bool vector,
                                             float fill) {
  if (vector && j + 4 <= end) return *reinterpret_cast<const float4*>(row + j);
  float4 v;
  v.x = j < end ? row[j] : fill;
  v.y = j + 1 < end ? row[j + 1] : fill;
  v.z = j + 2 < end ? row[j + 2] : fill;
  v.w = j + 3 < end ? row[j + 3] : fill;
  return v;
}

// The running max of the values seen and the sum of exp(x - max) over them; (-inf, 0) when none. Every
// operation is an explicit _rn intrinsic: the rounding is what the source says, whatever nvcc contracts.
struct OnlineSoftmax {
  float max, sum;
};

__device__ __forceinline__ OnlineSoftmax add_group(OnlineSoftmax acc, float4 v) {
  const float group_max = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
  if (group_max == -kInf) return acc;  // nothing real here (fill values); also avoids -inf - -inf
  if (group_max > acc.max) {
    // Rescale what this thread summed relative to its smaller max (0 * exp(-inf) = 0 when it has nothing).
    acc.sum = __fmul_rn(acc.sum, exp_like_cpu(__fsub_rn(acc.max, group_max)));
    acc.max = group_max;
  }
  const float m = acc.max;
  const float e = __fadd_rn(__fadd_rn(exp_like_cpu(__fsub_rn(v.x, m)), exp_like_cpu(__fsub_rn(v.y, m))),
                            __fadd_rn(exp_like_cpu(__fsub_rn(v.z, m)), exp_like_cpu(__fsub_rn(v.w, m))));
  acc.sum = __fadd_rn(acc.sum, e);
  return acc;
}

// The CPU's merge rule: a part with sum 0 contributes 0 (no exp of -inf - -inf).
__device__ __forceinline__ OnlineSoftmax merge(OnlineSoftmax a, OnlineSoftmax b) {
  const float m = fmaxf(a.max, b.max);
  const float sa = a.sum == 0.0f ? 0.0f : __fmul_rn(a.sum, exp_like_cpu(__fsub_rn(a.max, m)));
  const float sb = b.sum == 0.0f ? 0.0f : __fmul_rn(b.sum, exp_like_cpu(__fsub_rn(b.max, m)));
  return {m, __fadd_rn(sa, sb)};
}

__device__ __forceinline__ OnlineSoftmax warp_merge(OnlineSoftmax s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const OnlineSoftmax other{__shfl_xor_sync(0xffffffffu, s.max, offset),
                              __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = merge(s, other);
  }
  return s;
}

// One block per row of the chunk's logits [rows, width]; the first `real` columns are real tokens. Folds the
// chunk into the row's running state (which the first chunk starts) and, on the last real chunk, writes lse,
// loss, target_logit and max_logit (both optional) instead of the state.
__global__ void __launch_bounds__(kMaxThreads)
    forward_chunk_kernel(const float* __restrict__ logits, int64_t width, int64_t real, bool vector,
                         const int32_t* __restrict__ targets, int64_t global_first, bool first_chunk,
                         bool last_chunk, float* __restrict__ running_max, float* __restrict__ running_sum,
                         float* __restrict__ running_target, float* __restrict__ lse,
                         float* __restrict__ loss, float* __restrict__ target_logit,
                         float* __restrict__ max_logit) {
  __shared__ float warp_max[kMaxThreads / kWarpSize], warp_sum[kMaxThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * width;
  const int64_t groups = (real + 3) / 4, stride = blockDim.x;
  OnlineSoftmax acc{-kInf, 0.0f};
  for (int64_t q = threadIdx.x; q < groups; q += kUnroll * stride) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = q + u * stride;
      v[u] = g < groups ? load_group(x, 4 * g, real, vector, -kInf) : make_float4(-kInf, -kInf, -kInf, -kInf);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc = add_group(acc, v[u]);
  }
  acc = warp_merge(acc);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) warp_max[warp] = acc.max, warp_sum[warp] = acc.sum;
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x / kWarpSize;
  acc = lane < warps ? OnlineSoftmax{warp_max[lane], warp_sum[lane]} : OnlineSoftmax{-kInf, 0.0f};
  acc = warp_merge(acc);
  if (lane != 0) return;

  OnlineSoftmax running{-kInf, 0.0f};
  float target_value = 0.0f;
  if (!first_chunk) running = {running_max[row], running_sum[row]}, target_value = running_target[row];
  running = merge(running, acc);
  const int64_t target_column = int64_t{targets[row]} - global_first;
  if (target_column >= 0 && target_column < real) target_value = x[target_column];
  if (!last_chunk) {
    running_max[row] = running.max, running_sum[row] = running.sum, running_target[row] = target_value;
    return;
  }
  // A range of padding only has no chunk at all (empty_range_kernel); here sum > 0 unless the logits hold
  // NaN.
  const float row_lse = running.sum > 0.0f ? __fadd_rn(running.max, logf(running.sum)) : -kInf;
  lse[row] = row_lse;
  loss[row] = targets[row] < 0 ? 0.0f : __fsub_rn(row_lse, target_value);
  if (target_logit != nullptr) target_logit[row] = target_value;
  if (max_logit != nullptr) max_logit[row] = running.max;  // a max rounds nothing: the CPU's on equal logits
}

// A vocabulary range of padding only: lse -inf, loss -inf (0 when ignored), target logit 0, max logit -inf,
// as on the CPU.
__global__ void empty_range_kernel(const int32_t* __restrict__ targets, int64_t rows, float* __restrict__ lse,
                                   float* __restrict__ loss, float* __restrict__ target_logit,
                                   float* __restrict__ max_logit) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows; r += stride) {
    lse[r] = -kInf;
    loss[r] = targets[r] < 0 ? 0.0f : -kInf;
    if (target_logit != nullptr) target_logit[r] = 0.0f;
    if (max_logit != nullptr) max_logit[r] = -kInf;
  }
}

// dlogits of column j (< real) from its logit, as the CPU: exp(x - lse) * scale, flushed to 0 where it would
// be denormal (it changes nothing and would slow the GEMMs).
__device__ __forceinline__ float dlogit(float x, float row_lse, float grad_scale) {
  const float d = __fmul_rn(exp_like_cpu(__fsub_rn(x, row_lse)), grad_scale);
  return fabsf(d) < kMinNormal ? 0.0f : d;
}

// One block per row: logits [rows, width] become dlogits, written over the logits (dlogits_bf16 null) or as
// bf16 into dlogits_bf16 [rows, width]. Ignored rows and padding columns get 0; the target column (local
// index target - global_first, when in [0, real)) gets d - grad_scale. No __restrict__ on logits: the fp32
// path writes in place (each thread reads its own groups before writing them).
__global__ void __launch_bounds__(kMaxThreads)
    backward_chunk_kernel(float* logits, int64_t width, int64_t real, bool vector, uint16_t* dlogits_bf16,
                          bool vector_bf16, const int32_t* __restrict__ targets,
                          const float* __restrict__ lse, float grad_scale, int64_t global_first) {
  const int64_t row = blockIdx.x;
  float* x = logits + row * width;
  uint16_t* y = dlogits_bf16 != nullptr ? dlogits_bf16 + row * width : nullptr;
  const int32_t target = targets[row];
  const bool ignored = target < 0;
  const float row_lse = ignored ? 0.0f : lse[row];
  const int64_t target_column = int64_t{target} - global_first;  // matches no column unless in [0, real)
  const int64_t groups = (width + 3) / 4, stride = blockDim.x;
  for (int64_t q = threadIdx.x; q < groups; q += kUnroll * stride) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = q + u * stride;
      // Padding columns are read (they lie inside the chunk) but not used; ignored rows read nothing.
      v[u] = g < groups && !ignored ? load_group(x, 4 * g, width, vector, 0.0f) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = q + u * stride, j = 4 * g;
      if (g >= groups) continue;
      float d[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        d[i] = ignored || j + i >= real ? 0.0f : dlogit(d[i], row_lse, grad_scale);
        if (!ignored && j + i == target_column) d[i] = __fsub_rn(d[i], grad_scale);
      }
      if (y == nullptr) {
        if (vector && j + 4 <= width) {
          *reinterpret_cast<float4*>(x + j) = make_float4(d[0], d[1], d[2], d[3]);
        } else {
          for (int i = 0; i < 4 && j + i < width; ++i) x[j + i] = d[i];
        }
      } else if (vector_bf16 && j + 4 <= width) {
        // Little-endian: the lower column sits in the lower half of each word.
        *reinterpret_cast<uint2*>(y + j) =
            make_uint2(bf16_bits(d[0]) | (bf16_bits(d[1]) << 16), bf16_bits(d[2]) | (bf16_bits(d[3]) << 16));
      } else {
        for (int i = 0; i < 4 && j + i < width; ++i) y[j + i] = static_cast<uint16_t>(bf16_bits(d[i]));
      }
    }
  }
}

// An integer minimum over (row, target) packed row-major into 64 bits: the first bad row wins whatever the
// thread order, and its target comes back with it.
__global__ void find_bad_target_kernel(const int32_t* __restrict__ targets, int64_t rows,
                                       int64_t global_vocab, unsigned long long* __restrict__ first_bad) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const int32_t target = targets[r];
    if (target >= global_vocab)
      atomicMin(first_bad, (static_cast<unsigned long long>(r) << 32) | static_cast<uint32_t>(target));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side

// How this vocabulary range splits into chunks: local columns [0, real_columns) are real tokens, the rest
// (columns at or past the global vocabulary) padding that takes no part, as on the CPU.
struct Chunking {
  int64_t chunk = 0, global_vocab = 0, real_columns = 0;
};

Chunking chunking(const ops::LinearCrossEntropyParams& p) {
  Chunking c;
  c.chunk = std::min(p.vocab_chunk, p.vocab);
  c.global_vocab = p.global_vocab > 0 ? p.global_vocab : p.vocab_start + p.vocab;
  c.real_columns = std::clamp<int64_t>(c.global_vocab - p.vocab_start, 0, p.vocab);
  return c;
}

// Everything that needs no GPU, in the CPU kernel's order and words; then the pointers the op touches.
// The checks both directions share; then, where there are rows, the pointers each reads or writes.
bool shape_ok(const ops::LinearCrossEntropyParams& p, const char* op, std::string* reason) {
  using detail::refuse;
  if (p.rows < 0 || p.dim <= 0 || p.vocab <= 0 || p.vocab_chunk <= 0)
    return refuse(reason, op,
                  "bad shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim) +
                      " vocab=" + std::to_string(p.vocab) + " vocab_chunk=" + std::to_string(p.vocab_chunk));
  if (p.gemm_dtype != DType::f32 && p.gemm_dtype != DType::bf16)
    return refuse(reason, op, "gemm_dtype must be fp32 or bf16, got " + std::string(dtype_name(p.gemm_dtype)));
  if (p.softcap != 0.0f)
    return refuse(reason, op, "logit soft-capping (softcap " + std::to_string(p.softcap) +
                                  ") is not implemented on CUDA; run on the CPU");
  if (p.workspace == nullptr) return refuse(reason, op, "workspace is required");
  if (p.vocab_start < 0) return refuse(reason, op, "negative vocabulary start " + std::to_string(p.vocab_start));
  if (p.rows > INT_MAX)
    return refuse(reason, op,
                  "rows=" + std::to_string(p.rows) + " exceeds the row kernels' grid (at most 2^31 - 1)");
  return true;
}

// A host pointer would fault inside a kernel and poison the context for the whole process: one driver query
// per pointer, no synchronisation.
void require_device_pointer(const void* pointer, const char* op, const char* name) {
  cudaPointerAttributes attributes{};
  FORGE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, pointer));
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    char address[32];
    std::snprintf(address, sizeof address, "%p", pointer);
    detail::fail_op(op, std::string(name) + " (" + address +
                            ") is not device memory; the CUDA backend takes device pointers");
  }
}

// Scratch for one call: the bad-target flag, then the running max, sum and target logit of every row.
class CallScratch {
 public:
  explicit CallScratch(int64_t rows)
      : rows_bytes_(detail::align_bytes(static_cast<size_t>(rows) * sizeof(float))),
        memory_(detail::align_bytes(sizeof(unsigned long long)) + 3 * rows_bytes_) {}
  unsigned long long* first_bad() const { return memory_.as<unsigned long long>(); }
  float* running(int which) const {
    return memory_.as<float>(detail::align_bytes(sizeof(unsigned long long)) + which * rows_bytes_);
  }

 private:
  size_t rows_bytes_;
  detail::StreamScratch memory_;
};

// Fails like the CPU kernel when a target lies at or past the global vocabulary (negative targets are
// ignored rows). Synchronises: the one round trip of the call.
void check_targets(const ops::LinearCrossEntropyParams& p, int64_t global_vocab, const CallScratch& scratch,
                   const char* op) {
  FORGE_CUDA_CHECK(cudaMemsetAsync(scratch.first_bad(), 0xff, sizeof(unsigned long long), stream()));
  find_bad_target_kernel<<<detail::grid_blocks(p.rows, kCheckThreads), kCheckThreads, 0, stream()>>>(
      p.targets, p.rows, global_vocab, scratch.first_bad());
  FORGE_CUDA_CHECK_LAUNCH(op);
  unsigned long long first_bad = kNoBadRow;
  FORGE_CUDA_CHECK(
      cudaMemcpyAsync(&first_bad, scratch.first_bad(), sizeof first_bad, cudaMemcpyDeviceToHost, stream()));
  synchronize();
  if (first_bad == kNoBadRow) return;
  const int64_t row = static_cast<int64_t>(first_bad >> 32);
  const auto target = static_cast<int32_t>(static_cast<uint32_t>(first_bad & 0xffffffffu));
  detail::fail_op(op, "target " + std::to_string(target) + " at row " + std::to_string(row) +
                          " is outside the vocabulary [0, " + std::to_string(global_vocab) + ")");
}

// Threads per row block: about kGroupsPerThread float4 groups each, a whole number of warps, at most 1024. A
// function of the chunk width alone, so the forward's reduction order is too.
int row_threads(int64_t width) {
  const int64_t groups = (width + 3) / 4;
  const int64_t warps = (groups + kGroupsPerThread * kWarpSize - 1) / (kGroupsPerThread * kWarpSize);
  return static_cast<int>(std::clamp<int64_t>(warps, 1, kMaxThreads / kWarpSize)) * kWarpSize;
}

bool aligned(const void* pointer, size_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

const void* element(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(dtype));
}

// Where chunk `first`'s logits live in the workspace: its own block with keep_logits, else the one chunk area.
float* chunk_area(const ops::LinearCrossEntropyParams& p, int64_t first) {
  return p.workspace + ops::linear_cross_entropy_chunk_offset(p, first);
}

// logits[rows, width] (ldc = width) = hidden @ W[first : first + width]^T
void chunk_logits(const ops::LinearCrossEntropyParams& p, int64_t first, int64_t width, float* logits) {
  ops::GemmParams g;
  g.m = p.rows, g.n = width, g.k = p.dim;
  g.a = p.hidden_gemm, g.lda = p.dim;
  g.b = element(p.weight_gemm, p.gemm_dtype, first * p.dim), g.ldb = p.dim, g.trans_b = true;
  g.ab_dtype = p.gemm_dtype;
  g.c = logits, g.ldc = width;
  cuda::gemm(g);
}

}  // namespace

bool supports_linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p, std::string* reason) {
  constexpr const char* op = "linear_cross_entropy_forward";
  if (!shape_ok(p, op, reason)) return false;
  using detail::pointer_set;
  return p.rows == 0 || (pointer_set(p.hidden_gemm, op, "hidden_gemm", reason) &&
                         pointer_set(p.weight_gemm, op, "weight_gemm", reason) &&
                         pointer_set(p.targets, op, "targets", reason) && pointer_set(p.lse, op, "lse", reason) &&
                         pointer_set(p.loss, op, "loss", reason));
}

bool supports_linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p, std::string* reason) {
  constexpr const char* op = "linear_cross_entropy_backward";
  if (!shape_ok(p, op, reason)) return false;
  using detail::pointer_set;
  return p.rows == 0 || (pointer_set(p.hidden_gemm, op, "hidden_gemm", reason) &&
                         pointer_set(p.weight_gemm, op, "weight_gemm", reason) &&
                         pointer_set(p.targets, op, "targets", reason) && pointer_set(p.lse, op, "lse", reason) &&
                         pointer_set(p.dhidden, op, "dhidden", reason));
}

void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams& p) {
  constexpr const char* op = "linear_cross_entropy_forward";
  if (std::string why; !supports_linear_cross_entropy_forward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  require_device_pointer(p.targets, op, "targets");
  require_device_pointer(p.lse, op, "lse");
  require_device_pointer(p.loss, op, "loss");
  require_device_pointer(p.workspace, op, "workspace");
  if (p.target_logit != nullptr) require_device_pointer(p.target_logit, op, "target_logit");
  if (p.max_logit != nullptr) require_device_pointer(p.max_logit, op, "max_logit");
  const Chunking c = chunking(p);
  const CallScratch scratch(p.rows);
  check_targets(p, c.global_vocab, scratch, op);
  const auto rows = static_cast<unsigned>(p.rows);
  if (c.real_columns == 0) {
    empty_range_kernel<<<detail::grid_blocks(p.rows, kCheckThreads), kCheckThreads, 0, stream()>>>(
        p.targets, p.rows, p.lse, p.loss, p.target_logit, p.max_logit);
    FORGE_CUDA_CHECK_LAUNCH(op);
    return;
  }
  for (int64_t first = 0; first < c.real_columns; first += c.chunk) {
    const int64_t width = std::min(c.chunk, p.vocab - first), real = std::min(width, c.real_columns - first);
    float* logits = chunk_area(p, first);
    chunk_logits(p, first, width, logits);
    const bool vector = width % 4 == 0 && aligned(logits, 16);
    forward_chunk_kernel<<<rows, row_threads(width), 0, stream()>>>(
        logits, width, real, vector, p.targets, p.vocab_start + first, first == 0,
        first + c.chunk >= c.real_columns, scratch.running(0), scratch.running(1), scratch.running(2), p.lse,
        p.loss, p.target_logit, p.max_logit);
    FORGE_CUDA_CHECK_LAUNCH(op);
  }
}

void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams& p) {
  constexpr const char* op = "linear_cross_entropy_backward";
  if (std::string why; !supports_linear_cross_entropy_backward(p, &why)) fail_message(why);
  if (p.rows == 0) return;
  require_device_pointer(p.targets, op, "targets");
  require_device_pointer(p.lse, op, "lse");
  require_device_pointer(p.dhidden, op, "dhidden");
  if (p.dweight) require_device_pointer(p.dweight, op, "dweight");  // null: a frozen head
  require_device_pointer(p.workspace, op, "workspace");
  const Chunking c = chunking(p);
  const CallScratch scratch(p.rows);
  check_targets(p, c.global_vocab, scratch, op);
  if (c.real_columns == 0) {  // padding only: no gradient, but dhidden is still overwritten
    FORGE_CUDA_CHECK(
        cudaMemsetAsync(p.dhidden, 0, static_cast<size_t>(p.rows * p.dim) * sizeof(float), stream()));
    return;
  }
  const bool bf16 = p.gemm_dtype == DType::bf16;
  // bf16 GEMMs take bf16 dlogits, after the fp32 logits in the workspace (the CPU's layout and size).
  uint16_t* dlogits_bf16 =
      bf16 ? reinterpret_cast<uint16_t*>(p.workspace + ops::linear_cross_entropy_logits_floats(p)) : nullptr;
  const auto rows = static_cast<unsigned>(p.rows);
  for (int64_t first = 0; first < c.real_columns; first += c.chunk) {
    const int64_t width = std::min(c.chunk, p.vocab - first), real = std::min(width, c.real_columns - first);
    float* logits = chunk_area(p, first);
    if (!p.keep_logits) chunk_logits(p, first, width, logits);
    const bool vector = width % 4 == 0 && aligned(logits, 16);
    const bool vector_bf16 = bf16 && width % 4 == 0 && aligned(dlogits_bf16, 8);
    backward_chunk_kernel<<<rows, row_threads(width), 0, stream()>>>(
        logits, width, real, vector, dlogits_bf16, vector_bf16, p.targets, p.lse, p.grad_scale,
        p.vocab_start + first);
    FORGE_CUDA_CHECK_LAUNCH(op);
    const void* dlogits = bf16 ? static_cast<const void*>(dlogits_bf16) : logits;

    ops::GemmParams input;  // dhidden (+)= dlogits @ W[chunk]
    input.m = p.rows, input.n = p.dim, input.k = width;
    input.a = dlogits, input.lda = width;
    input.b = element(p.weight_gemm, p.gemm_dtype, first * p.dim), input.ldb = p.dim;
    input.ab_dtype = p.gemm_dtype;
    input.c = p.dhidden, input.ldc = p.dim;
    input.beta = first == 0 ? 0.0f : 1.0f;
    cuda::gemm(input);

    if (!p.dweight) continue;  // a frozen head
    ops::GemmParams weight;  // dweight[chunk] += dlogits^T @ hidden
    weight.m = width, weight.n = p.dim, weight.k = p.rows;
    weight.a = dlogits, weight.lda = width, weight.trans_a = true;
    weight.b = p.hidden_gemm, weight.ldb = p.dim;
    weight.ab_dtype = p.gemm_dtype;
    weight.c = p.dweight + first * p.dim, weight.ldc = p.dim;
    weight.beta = 1.0f;
    cuda::gemm(weight);
  }
}

}  // namespace forge::cuda
