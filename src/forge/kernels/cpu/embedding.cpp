// Embedding lookup and its weight gradient. Ids are validated before any parallel work (an exception
// must not escape an OpenMP region). The scatter-add in backward gives each thread a disjoint range of
// columns and walks the rows in order, so there are no races and every element is summed in the same
// order whatever the thread count.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

bool supports(const ops::EmbeddingParams& p, const char* what, std::string* reason) {
  if (p.rows >= 0 && p.dim > 0 && p.vocab > 0) return true;
  return ops::refuse(reason, "{}: bad shape rows={} dim={} vocab={}", what, p.rows, p.dim, p.vocab);
}

// The parameters (the predicate), then the ids (data).
void check_ids(const ops::EmbeddingParams& p, const char* what) {
  if (std::string why; !supports(p, what, &why)) fail("{}", why);
  if (p.vocab_parallel) return;  // ids outside this rank's range are another rank's
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t id = p.ids[r];
    if (id < 0 || id >= p.vocab)
      fail_permanently("{}: token id {} at row {} is outside the vocabulary [0, {})", what, id, r, p.vocab);
  }
}

// Columns per ownership unit: a cache line of floats, so two threads never write the same line.
constexpr int64_t kColumnAlign = 16;

// Row r's row of the weight, or -1 when a vocabulary-parallel id lies in another rank's range.
int64_t local_row(const ops::EmbeddingParams& p, int64_t r) {
  const int64_t local = int64_t{p.ids[r]} - (p.vocab_parallel ? p.first : 0);
  return local >= 0 && local < p.vocab ? local : -1;
}

}  // namespace

bool supports_embedding_forward(const ops::EmbeddingParams& p, std::string* reason) {
  return supports(p, "embedding_forward", reason);
}
bool supports_embedding_backward_weight(const ops::EmbeddingParams& p, std::string* reason) {
  return supports(p, "embedding_backward_weight", reason);
}

void embedding_forward(const ops::EmbeddingParams& p) {
  check_ids(p, "embedding_forward");
  const size_t row_bytes = p.dim * sizeof(float);
  const float* f32 = p.weight.f32();
  const uint16_t* bf16 = p.weight.bf16();
#pragma omp parallel for schedule(static) if (p.rows * p.dim > (1 << 14))
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t local = local_row(p, r);
    float* out = p.out + r * p.dim;
    if (local < 0)
      std::memset(out, 0, row_bytes);
    else if (f32)
      std::memcpy(out, f32 + local * p.dim, row_bytes);
    else
      for (int64_t j = 0; j < p.dim; ++j) out[j] = bf16_bits_to_f32(bf16[local * p.dim + j]);
  }
}

void embedding_backward_weight(const ops::EmbeddingParams& p) {
  check_ids(p, "embedding_backward_weight");
  const int64_t dim = p.dim;
  const int64_t units = (dim + kColumnAlign - 1) / kColumnAlign;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t begin = std::min(dim, units * thread / threads * kColumnAlign);
    const int64_t end = std::min(dim, units * (thread + 1) / threads * kColumnAlign);
    for (int64_t r = 0; r < p.rows && begin < end; ++r) {
      const int64_t local = local_row(p, r);
      if (local < 0) continue;
      const float* src = p.dout + r * dim;
      float* dst = p.dweight + local * dim;
#pragma omp simd
      for (int64_t j = begin; j < end; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace forge::cpu
