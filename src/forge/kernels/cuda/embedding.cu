// Embedding lookup and its weight gradient on device memory (see cpu/embedding.cpp).
//
// Ids live on the device, yet a bad id must fail with the culprit (as on the CPU) and must never make a
// kernel read or write outside the table. So both ops first scan the ids on the device and copy back the
// first bad row: one small kernel and one round trip per call, before anything is written.
//
// backward_weight is a scatter-add, deterministic without float atomics: a stable radix sort (CUB) groups the
// rows by id, keeping rows of one id in increasing order, and one block per group (and column tile) adds the
// group's dout rows onto dweight[id] one after another. That is the CPU kernel's order exactly, and additions
// are all it does, so the two backends give bitwise-equal gradients.
//
// Vocabulary-parallel (p.vocab_parallel): ids are global and only [first, first + vocab) is this rank's; the
// others give zero rows forward and sort behind every real row (key = vocab) in backward, where no block
// accumulates them. Nothing is out of range then, so there is no id check.
#include <bit>
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {
using detail::load_element;

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 0x7fffffff;
constexpr unsigned long long kNoBadRow = ~0ull;

__global__ void find_bad_id_kernel(const int32_t* __restrict__ ids, int64_t rows, int64_t vocab,
                                   unsigned long long* __restrict__ first_bad_row) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const int32_t id = ids[r];
    // An integer minimum: the reported row does not depend on which thread gets there first.
    if (id < 0 || id >= vocab) atomicMin(first_bad_row, static_cast<unsigned long long>(r));
  }
}

// The shape, and where there are rows the ids set.
bool ids_ok(const ops::EmbeddingParams& p, const char* op, std::string* reason) {
  if (p.rows < 0 || p.dim <= 0 || p.vocab <= 0)
    return detail::refuse(reason, op,
                          "bad shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim) +
                              " vocab=" + std::to_string(p.vocab));
  return p.rows == 0 || detail::pointer_set(p.ids, op, "ids", reason);
}

// The ids themselves (data, after the predicate): fails like the CPU kernel when one lies outside [0, vocab).
// Synchronises.
void check_ids(const ops::EmbeddingParams& p, const char* op) {
  if (p.rows == 0 || p.vocab_parallel) return;
  detail::StreamScratch flag(sizeof(unsigned long long));
  auto* first_bad_row = flag.as<unsigned long long>();
  FORGE_CUDA_CHECK(cudaMemsetAsync(first_bad_row, 0xff, sizeof(unsigned long long), stream()));
  find_bad_id_kernel<<<detail::grid_blocks(p.rows, kThreads), kThreads, 0, stream()>>>(p.ids, p.rows, p.vocab,
                                                                                       first_bad_row);
  FORGE_CUDA_CHECK_LAUNCH(op);
  unsigned long long bad_row = kNoBadRow;
  FORGE_CUDA_CHECK(
      cudaMemcpyAsync(&bad_row, first_bad_row, sizeof(bad_row), cudaMemcpyDeviceToHost, stream()));
  synchronize();
  if (bad_row == kNoBadRow) return;
  int32_t id = 0;
  FORGE_CUDA_CHECK(cudaMemcpyAsync(&id, p.ids + bad_row, sizeof(id), cudaMemcpyDeviceToHost, stream()));
  synchronize();
  detail::fail_op(op, "token id " + std::to_string(id) + " at row " + std::to_string(bad_row) +
                          " is outside the vocabulary [0, " + std::to_string(p.vocab) + ")");
}

// first: the global id of the weight's row 0 (0 unless vocabulary-parallel, where ids outside [first, first +
// vocab) give zero rows; without it every id was checked to lie in [0, vocab)).
template <typename T>
__global__ void forward_kernel(const int32_t* __restrict__ ids, const T* __restrict__ weight, int64_t rows,
                               int64_t dim, int64_t vocab, int64_t first, float* __restrict__ out) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t local = int64_t{ids[row]} - first;
    float* dst = out + row * dim;
    if (local < 0 || local >= vocab) {
      for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = 0.0f;
      continue;
    }
    const T* src = weight + local * dim;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = load_element(src, j);
  }
}

// Sort keys of a vocabulary-parallel backward: the local row, or vocab (behind every real row) for ids that
// are another rank's.
__global__ void local_keys_kernel(const int32_t* __restrict__ ids, int64_t rows, int64_t vocab, int64_t first,
                                  uint32_t* __restrict__ keys) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t r = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const int64_t local = int64_t{ids[r]} - first;
    keys[r] = static_cast<uint32_t>(local >= 0 && local < vocab ? local : vocab);
  }
}

__global__ void iota_kernel(int32_t* __restrict__ values, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    values[i] = static_cast<int32_t>(i);
}

