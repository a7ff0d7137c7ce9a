#include "forge/core/philox.h"

#include <cmath>
#include <numbers>

namespace forge {

namespace {

// Constants from the Philox paper: round multipliers and the Weyl sequence that bumps the key.
constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

inline PhiloxCounter philox_round(const PhiloxCounter& c, const PhiloxKey& k) {
  const uint64_t product0 = uint64_t{kMultiplier0} * c[0];
  const uint64_t product1 = uint64_t{kMultiplier1} * c[2];
  const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32), lo0 = static_cast<uint32_t>(product0);
  const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32), lo1 = static_cast<uint32_t>(product1);
  return {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
}

}  // namespace

std::array<uint32_t, 4> philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    counter = philox_round(counter, key);
  }
  return counter;
}

float uniform_open_closed(uint32_t bits) { return static_cast<float>((bits >> 8) + 1) * 0x1p-24f; }

float uniform_closed_open(uint32_t bits) { return static_cast<float>(bits >> 8) * 0x1p-24f; }

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
