// The two data-movement ops of attention across a context-parallel group (parallel/context_parallel.cpp):
// merging a block's partial attention by log-sum-exp, and strided copies that pack and unpack slices (fp32
// or bf16 on either side, converting).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"
#include "forge/kernels/support.h"

namespace forge::cpu {

bool supports_attention_merge(const ops::AttentionMergeParams& p, std::string* reason) {
  if (p.batch < 0 || p.seq < 0 || p.heads < 0 || p.v_dim < 0)
    return ops::refuse(reason, "attention_merge: bad shape batch={} seq={} heads={} v_dim={}", p.batch, p.seq,
                       p.heads, p.v_dim);
  if (p.batch * p.seq * p.heads * p.v_dim > 0 && (!p.out || !p.lse || !p.out_b || !p.lse_b))
    return ops::refuse(reason, "attention_merge: out, lse, out_b and lse_b must be set");
  return true;
}

void attention_merge(const ops::AttentionMergeParams& p) {
  if (std::string why; !supports_attention_merge(p, &why)) fail("{}", why);
  const int64_t rows = p.batch * p.heads * p.seq, width = p.heads * p.v_dim;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % p.seq, h = (r / p.seq) % p.heads, b = r / (p.seq * p.heads);
    const double old_lse = p.lse[r], new_lse = p.lse_b[r];
    if (new_lse == -std::numeric_limits<double>::infinity()) continue;
    const double m = std::max(old_lse, new_lse);
    const double total = m + std::log(std::exp(old_lse - m) + std::exp(new_lse - m));
    const float w_old = static_cast<float>(std::exp(old_lse - total)),
                w_new = static_cast<float>(std::exp(new_lse - total));
    float* o = p.out + (b * p.seq + t) * width + h * p.v_dim;
    const float* ob = p.out_b + (b * p.seq + t) * width + h * p.v_dim;
    for (int64_t i = 0; i < p.v_dim; ++i) o[i] = w_old * o[i] + w_new * ob[i];
    p.lse[r] = static_cast<float>(total);
  }
}

bool supports_strided_copy(const ops::StridedCopyParams& p, std::string* reason) {
  for (int a = 0; a < 3; ++a)
    if (p.shape[a] < 0)
      return ops::refuse(reason, "strided_copy: bad shape {}x{}x{}", p.shape[0], p.shape[1], p.shape[2]);
  if (p.shape[0] * p.shape[1] * p.shape[2] > 0 && (!p.src || !p.dst))
    return ops::refuse(reason, "strided_copy: src and dst must be set");
  return true;
}

namespace {

template <typename Src, typename Dst>
void copy_rows(const ops::StridedCopyParams& p, const Src* src, Dst* dst) {
  const int64_t outer = p.shape[0] * p.shape[1];
  const bool parallel = outer * p.shape[2] >= 16384;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t ij = 0; ij < outer; ++ij) {
    const int64_t i = ij / p.shape[1], j = ij % p.shape[1];
    const Src* s = src + i * p.src_stride[0] + j * p.src_stride[1];
    Dst* d = dst + i * p.dst_stride[0] + j * p.dst_stride[1];
    const int64_t ss = p.src_stride[2], ds = p.dst_stride[2];
    if constexpr (std::is_same_v<Src, Dst>) {
      if (ss == 1 && ds == 1 && !p.accumulate) {
        std::copy_n(s, p.shape[2], d);
        continue;
      }
    }
    for (int64_t k = 0; k < p.shape[2]; ++k) {
      const float x = load_float(s, k * ss);
      store_float(d, k * ds, p.accumulate ? load_float(d, k * ds) + x : x);
    }
  }
}

}  // namespace

void strided_copy(const ops::StridedCopyParams& p) {
  if (std::string why; !supports_strided_copy(p, &why)) fail("{}", why);
  if (p.shape[0] * p.shape[1] * p.shape[2] == 0) return;
  visit(p.src, [&](const auto* src) { visit(p.dst, [&](auto* dst) { copy_rows(p, src, dst); }); });
}

}  // namespace forge::cpu
