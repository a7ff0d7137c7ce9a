// Helpers every test layer needs: the path of a committed fixture, a whole file as bytes, and the largest
// difference between two fp32 tensors relative to the largest magnitude of the expected one.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "forge/core/tensor.h"

namespace forge::testing {

// tests/fixtures/<name> (FORGE_FIXTURE_DIR is set by tests/CMakeLists.txt for every test binary).
inline std::string fixture(const std::string& name) { return std::string(FORGE_FIXTURE_DIR) + "/" + name; }

// The file's bytes; a missing file fails the test (two missing files must not compare equal).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// max |got - want| / max |want| over fp32 host tensors of the same size.
inline double rel_error(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.numel(), want.numel());
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < std::min(got.numel(), want.numel()); ++i) {
    max_diff = std::max(max_diff, std::abs(double(got.f32()[i]) - want.f32()[i]));
    max_ref = std::max(max_ref, std::abs(double(want.f32()[i])));
  }
  return max_diff / (max_ref + 1e-30);
}

}  // namespace forge::testing
