#include "forge/core/philox.h"

#include <cmath>
#include <numbers>

#include "forge/core/philox_rounds.h"

namespace forge {

std::array<uint32_t, 4> philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  const philox::Words out =
      philox::rounds10({{counter[0], counter[1], counter[2], counter[3]}}, key[0], key[1]);
  return {out.v[0], out.v[1], out.v[2], out.v[3]};
}

float uniform_open_closed(uint32_t bits) { return philox::uniform_open_closed(bits); }

float uniform_closed_open(uint32_t bits) { return philox::uniform_closed_open(bits); }

std::array<double, 2> standard_normal_pair_double(uint32_t a, uint32_t b) {
  const double u1 = (static_cast<double>(a) + 1.0) * 0x1p-32;  // (0, 1]: log stays finite
  const double u2 = static_cast<double>(b) * 0x1p-32;
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  return {radius * std::cos(angle), radius * std::sin(angle)};
}

std::array<float, 2> standard_normal_pair(uint32_t a, uint32_t b) {
  const std::array<double, 2> z = standard_normal_pair_double(a, b);
  return {static_cast<float>(z[0]), static_cast<float>(z[1])};
}

}  // namespace forge
