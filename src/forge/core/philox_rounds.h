// Philox4x32-10's rounds and its uniform floats written once for both backends: host code includes this
// through core/philox.h, CUDA kernels include it directly (the functions are __host__ __device__ there), so a
// random stream drawn on a GPU is the CPU's bit for bit. Plain arrays rather than std::array: device code
// cannot call std::array's members without relaxed constexpr.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FORGE_HOST_DEVICE __host__ __device__
#else
#define FORGE_HOST_DEVICE
#endif

namespace forge::philox {

struct Words {
  uint32_t v[4];
};

// Ten rounds of Philox4x32 on counter `c` under the key (k0, k1); the constants are the paper's round
// multipliers and the Weyl sequence (golden ratio, sqrt(3) - 1) that bumps the key between rounds.
FORGE_HOST_DEVICE inline Words rounds10(Words c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t product0 = uint64_t{0xD2511F53u} * c.v[0];
    const uint64_t product1 = uint64_t{0xCD9E8D57u} * c.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32), lo0 = static_cast<uint32_t>(product0);
    const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32), lo1 = static_cast<uint32_t>(product1);
    c = Words{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}

// 32 random bits -> uniform float from the top 24 bits, so every result is exact in fp32.
FORGE_HOST_DEVICE inline float uniform_open_closed(uint32_t bits) {
  return static_cast<float>((bits >> 8) + 1) * 0x1p-24f;  // (0, 1]
}
FORGE_HOST_DEVICE inline float uniform_closed_open(uint32_t bits) {
  return static_cast<float>(bits >> 8) * 0x1p-24f;  // [0, 1)
}

}  // namespace forge::philox
