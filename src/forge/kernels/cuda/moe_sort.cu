// moe_sort_by_expert on device memory (ops.h, MoeSortParams; cpu/moe_sort.cpp): a counting sort,
// deterministic and stable, in four small kernels. Integer atomics only (their sums do not depend on the
// order).
//   1. check:  the first assignment whose id lies outside [0, experts) (an integer minimum), copied back:
//              a bad id fails with the CPU's line before anything is written. One round trip per call (the
//              caller copies the offsets back for the grouped GEMMs anyway).
//   2. count:  one block per chunk of kChunk assignments: each assignment's rank among the earlier ones of
//              the chunk with the same expert (a loop over them: kChunk is small), and the chunk's
//              per-expert counts.
//   3. scan:   one block: per expert, an exclusive scan of the chunks' counts (its total is counts[e]), then
//              the offsets over the experts (kept = min(count, capacity) under a capacity, each segment
//              round_up(kept, align) rows; round_up(capacity, align) under pad_to_capacity).
//   4. place:  one block per chunk: position within the expert = chunk base + rank, which is the
//              assignment's place in increasing assignment order; under a capacity positions >= capacity
//              are dropped. source is set to -1 first, which padding rows and the tail past R keep.
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kChunk = 256;  // assignments per block of count and place (one per thread)
constexpr int kScanThreads = 256;
constexpr int64_t kMaxExperts = 8192;               // count's per-expert shared counters (32 KiB)
constexpr unsigned kNoBadAssignment = 0xffffffffu;  // above every assignment index (n < 2^31)

__global__ void find_bad_expert_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t experts,
                                       unsigned* __restrict__ first_bad) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t a = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; a < n; a += stride)
    if (ids[a] < 0 || ids[a] >= experts) atomicMin(first_bad, static_cast<unsigned>(a));
}

// hist [chunks][experts]: chunk c's count of expert e. rank [n]: among the chunk's earlier assignments, those
// with the same expert.
__global__ void count_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t experts,
                             int32_t* __restrict__ hist, int32_t* __restrict__ rank) {
  extern __shared__ int32_t counts[];  // [experts]
  __shared__ int32_t chunk_ids[kChunk];
  const int64_t first = int64_t{blockIdx.x} * kChunk, a = first + threadIdx.x;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  const int32_t id = a < n ? ids[a] : -1;
  chunk_ids[threadIdx.x] = id;
  __syncthreads();
  if (a < n) {
    int32_t before = 0;
    for (int i = 0; i < static_cast<int>(threadIdx.x); ++i) before += chunk_ids[i] == id ? 1 : 0;
    rank[a] = before;
    atomicAdd(&counts[id], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    hist[int64_t{blockIdx.x} * experts + e] = counts[e];
}

// hist becomes, per expert, the exclusive scan over chunks (how many of the expert's assignments come before
// the chunk); then offsets and counts.
// padded > 0 (pad_to_capacity): every segment holds that many rows, rounded up to align.
__global__ void scan_kernel(int32_t* __restrict__ hist, int64_t chunks, int64_t experts, int64_t capacity,
                            int64_t align, int64_t padded, int64_t* __restrict__ offsets,
                            int64_t* __restrict__ counts, int64_t* __restrict__ totals) {
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t running = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t here = hist[c * experts + e];
      hist[c * experts + e] = static_cast<int32_t>(running);
      running += here;
    }
    totals[e] = running;
    if (counts) counts[e] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t offset = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t kept = padded > 0 ? padded : capacity > 0 && totals[e] > capacity ? capacity : totals[e];
      offset += (kept + align - 1) / align * align;
      offsets[e + 1] = offset;
    }
  }
}

__global__ void place_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t experts, int64_t capacity,
                             const int32_t* __restrict__ hist, const int32_t* __restrict__ rank,
                             const int64_t* __restrict__ offsets, int32_t* __restrict__ row_of,
                             int32_t* __restrict__ source) {
  const int64_t a = int64_t{blockIdx.x} * kChunk + threadIdx.x;
  if (a >= n) return;
  const int32_t e = ids[a];
  const int64_t position = int64_t{hist[int64_t{blockIdx.x} * experts + e]} + rank[a];
  if (capacity > 0 && position >= capacity) {
    row_of[a] = -1;
    return;
  }
  const int64_t row = offsets[e] + position;
  row_of[a] = static_cast<int32_t>(row);
  source[row] = static_cast<int32_t>(a);
}

}  // namespace

