#include "forge/kernels/rope_tables.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "forge/core/error.h"

namespace forge {

double RopeScaling::yarn_mscale(double scale, double m) {
  return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

double RopeScaling::attention_factor() const {
  if (kind != Kind::yarn) return 1.0;
  if (mscale != 0 && mscale_all_dim != 0)
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
  return yarn_mscale(factor);
}

namespace {

// The dimension index at which a pair turns `rotations` times over `positions` positions.
double yarn_correction_dim(double rotations, int64_t head_dim, double theta, double positions) {
  return static_cast<double>(head_dim) * std::log(positions / (rotations * 2 * std::numbers::pi)) /
         (2 * std::log(theta));
}

void apply_yarn(const RopeScaling& s, int64_t head_dim, double theta, std::vector<double>& inv_freq) {
  const double original = static_cast<double>(s.original_max_position_embeddings);
  if (!(s.factor >= 1) || !(original > 0) || !(s.beta_fast > s.beta_slow) || !(s.beta_slow > 0))
    fail(
        "rope_tables: bad yarn rope_scaling (factor {}, beta_fast {}, beta_slow {}, "
        "original_max_position_embeddings {})",
        s.factor, s.beta_fast, s.beta_slow, s.original_max_position_embeddings);
  const int64_t half = head_dim / 2;
  double low = std::floor(yarn_correction_dim(s.beta_fast, head_dim, theta, original));
  double high = std::ceil(yarn_correction_dim(s.beta_slow, head_dim, theta, original));
  low = std::max(low, 0.0), high = std::min(high, static_cast<double>(head_dim - 1));
  if (low == high) high += 0.001;  // a ramp of zero width would divide by zero
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    // ramp 0: extrapolate (keep the frequency); ramp 1: interpolate (divide by factor).
    inv_freq[i] = inv_freq[i] / s.factor * ramp + inv_freq[i] * (1 - ramp);
  }
}

}  // namespace

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

  if (scaling.kind == RopeScaling::Kind::linear) {
    if (!(scaling.factor > 0)) fail("rope_tables: bad linear rope_scaling factor {}", scaling.factor);
    for (double& f : inv_freq) f /= scaling.factor;
  }
  if (scaling.kind == RopeScaling::Kind::yarn) apply_yarn(scaling, head_dim, theta, inv_freq);
  const double magnitude = scaling.attention_factor();

  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      cos[t * half + i] = static_cast<float>(std::cos(angle) * magnitude);
      sin[t * half + i] = static_cast<float>(std::sin(angle) * magnitude);
    }
}

}  // namespace forge
