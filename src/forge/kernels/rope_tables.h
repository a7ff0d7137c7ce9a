// cos/sin tables for rotary position embedding, computed as Hugging Face transformers computes them
// (default, "linear", "llama3" and "yarn" rope_scaling), in double and stored as float.
#pragma once

#include <cstdint>

namespace forge {

// Also the rope_scaling of the model configs (models/ include this header; kernels sit below models).
struct RopeScaling {
  enum class Kind { none, linear, llama3, yarn };
  Kind kind = Kind::none;
  // linear (Gemma 3's global layers): every frequency divided by factor (positions interpolated).
  // llama3: frequencies with wavelength beyond original/low_freq_factor are divided by factor, those
  // below original/high_freq_factor are kept, and the band in between is interpolated smoothly.
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
  // yarn (DeepSeek-V3): dimension pairs that turn more than beta_fast times over the original context keep
  // their frequency, those turning fewer than beta_slow times are divided by factor, with a linear ramp
  // between; cos and sin are multiplied by attention_factor() (mscale / mscale_all_dim: 0 = unset).
  double beta_fast = 32, beta_slow = 1, mscale = 0, mscale_all_dim = 0;

  // YaRN's magnitude correction 0.1 * m * ln(scale) + 1 (1 for scale <= 1).
  static double yarn_mscale(double scale, double m = 1);
  // What yarn multiplies cos and sin by: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  // when both are set, else yarn_mscale(factor); 1 for the other kinds.
  double attention_factor() const;

  bool operator==(const RopeScaling&) const = default;
};

// Fills cos and sin, each [positions, head_dim / 2]: entry (t, i) is cos/sin(t * inv_freq[i]) with
// inv_freq[i] = theta^(-2i / head_dim), rescaled per `scaling`. Throws forge::Error on a bad argument.
void rope_tables(int64_t positions, int64_t head_dim, double theta, const RopeScaling& scaling, float* cos,
                 float* sin);

}  // namespace forge
