#include "forge/core/init.h"

#include <cmath>

#include "forge/core/error.h"
#include "forge/core/philox.h"

namespace forge {

namespace {

// Below this many elements the OpenMP team costs more than it saves.
constexpr int64_t kParallelThreshold = 4096;

void check_range(const char* what, const float* out, int64_t count, int64_t first_global_index,
                 std::string_view name) {
  if (count < 0) fail("{}: negative element count {} for parameter '{}'", what, count, name);
  if (first_global_index < 0)
    fail("{}: negative first global index {} for parameter '{}'", what, first_global_index, name);
  if (count > 0 && out == nullptr) fail("{}: null output for parameter '{}'", what, name);
}

inline std::array<uint32_t, 4> element_bits(int64_t global_index, uint64_t hash, uint64_t seed) {
  const uint64_t g = static_cast<uint64_t>(global_index);
  return philox4x32_10({static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), static_cast<uint32_t>(hash),
                        static_cast<uint32_t>(hash >> 32)},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

}  // namespace

uint64_t name_hash(std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (unsigned char c : name) {
    hash ^= c;
    hash *= 0x100000001b3ull;  // FNV-1a 64 prime
  }
  return hash;
}

void init_normal(float* out, int64_t count, int64_t first_global_index, uint64_t seed, std::string_view name,
                 float mean, float std) {
  check_range("init_normal", out, count, first_global_index, name);
  if (!std::isfinite(mean) || !std::isfinite(std) || std < 0)
    fail("init_normal: parameter '{}' needs a finite mean and std >= 0, got mean {} std {}", name, mean, std);
  const uint64_t hash = name_hash(name);
  // log/cos must stay the scalar libm calls: a vector math library (-ffast-math) rounds differently in a
  // loop's body and its tail, which would make a value depend on where a shard starts.
#pragma omp parallel for schedule(static) if (count >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) {
    const std::array<uint32_t, 4> bits = element_bits(first_global_index + i, hash, seed);
    const double z = standard_normal_pair_double(bits[0], bits[1])[0];
    out[i] = static_cast<float>(static_cast<double>(mean) + static_cast<double>(std) * z);
  }
}

void init_uniform(float* out, int64_t count, int64_t first_global_index, uint64_t seed, std::string_view name,
                  float lo, float hi) {
  check_range("init_uniform", out, count, first_global_index, name);
  if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi)
    fail("init_uniform: parameter '{}' needs finite lo <= hi, got [{}, {})", name, lo, hi);
  const uint64_t hash = name_hash(name);
  const double width = static_cast<double>(hi) - static_cast<double>(lo);
  const float below_hi = lo < hi ? std::nextafter(hi, lo) : lo;
#pragma omp parallel for schedule(static) if (count >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) {
    const std::array<uint32_t, 4> bits = element_bits(first_global_index + i, hash, seed);
    const uint64_t mantissa = (uint64_t{bits[0]} << 21) | (bits[1] >> 11);  // 53 bits
    const double u = static_cast<double>(mantissa) * 0x1p-53;
    const float value = static_cast<float>(static_cast<double>(lo) + width * u);
    out[i] = value < hi ? value : below_hi;
  }
}

void init_constant(float* out, int64_t count, float value) {
  if (count < 0) fail("init_constant: negative element count {}", count);
  if (count > 0 && out == nullptr) fail("init_constant: null output");
#pragma omp parallel for schedule(static) if (count >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) out[i] = value;
}

}  // namespace forge
