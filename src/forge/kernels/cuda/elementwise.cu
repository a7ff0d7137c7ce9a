// Element-wise helpers for the optimizer and gradient handling on device memory. sum_squares reduces in
// double over fixed chunks of kSumChunk elements (one block each) and then adds the chunk sums in one block,
// in orders that depend only on n: the gradient norm is the same bitwise on every run and every GPU model.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using detail::load_element;
using detail::store_element;

constexpr int kThreads = 256;
// Elements per first-pass block (the CPU kernel's block size too, though the orders inside differ).
constexpr int64_t kSumChunk = 16384;
constexpr int kFinalThreads = 1024;

// n >= 0 and, where there is something to touch, the arrays set.
bool size_ok(const char* op, int64_t n, const void* a, const char* a_name, std::string* reason,
             const void* b = nullptr, const char* b_name = nullptr) {
  if (n < 0) return detail::refuse(reason, op, "negative size " + std::to_string(n));
  if (n == 0) return true;
  return detail::pointer_set(a, op, a_name, reason) && (!b_name || detail::pointer_set(b, op, b_name, reason));
}

// sum_squares' first pass: one block per chunk.
bool chunks_ok(const char* op, int64_t n, std::string* reason) {
  if ((n + kSumChunk - 1) / kSumChunk <= int64_t{0x7fffffff}) return true;
  return detail::refuse(reason, op, "size " + std::to_string(n) + " is too large");
}

// y and x may be the same array (y += y): each element is read before it is written by the same thread.
template <typename Y, typename X>
__global__ void add_inplace_kernel(Y* y, const X* x, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    store_element(y, i, load_element(y, i) + load_element(x, i));
}

__global__ void scale_inplace_kernel(float* x, float s, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= s;
}

__global__ void softcap_inplace_kernel(float* x, float cap, float inverse, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = cap * tanhf(x[i] * inverse);
}

// One block per chunk. A float squared is exact in double (48 significant bits), so only the additions
// round, and their order is fixed by the thread index: thread t sums elements t, t + 256, ... of its chunk.
__global__ void sum_squares_chunks_kernel(const float* __restrict__ x, int64_t n,
                                          double* __restrict__ partial) {
  __shared__ double warp_sums[kThreads / detail::kWarpSize];
  const int64_t begin = int64_t{blockIdx.x} * kSumChunk;
  const int64_t end = begin + kSumChunk < n ? begin + kSumChunk : n;
  double sum = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = x[i];
    sum += v * v;
  }
  sum = detail::block_sum(sum, warp_sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// *total = the sum of the partials, or with accumulate *total += it (one addition, in stream order).
__global__ void sum_partials_kernel(const double* __restrict__ partial, int64_t count, double* __restrict__ total,
                                    bool accumulate) {
  __shared__ double warp_sums[kFinalThreads / detail::kWarpSize];
  double sum = 0;
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) sum += partial[i];
  sum = detail::block_sum(sum, warp_sums);
  if (threadIdx.x == 0) *total = accumulate ? *total + sum : sum;
}

// bf16 = the upper half of the fp32 pattern after round-to-nearest-even; NaN keeps a quiet NaN (core/dtype.h).
__global__ void to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t bits = __float_as_uint(x[i]);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      y[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);
    } else {
      y[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}

__global__ void to_f32_kernel(const uint16_t* __restrict__ x, float* __restrict__ y, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = __uint_as_float(static_cast<uint32_t>(x[i]) << 16);
}

}  // namespace

bool supports_convert_to_bf16(const float* x, uint16_t* y, int64_t n, std::string* reason) {
  return size_ok("convert_to_bf16", n, x, "x", reason, y, "y");
}
bool supports_convert_to_f32(const uint16_t* x, float* y, int64_t n, std::string* reason) {
  return size_ok("convert_to_f32", n, x, "x", reason, y, "y");
}
bool supports_add_inplace(Elements y, ConstElements x, int64_t n, std::string* reason) {
  return size_ok("add_inplace", n, y.get(), "y", reason, x.get(), "x");
}
bool supports_scale_inplace(float* x, float, int64_t n, std::string* reason) {
  return size_ok("scale_inplace", n, x, "x", reason);
}
bool supports_softcap_inplace(float* x, float cap, int64_t n, std::string* reason) {
  if (!(cap > 0.0f)) return detail::refuse(reason, "softcap_inplace", "cap " + std::to_string(cap) + " must be positive");
  return size_ok("softcap_inplace", n, x, "x", reason);
}
bool supports_sum_squares(const float* x, int64_t n, std::string* reason) {
  return size_ok("sum_squares", n, x, "x", reason) && chunks_ok("sum_squares", n, reason);
}
bool supports_sum_squares_accumulate(const float* x, int64_t n, double* total, std::string* reason) {
  constexpr const char* op = "sum_squares_accumulate";
  return size_ok(op, n, x, "x", reason) && detail::pointer_set(total, op, "total", reason) &&
         chunks_ok(op, n, reason);
}

