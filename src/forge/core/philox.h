// Philox4x32-10, the counter-based random number generator of Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3" (SC 2011), as in Random123. Counter-based means any element's random bits are a pure
// function of (counter, key), so results never depend on thread count, sharding or call order.
#pragma once

#include <array>
#include <cstdint>

namespace forge {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// Ten rounds of Philox4x32 on `counter` under `key`.
std::array<uint32_t, 4> philox4x32_10(PhiloxCounter counter, PhiloxKey key);

// 32 random bits -> uniform float. Both use the top 24 bits so every result is exact in fp32.
float uniform_open_closed(uint32_t bits);  // (0, 1]
float uniform_closed_open(uint32_t bits);  // [0, 1)

// Two independent standard normals from 32-bit words a and b by Box-Muller, computed in double:
// u1 = (a + 1) / 2^32 in (0, 1], u2 = b / 2^32 in [0, 1), r = sqrt(-2 ln u1),
// returns {r cos(2 pi u2), r sin(2 pi u2)}.
std::array<double, 2> standard_normal_pair_double(uint32_t a, uint32_t b);
std::array<float, 2> standard_normal_pair(uint32_t a, uint32_t b);

}  // namespace forge
