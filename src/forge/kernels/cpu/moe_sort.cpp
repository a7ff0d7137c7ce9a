// moe_sort_by_expert: a counting sort of the top-k assignments by expert (ops.h, MoeSortParams). One pass
// counts, an exclusive scan places the experts, a second pass in assignment order hands out rows, so the
// order within an expert is the assignment order (stable) and nothing depends on the thread count. Each
// expert's segment is rounded up to a multiple of align (or is the capacity, rounded up, under
// pad_to_capacity); source is filled with -1 first, which its padding
// rows and its tail keep. A few hundred thousand assignments take well under a millisecond on one thread; the
// layer's GEMMs dwarf it.
#include <algorithm>
#include <limits>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {

bool supports_moe_sort_by_expert(const ops::MoeSortParams& p, std::string* reason) {
  constexpr const char* op = "moe_sort_by_expert";
  if (p.tokens < 0 || p.top_k <= 0 || p.experts <= 0)
    return ops::refuse(reason, "{}: bad shape tokens={} top_k={} experts={}", op, p.tokens, p.top_k,
                       p.experts);
  if (p.tokens > std::numeric_limits<int32_t>::max() / p.top_k)
    return ops::refuse(reason, "{}: tokens * top_k = {} * {} does not fit the int32 rows", op, p.tokens,
                       p.top_k);
  if (p.capacity < 0) return ops::refuse(reason, "{}: negative capacity {}", op, p.capacity);
  if (p.align < 1) return ops::refuse(reason, "{}: align must be >= 1, got {}", op, p.align);
  if (p.pad_to_capacity && p.capacity == 0)
    return ops::refuse(reason, "{}: pad_to_capacity needs a capacity (0: dropless)", op);
  constexpr int64_t int32_max = std::numeric_limits<int32_t>::max();
  if (p.align - 1 > (int32_max - p.tokens * p.top_k) / p.experts)
    return ops::refuse(
        reason, "{}: tokens * top_k + experts * (align - 1) = {} * {} + {} * {} does not fit the int32 rows",
        op, p.tokens, p.top_k, p.experts, p.align - 1);
  if (p.pad_to_capacity && p.capacity + p.align - 1 > int32_max / p.experts)
    return ops::refuse(reason, "{}: experts * round_up(capacity, align) = {} * {} does not fit the int32 rows",
                       op, p.experts, ops::moe_segment_rows(p, 0));
  if (!p.offsets) return ops::refuse(reason, "{}: offsets is null", op);
  if (p.tokens > 0 && (!p.expert_ids || !p.row_of || !p.source))
    return ops::refuse(reason, "{}: expert_ids, row_of and source are required", op);
  if (const int64_t bound = ops::moe_sorted_rows_bound(p); bound > 0 && !p.source)
    return ops::refuse(reason, "{}: source is null (its {} entries are written even without tokens)", op,
                       bound);
  return true;
}

void moe_sort_by_expert(const ops::MoeSortParams& p) {
  if (std::string why; !supports_moe_sort_by_expert(p, &why)) fail("{}", why);
  const int64_t n = p.tokens * p.top_k, experts = p.experts;
  for (int64_t a = 0; a < n; ++a)
    if (p.expert_ids[a] < 0 || p.expert_ids[a] >= experts)
      fail("moe_sort_by_expert: expert id {} of assignment {} (token {}, choice {}) is outside [0, {})",
           p.expert_ids[a], a, a / p.top_k, a % p.top_k, experts);
  std::vector<int64_t> count(static_cast<size_t>(experts), 0);
  for (int64_t a = 0; a < n; ++a) ++count[p.expert_ids[a]];
  p.offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t kept = p.capacity > 0 ? std::min(count[e], p.capacity) : count[e];
    p.offsets[e + 1] = p.offsets[e] + ops::moe_segment_rows(p, kept);
    if (p.counts) p.counts[e] = count[e];
  }
  // -1 first: the padding rows and everything past R keep it.
  if (const int64_t bound = ops::moe_sorted_rows_bound(p); bound > 0)
    std::fill(p.source, p.source + bound, -1);
  std::vector<int64_t> placed(static_cast<size_t>(experts), 0);  // assignments seen per expert, in order
  for (int64_t a = 0; a < n; ++a) {
    const int32_t e = p.expert_ids[a];
    const int64_t position = placed[e]++;
    if (p.capacity > 0 && position >= p.capacity) {
      p.row_of[a] = -1;
      continue;
    }
    const int64_t row = p.offsets[e] + position;
    p.row_of[a] = static_cast<int32_t>(row);
    p.source[row] = static_cast<int32_t>(a);
  }
}

}  // namespace forge::cpu