bool supports_moe_sort_by_expert(const ops::MoeSortParams& p, std::string* reason) {
  constexpr const char* op = "moe_sort_by_expert";
  if (p.tokens < 0 || p.top_k <= 0 || p.experts <= 0)
    return detail::refuse(reason, op,
                          "bad shape tokens=" + std::to_string(p.tokens) +
                              " top_k=" + std::to_string(p.top_k) + " experts=" + std::to_string(p.experts));
  if (p.tokens > 0x7fffffff / p.top_k)
    return detail::refuse(reason, op,
                          "tokens * top_k = " + std::to_string(p.tokens) + " * " + std::to_string(p.top_k) +
                              " does not fit the int32 rows");
  if (p.capacity < 0) return detail::refuse(reason, op, "negative capacity " + std::to_string(p.capacity));
  if (p.align < 1) return detail::refuse(reason, op, "align must be >= 1, got " + std::to_string(p.align));
  if (p.pad_to_capacity && p.capacity == 0)
    return detail::refuse(reason, op, "pad_to_capacity needs a capacity (0: dropless)");
  if (p.align - 1 > (0x7fffffff - p.tokens * p.top_k) / p.experts)
    return detail::refuse(reason, op,
                          "tokens * top_k + experts * (align - 1) = " + std::to_string(p.tokens) + " * " +
                              std::to_string(p.top_k) + " + " + std::to_string(p.experts) + " * " +
                              std::to_string(p.align - 1) + " does not fit the int32 rows");
  if (p.pad_to_capacity && p.capacity + p.align - 1 > 0x7fffffff / p.experts)
    return detail::refuse(reason, op,
                          "experts * round_up(capacity, align) = " + std::to_string(p.experts) + " * " +
                              std::to_string(ops::moe_segment_rows(p, 0)) + " does not fit the int32 rows");
  if (p.experts > kMaxExperts)
    return detail::refuse(reason, op,
                          "experts " + std::to_string(p.experts) + " > " + std::to_string(kMaxExperts) +
                              " (the CUDA kernel's per-block counters)");
  if (!detail::pointer_set(p.offsets, op, "offsets", reason)) return false;
  if (p.tokens > 0 && (!p.expert_ids || !p.row_of || !p.source))
    return detail::refuse(reason, op, "expert_ids, row_of and source are required");
  if (const int64_t bound = ops::moe_sorted_rows_bound(p); bound > 0 && !p.source)
    return detail::refuse(
        reason, op,
        "source is null (its " + std::to_string(bound) + " entries are written even without tokens)");
  return true;
}

void moe_sort_by_expert(const ops::MoeSortParams& p) {
  constexpr const char* op = "moe_sort_by_expert";
  if (std::string why; !supports_moe_sort_by_expert(p, &why)) fail_message(why);
  const int64_t n = p.tokens * p.top_k, experts = p.experts;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const size_t hist_bytes =
      detail::align_bytes(static_cast<size_t>(std::max<int64_t>(chunks, 1) * experts) * 4);
  const size_t rank_bytes = detail::align_bytes(static_cast<size_t>(std::max<int64_t>(n, 1)) * 4);
  const size_t totals_bytes = detail::align_bytes(static_cast<size_t>(experts) * 8);
  detail::StreamScratch scratch(hist_bytes + rank_bytes + totals_bytes + 256);
  auto* hist = scratch.as<int32_t>();
  auto* rank = scratch.as<int32_t>(hist_bytes);
  auto* totals = scratch.as<int64_t>(hist_bytes + rank_bytes);
  auto* first_bad = scratch.as<unsigned>(hist_bytes + rank_bytes + totals_bytes);
  if (n > 0) {
    FORGE_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned), stream()));  // kNoBadAssignment
    find_bad_expert_kernel<<<detail::grid_blocks(n, 256), 256, 0, stream()>>>(p.expert_ids, n, experts,
                                                                              first_bad);
    FORGE_CUDA_CHECK_LAUNCH(op);
    unsigned bad = kNoBadAssignment;
    FORGE_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad, sizeof bad, cudaMemcpyDeviceToHost, stream()));
    synchronize();
    if (bad != kNoBadAssignment) {
      int32_t id = 0;
      FORGE_CUDA_CHECK(cudaMemcpyAsync(&id, p.expert_ids + bad, sizeof id, cudaMemcpyDeviceToHost, stream()));
      synchronize();
      detail::fail_op(op, "expert id " + std::to_string(id) + " of assignment " + std::to_string(bad) +
                              " (token " + std::to_string(bad / p.top_k) + ", choice " +
                              std::to_string(bad % p.top_k) + ") is outside [0, " + std::to_string(experts) +
                              ")");
    }
    count_kernel<<<static_cast<unsigned>(chunks), kChunk, static_cast<size_t>(experts) * 4, stream()>>>(
        p.expert_ids, n, experts, hist, rank);
    FORGE_CUDA_CHECK_LAUNCH(op);
  }
  scan_kernel<<<1, kScanThreads, 0, stream()>>>(hist, chunks, experts, p.capacity, p.align,
                                                p.pad_to_capacity ? p.capacity : 0, p.offsets, p.counts,
                                                totals);
  FORGE_CUDA_CHECK_LAUNCH(op);
  const int64_t bound = ops::moe_sorted_rows_bound(p);
  if (bound > 0)  // -1: padding rows and everything past R
    FORGE_CUDA_CHECK(cudaMemsetAsync(p.source, 0xff, static_cast<size_t>(bound) * 4, stream()));
  if (n == 0) return;
  place_kernel<<<static_cast<unsigned>(chunks), kChunk, 0, stream()>>>(
      p.expert_ids, n, experts, p.capacity, hist, rank, p.offsets, p.row_of, p.source);
  FORGE_CUDA_CHECK_LAUNCH(op);
}

}  // namespace forge::cuda
