// Deterministic parameter initialisation. A value depends only on (seed, parameter name, global element
// index): a rank that owns elements [first, first + count) of a global tensor materialises exactly that
// slice of the single-rank tensor, whatever the thread count or parallel layout.
//
// Element g of parameter `name` draws philox4x32_10(counter = {g_lo, g_hi, hash_lo, hash_hi},
// key = {seed_lo, seed_hi}) where hash = name_hash(name); the _lo/_hi halves are the low and high 32 bits.
#pragma once

#include <cstdint>
#include <string_view>

namespace forge {

// FNV-1a, 64-bit: stable across platforms and releases (it defines which numbers a name gets).
uint64_t name_hash(std::string_view name);

// out[i] = mean + std * z, z a standard normal from Box-Muller on outputs 0 and 1 of element
// first_global_index + i (the cosine branch), computed in double and rounded once to fp32.
void init_normal(float* out, int64_t count, int64_t first_global_index, uint64_t seed, std::string_view name,
                 float mean, float std);

// out[i] = lo + (hi - lo) * u, u uniform in [0, 1) with 53 bits from outputs 0 and 1, computed in double and
// rounded to fp32; a result that rounds up to hi is replaced by the largest float below hi, so values lie in
// [lo, hi) (or equal lo when lo == hi).
void init_uniform(float* out, int64_t count, int64_t first_global_index, uint64_t seed, std::string_view name,
                  float lo, float hi);

void init_constant(float* out, int64_t count, float value);

}  // namespace forge