// Block (blockIdx.x = position in the sorted order, blockIdx.y = column tile). Only the first position of
// each run of equal ids does work: it finds the run's end by binary search and adds the run's dout rows, in
// increasing row order, onto dweight[id]. Runs are disjoint, so no two blocks write the same element.
__global__ void accumulate_kernel(const uint32_t* __restrict__ sorted_ids,
                                  const int32_t* __restrict__ sorted_rows, int64_t rows, int64_t dim,
                                  int64_t vocab, const float* __restrict__ dout, float* __restrict__ dweight) {
  const int64_t start = blockIdx.x;
  const uint32_t id = sorted_ids[start];
  if (id >= vocab) return;  // another rank's ids (vocabulary-parallel), uniform across the block
  if (start > 0 && sorted_ids[start - 1] == id) return;  // uniform across the block
  __shared__ int64_t run_end;
  if (threadIdx.x == 0) {
    int64_t lo = start + 1, hi = rows;  // sorted_ids[lo - 1] == id; positions >= hi hold larger ids
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (sorted_ids[mid] == id)
        lo = mid + 1;
      else
        hi = mid;
    }
    run_end = lo;
  }
  __syncthreads();
  const int64_t end = run_end;
  const int64_t j = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  float* dst = dweight + int64_t{id} * dim + j;
  float acc = *dst;
  // Sequential additions by design (the CPU order); unrolling lets later rows' loads start early.
#pragma unroll 8
  for (int64_t k = start; k < end; ++k) acc = __fadd_rn(acc, dout[int64_t{sorted_rows[k]} * dim + j]);
  *dst = acc;
}

}  // namespace

bool supports_embedding_forward(const ops::EmbeddingParams& p, std::string* reason) {
  constexpr const char* op = "embedding_forward";
  if (!ids_ok(p, op, reason)) return false;
  return p.rows == 0 ||
         (detail::pointer_set(p.weight, op, "weight", reason) && detail::pointer_set(p.out, op, "out", reason));
}

bool supports_embedding_backward_weight(const ops::EmbeddingParams& p, std::string* reason) {
  constexpr const char* op = "embedding_backward_weight";
  if (!ids_ok(p, op, reason)) return false;
  if (p.rows == 0) return true;
  if (!detail::pointer_set(p.dout, op, "dout", reason) || !detail::pointer_set(p.dweight, op, "dweight", reason))
    return false;
  const int64_t column_tiles = (p.dim + kThreads - 1) / kThreads;
  if (p.rows > kMaxGrid || column_tiles > 65535)
    return detail::refuse(reason, op,
                          "shape rows=" + std::to_string(p.rows) + " dim=" + std::to_string(p.dim) +
                              " exceeds the kernel's grid (rows < 2^31, dim at most " +
                              std::to_string(65535 * kThreads) + ")");
  return true;
}

void embedding_forward(const ops::EmbeddingParams& p) {
  constexpr const char* op = "embedding_forward";
  if (std::string why; !supports_embedding_forward(p, &why)) fail_message(why);
  check_ids(p, op);
  if (p.rows == 0) return;
  visit(p.weight, [&](const auto* weight) {
    forward_kernel<<<static_cast<unsigned>(std::min(p.rows, kMaxGrid)), kThreads, 0, stream()>>>(
        p.ids, weight, p.rows, p.dim, p.vocab, p.vocab_parallel ? p.first : 0, p.out);
  });
  FORGE_CUDA_CHECK_LAUNCH(op);
}

void embedding_backward_weight(const ops::EmbeddingParams& p) {
  constexpr const char* op = "embedding_backward_weight";
  if (std::string why; !supports_embedding_backward_weight(p, &why)) fail_message(why);
  check_ids(p, op);
  if (p.rows == 0) return;
  const int64_t column_tiles = (p.dim + kThreads - 1) / kThreads;
  const int rows = static_cast<int>(p.rows);
  // Valid ids are non-negative and below vocab: sorting them as unsigned over their significant bits only
  // saves radix passes. Vocabulary-parallel keys also take the value vocab (rows of other ranks).
  const uint64_t largest_key = static_cast<uint64_t>(p.vocab_parallel ? p.vocab : p.vocab - 1);
  const int end_bit = std::max(1, static_cast<int>(std::bit_width(largest_key)));
  const auto* keys = reinterpret_cast<const uint32_t*>(p.ids);
  size_t sort_bytes = 0;
  FORGE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, keys, static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), rows, 0, end_bit, stream()));
  const size_t array_bytes = detail::align_bytes(static_cast<size_t>(rows) * sizeof(int32_t));
  detail::StreamScratch scratch(4 * array_bytes + sort_bytes);
  auto* sorted_ids = scratch.as<uint32_t>();
  auto* row_index = scratch.as<int32_t>(array_bytes);
  auto* sorted_rows = scratch.as<int32_t>(2 * array_bytes);
  auto* local_keys = scratch.as<uint32_t>(3 * array_bytes);
  void* sort_storage = scratch.as<char>(4 * array_bytes);
  if (p.vocab_parallel) {
    local_keys_kernel<<<detail::grid_blocks(p.rows, kThreads), kThreads, 0, stream()>>>(p.ids, p.rows, p.vocab,
                                                                                        p.first, local_keys);
    FORGE_CUDA_CHECK_LAUNCH(op);
    keys = local_keys;
  }
  iota_kernel<<<detail::grid_blocks(p.rows, kThreads), kThreads, 0, stream()>>>(row_index, p.rows);
  FORGE_CUDA_CHECK_LAUNCH(op);
  FORGE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_storage, sort_bytes, keys, sorted_ids, row_index,
                                                   sorted_rows, rows, 0, end_bit, stream()));
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(column_tiles));
  accumulate_kernel<<<grid, kThreads, 0, stream()>>>(sorted_ids, sorted_rows, p.rows, p.dim, p.vocab, p.dout,
                                                     p.dweight);
  FORGE_CUDA_CHECK_LAUNCH(op);
}

}  // namespace forge::cuda
