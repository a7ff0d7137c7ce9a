#include "forge/ckpt/finite_check.h"

#include <cstring>

#include "forge/core/error.h"

namespace forge::ckpt {
namespace {

// By the bits rather than std::isfinite, so that no floating-point mode can optimise the test away: all
// exponent bits set is exactly NaN (mantissa non-zero) or infinity (mantissa zero).
uint32_t bits_of(const float* value) {
  uint32_t bits;
  std::memcpy(&bits, value, 4);
  return bits;
}
bool non_finite(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

}  // namespace

void check_finite(const float* data, int64_t n, std::string_view tensor, std::string_view file) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += non_finite(bits_of(data + i));  // branch-free: one fast pass
  if (bad == 0) return;
  int64_t first = 0;
  while (!non_finite(bits_of(data + first))) ++first;
  const uint32_t bits = bits_of(data + first);
  const char* value = (bits & 0x007fffffu) != 0 ? "nan" : (bits >> 31 ? "-inf" : "inf");
  fail(
      "{}: tensor '{}' holds {} non-finite value{} (NaN or infinity) of {}, the first at index {} ({}); "
      "refusing to load it",
      file, tensor, bad, bad == 1 ? "" : "s", n, first, value);
}

}  // namespace forge::ckpt