void convert_to_bf16(const float* x, uint16_t* y, int64_t n) {
  if (std::string why; !supports_convert_to_bf16(x, y, n, &why)) fail_message(why);
  if (n == 0) return;
  to_bf16_kernel<<<detail::grid_blocks(n, kThreads), kThreads, 0, stream()>>>(x, y, n);
  FORGE_CUDA_CHECK_LAUNCH("convert_to_bf16");
}

void convert_to_f32(const uint16_t* x, float* y, int64_t n) {
  if (std::string why; !supports_convert_to_f32(x, y, n, &why)) fail_message(why);
  if (n == 0) return;
  to_f32_kernel<<<detail::grid_blocks(n, kThreads), kThreads, 0, stream()>>>(x, y, n);
  FORGE_CUDA_CHECK_LAUNCH("convert_to_f32");
}

void add_inplace(Elements y, ConstElements x, int64_t n) {
  if (std::string why; !supports_add_inplace(y, x, n, &why)) fail_message(why);
  if (n == 0) return;
  visit(y, [&](auto* out) {
    visit(x, [&](const auto* in) {
      add_inplace_kernel<<<detail::grid_blocks(n, kThreads), kThreads, 0, stream()>>>(out, in, n);
    });
  });
  FORGE_CUDA_CHECK_LAUNCH("add_inplace");
}

void scale_inplace(float* x, float s, int64_t n) {
  if (std::string why; !supports_scale_inplace(x, s, n, &why)) fail_message(why);
  if (n == 0) return;
  scale_inplace_kernel<<<detail::grid_blocks(n, kThreads), kThreads, 0, stream()>>>(x, s, n);
  FORGE_CUDA_CHECK_LAUNCH("scale_inplace");
}

void softcap_inplace(float* x, float cap, int64_t n) {
  if (std::string why; !supports_softcap_inplace(x, cap, n, &why)) fail_message(why);
  if (n == 0) return;
  softcap_inplace_kernel<<<detail::grid_blocks(n, kThreads), kThreads, 0, stream()>>>(x, cap, 1.0f / cap, n);
  FORGE_CUDA_CHECK_LAUNCH("softcap_inplace");
}

namespace {

// The two-pass reduction of x's squares into *total (overwritten, or added to with accumulate).
void launch_sum_squares(const char* op, const float* x, int64_t n, double* total, bool accumulate) {
  const int64_t chunks = (n + kSumChunk - 1) / kSumChunk;  // checked by the predicates
  detail::StreamScratch scratch(chunks * sizeof(double));
  double* partial = scratch.as<double>();
  sum_squares_chunks_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(x, n, partial);
  FORGE_CUDA_CHECK_LAUNCH(op);
  sum_partials_kernel<<<1, kFinalThreads, 0, stream()>>>(partial, chunks, total, accumulate);
  FORGE_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

double sum_squares(const float* x, int64_t n) {
  if (std::string why; !supports_sum_squares(x, n, &why)) fail_message(why);
  if (n == 0) return 0.0;
  detail::StreamScratch total(sizeof(double));
  launch_sum_squares("sum_squares", x, n, total.as<double>(), /*accumulate=*/false);
  double result = 0;
  FORGE_CUDA_CHECK(cudaMemcpyAsync(&result, total.as<double>(), sizeof(double), cudaMemcpyDeviceToHost, stream()));
  synchronize();
  return result;
}

void sum_squares_accumulate(const float* x, int64_t n, double* total) {
  constexpr const char* op = "sum_squares_accumulate";
  if (std::string why; !supports_sum_squares_accumulate(x, n, total, &why)) fail_message(why);
  if (n > 0) launch_sum_squares(op, x, n, total, /*accumulate=*/true);
}

}  // namespace forge::cuda
