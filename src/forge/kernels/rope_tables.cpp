#include "forge/kernels/rope_tables.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "forge/core/error.h"

namespace forge {

void rope_tables(int64_t positions, int64_t head_dim, double theta, const RopeScaling& scaling, float* cos,
                 float* sin) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("rope_tables: head_dim must be even and positive, got {}", head_dim);
  if (positions < 0) fail("rope_tables: negative number of positions {}", positions);
  if (!(theta > 0)) fail("rope_tables: rope_theta must be positive, got {}", theta);
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -static_cast<double>(2 * i) / head_dim);

  if (scaling.kind == RopeScaling::Kind::llama3) {
    const double factor = scaling.factor, low = scaling.low_freq_factor, high = scaling.high_freq_factor;
    const double original = static_cast<double>(scaling.original_max_position_embeddings);
    if (!(factor > 0) || !(low > 0) || !(high > low) || !(original > 0))
      fail(
          "rope_tables: bad llama3 rope_scaling (factor {}, low_freq_factor {}, high_freq_factor {}, "
          "original_max_position_embeddings {})",
          factor, low, high, scaling.original_max_position_embeddings);
    const double low_freq_wavelen = original / low, high_freq_wavelen = original / high;
    for (double& f : inv_freq) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (original / wavelen - low) / (high - low);
        f = (1 - smooth) * f / factor + smooth * f;
      }
    }
  }

  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
}

}  // namespace forge
