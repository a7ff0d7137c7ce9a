// Dropout's mask as a pure function of where an element sits in the data, written once for both backends
// (CPU kernels include it as it is, CUDA kernels compile the same functions for the device): the mask bit of
// column c of the token at `position` of training sample `sample` at dropout site `stream` comes from
// Philox4x32-10 under the run's seed, counter (c / 4, position, sample's low 32 bits, stream), word c % 4.
// Nothing about the layout enters (ranks, sequence shards, micro-batch sizes, recompute), so every parallel
// layout and every backend drops the same elements.
#pragma once

#include <cstdint>

#include "forge/core/philox_rounds.h"

namespace forge::ops {

// The mask words of columns [4 quad, 4 quad + 4).
FORGE_HOST_DEVICE inline philox::Words dropout_words(uint64_t seed, uint32_t stream, int64_t sample,
                                                     int64_t position, int64_t quad) {
  const auto s = static_cast<uint64_t>(sample);
  return philox::rounds10(
      {{static_cast<uint32_t>(quad), static_cast<uint32_t>(position), static_cast<uint32_t>(s), stream}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(s >> 32));
}

// An element is kept when its word's uniform in [0, 1) is at least the rate: probability 1 - rate to within
// 2^-24.
FORGE_HOST_DEVICE inline bool dropout_keeps(uint32_t word, float rate) {
  return philox::uniform_closed_open(word) >= rate;
}

}  // namespace forge::ops
