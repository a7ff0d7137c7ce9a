// Rotary position embedding in place, Hugging Face Llama convention: dims i and i + d/2 form a pair,
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); interleaved (DeepSeek-V3), dims 2i and 2i + 1 do. The
// inverse (backward) rotates by -angle.
#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"

namespace forge::cpu {
namespace {

template <typename T>
void rotate(const ops::RopeParams& p, T* x) {
  const int64_t half = p.head_dim / 2;
  // The inverse rotation is the same with sin negated.
  const float sign = p.inverse ? -1.0f : 1.0f;
  const int64_t tokens = p.batch * p.seq;
  // A decoding step's few tokens are not worth a parallel region.
#pragma omp parallel for schedule(static) if (tokens * p.heads * p.head_dim > (1 << 14))
  for (int64_t token = 0; token < tokens; ++token) {
    const int64_t t = token % p.seq;
    const float* cos = p.cos + (p.position_offset + t) * half;
    const float* sin = p.sin + (p.position_offset + t) * half;
    auto* base = x + token * p.token_stride;
    for (int64_t h = 0; h < p.heads; ++h) {
      auto* x1 = base + h * p.head_dim;
      if (p.interleaved) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = load_float(x1, 2 * i), b = load_float(x1, 2 * i + 1), c = cos[i], s = sign * sin[i];
          store_float(x1, 2 * i, a * c - b * s);
          store_float(x1, 2 * i + 1, b * c + a * s);
        }
        continue;
      }
      auto* x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = load_float(x1, i), b = load_float(x2, i), c = cos[i], s = sign * sin[i];
        store_float(x1, i, a * c - b * s);
        store_float(x2, i, b * c + a * s);
      }
    }
  }
}

}  // namespace

bool supports_rope(const ops::RopeParams& p, std::string* reason) {
  if (p.head_dim <= 0 || p.head_dim % 2 != 0)
    return ops::refuse(reason, "rope: head_dim must be even and positive, got {}", p.head_dim);
  if (p.token_stride < p.heads * p.head_dim)
    return ops::refuse(reason, "rope: token_stride {} < heads * head_dim = {}", p.token_stride,
                       p.heads * p.head_dim);
  if (p.position_offset < 0)
    return ops::refuse(reason, "rope: negative position_offset {}", p.position_offset);
  return true;
}

void rope(const ops::RopeParams& p) {
  if (std::string why; !supports_rope(p, &why)) fail("{}", why);
  visit(p.x, [&](auto* x) { rotate(p, x); });
}

}  // namespace forge::cpu
