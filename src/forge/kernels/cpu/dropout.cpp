// Dropout with masks drawn from where each element sits in the data (kernels/dropout_mask.h): one
// Philox4x32-10 block gives the mask of four columns of one token.
#include <algorithm>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"
#include "forge/kernels/dropout_mask.h"

namespace forge::cpu {
namespace {

// Philox blocks a row draws at once: the block loop runs across SIMD lanes (the rounds' 32 x 32 -> 64-bit
// products vectorise), then the elements take their words.
constexpr int64_t kQuads = 16;

template <typename E>
void dropout_as(const ops::DropoutParams& p) {
  using T = typename E::T;
  const auto* x = static_cast<const T*>(p.x);
  auto* y = static_cast<T*>(p.y);
  const float scale = 1.0f / (1.0f - p.rate);
  const int64_t quads = (p.cols + 3) / 4;
#pragma omp parallel for schedule(static) if (p.rows * p.cols > (1 << 14))
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t local = p.row_begin + r, at = local % p.seq;
    const int64_t sample = p.first_sample + local / p.seq;
    const int64_t position = p.positions ? p.positions[at] : at;
    const T* in = x + r * p.cols;
    T* out = y + r * p.cols;
    alignas(64) uint32_t words[4 * kQuads];  // column 4 q0 + c's word at c
    for (int64_t q0 = 0; q0 < quads; q0 += kQuads) {
#pragma omp simd
      for (int64_t i = 0; i < kQuads; ++i) {
        const philox::Words w = ops::dropout_words(p.seed, p.stream, sample, position, q0 + i);
        words[4 * i] = w.v[0], words[4 * i + 1] = w.v[1], words[4 * i + 2] = w.v[2],
                  words[4 * i + 3] = w.v[3];
      }
      const int64_t first = 4 * q0, count = std::min(p.cols - first, 4 * kQuads);
#pragma omp simd
      for (int64_t c = 0; c < count; ++c)
        E::store(out, first + c,
                 ops::dropout_keeps(words[c], p.rate) ? E::load(in, first + c) * scale : 0.0f);
    }
  }
}

}  // namespace

bool supports_dropout(const ops::DropoutParams& p, std::string* reason) {
  if (p.dtype != DType::f32 && p.dtype != DType::bf16)
    return ops::refuse(reason, "dropout: tensors must be fp32 or bf16, not {}", dtype_name(p.dtype));
  if (!(p.rate >= 0.0f && p.rate < 1.0f))
    return ops::refuse(reason, "dropout: rate {} is not in [0, 1)", p.rate);
  if (p.rows < 0 || p.cols <= 0 || p.seq <= 0 || p.row_begin < 0 || p.first_sample < 0)
    return ops::refuse(reason, "dropout: bad shape rows={} cols={} seq={} row_begin={} first_sample={}",
                       p.rows, p.cols, p.seq, p.row_begin, p.first_sample);
  return true;
}

void dropout(const ops::DropoutParams& p) {
  if (std::string why; !supports_dropout(p, &why)) fail("{}", why);
  p.dtype == DType::bf16 ? dropout_as<Bf16>(p) : dropout_as<F32>(p);
}

}  // namespace forge::cpu
