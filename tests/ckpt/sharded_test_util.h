// Shared by the sharded-checkpoint tests: a toy model state laid out as a (tp, dp[, ZeRO]) run would hold
// it, so that a save under one layout and a load under another can be checked element by element.
//
// Each tensor has deterministic global values. Under tp ranks a split tensor's dimension is cut into
// ceil(extent / tp) slices, the last padded past the global extent (a padded vocabulary); a replicated
// tensor is saved by tp rank 0 only (the primary copy) and loaded by every tp rank. Without ZeRO the
// data-parallel rank 0 saves the whole local tensor and every dp rank loads it; with ZeRO each dp rank
// saves and loads an uneven flat range of it that ignores row boundaries.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "forge/ckpt/sharded.h"

namespace forge::sharded_testing {
using namespace forge::ckpt;

struct SimLayout {
  int tp = 1, dp = 1;
  bool zero = false;
  int world() const { return tp * dp; }
  std::string label() const { return fmt::format("tp{}_dp{}{}", tp, dp, zero ? "_zero" : ""); }
  nlohmann::json json() const { return {{"tp", tp}, {"dp", dp}, {"zero", zero}}; }
};

struct SimTensor {
  std::string name;
  Shape shape;
  int split_dim = -1;  // -1: replicated over tp
};

// Embedding rows split with a padded vocabulary (10 rows), a row-split and a column-split linear, a
// replicated norm, and a 3-D tensor split in the middle.
inline std::vector<SimTensor> toy_tensors() {
  return {{"model.embed_tokens.weight", {10, 6}, 0},
          {"mlp.up_proj.weight", {8, 6}, 0},
          {"mlp.down_proj.weight", {6, 8}, 1},
          {"model.norm.weight", {6}, -1},
          {"experts.weight", {3, 5, 4}, 1}};
}

constexpr float kPadding = -7777.0f;  // what a saving rank holds in padding rows
constexpr float kUnset = -9999.0f;    // what a loading rank's buffers hold before loading

// Varied, exactly representable values: sign, exponent and mantissa all change with (tensor, index).
inline float global_value(const std::string& name, int64_t index) {
  uint64_t h = std::hash<std::string>{}(name) ^ (static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ull);
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  const float magnitude =
      std::ldexp(static_cast<float>((h & 0xffffff) + 1), static_cast<int>((h >> 24) % 40) - 40);
  return (h >> 63) ? -magnitude : magnitude;
}

// One rank's copy of one tensor: the local tensor, the flat range it saves or loads, and its piece.
struct LocalTensor {
  SimTensor tensor;
  Shape local_shape;
  int64_t split_start = 0;
  int64_t flat_begin = 0, flat_end = 0;
  std::vector<float> values;  // the whole local tensor
  ShardPiece piece() {
    return {tensor.name, tensor.shape, local_shape, tensor.split_dim,
            split_start, flat_begin,   flat_end,    values.data() + flat_begin};
  }
  // The global flat index of local element i, or -1 for padding.
  int64_t global_index(int64_t i) const {
    const Shape& global = tensor.shape;
    std::vector<int64_t> coordinate(local_shape.size());
    for (size_t d = local_shape.size(); d-- > 0;) {
      coordinate[d] = i % local_shape[d];
      i /= local_shape[d];
    }
    int64_t g = 0;
    for (size_t d = 0; d < coordinate.size(); ++d) {
      if (static_cast<int>(d) == tensor.split_dim) coordinate[d] += split_start;
      if (coordinate[d] >= global[d]) return -1;
      g = g * global[d] + coordinate[d];
    }
    return g;
  }
};

// Uneven ZeRO boundaries: k/dp of the elements, nudged by one on odd k so no cut falls on a row edge.
inline int64_t zero_boundary(int64_t numel, int k, int dp) {
  if (k >= dp) return numel;
  return std::min(numel, numel * k / dp + (k % 2));
}

// The tensors rank (tp_rank, dp_rank) saves (for_saving) or loads, with values (global values and padding)
// or kUnset everywhere (a loading rank).
inline std::vector<LocalTensor> rank_tensors(const std::vector<SimTensor>& tensors, const SimLayout& layout,
                                             int tp_rank, int dp_rank, bool for_saving) {
  std::vector<LocalTensor> out;
  for (const SimTensor& t : tensors) {
    LocalTensor local;
    local.tensor = t;
    local.local_shape = t.shape;
    if (t.split_dim >= 0) {
      const int64_t slice = (t.shape[t.split_dim] + layout.tp - 1) / layout.tp;
      local.local_shape[t.split_dim] = slice;
      local.split_start = tp_rank * slice;
    } else if (for_saving && tp_rank != 0) {
      continue;  // replicated: tp rank 0 holds the primary copy
    }
    const int64_t numel = shape_numel(local.local_shape);
    if (layout.zero) {
      local.flat_begin = zero_boundary(numel, dp_rank, layout.dp);
      local.flat_end = zero_boundary(numel, dp_rank + 1, layout.dp);
    } else {
      if (for_saving && dp_rank != 0) continue;
      local.flat_end = numel;
    }
    local.values.assign(numel, kUnset);
    if (for_saving)
      for (int64_t i = 0; i < numel; ++i) {
        const int64_t g = local.global_index(i);
        local.values[i] = g < 0 ? kPadding : global_value(t.name, g);
      }
    out.push_back(std::move(local));
  }
  return out;
}

inline std::vector<ShardPiece> pieces_of(std::vector<LocalTensor>& locals) {
  std::vector<ShardPiece> pieces;
  for (LocalTensor& l : locals) pieces.push_back(l.piece());
  return pieces;
}

// After a load: each element of the loaded range holds its global value bit for bit, padding and elements
// outside the range are untouched.
inline void expect_loaded(const std::vector<LocalTensor>& locals, const std::string& context) {
  for (const LocalTensor& l : locals) {
    for (int64_t i = 0; i < static_cast<int64_t>(l.values.size()); ++i) {
      const int64_t g = l.global_index(i);
      const bool loaded = i >= l.flat_begin && i < l.flat_end && g >= 0;
      const float expected = loaded ? global_value(l.tensor.name, g) : kUnset;
      ASSERT_EQ(std::memcmp(&l.values[i], &expected, sizeof(float)), 0)
          << context << ": " << l.tensor.name << " local element " << i << " holds " << l.values[i]
          << ", expected " << expected;
    }
  }
}

}  // namespace forge::sharded_testing
