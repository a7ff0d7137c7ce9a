// The image fixtures written by tests/reference/image_twin.py: tests/fixtures/images/expected.json and the
// prediction-coded ("dz") pixel arrays it names.
#pragma once

#include <zlib.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::data::image_test {

inline std::filesystem::path fixture_dir() { return std::filesystem::path(FORGE_FIXTURE_DIR) / "images"; }

inline const nlohmann::json& manifest() {
  static const nlohmann::json m =
      nlohmann::json::parse(read_file(fixture_dir() / "expected.json", "manifest"));
  return m;
}

// Inverse of image_twin.py's dz(): zlib, then each byte plus the LOCO-I (median edge) prediction from its
// left, upper and upper-left neighbours in the same channel (0 outside the image), mod 256.
inline std::vector<uint8_t> read_dz(const std::string& relative, int64_t height, int64_t width,
                                    int channels = 3) {
  const std::string packed = read_file(fixture_dir() / relative, "fixture");
  std::vector<uint8_t> residual(static_cast<size_t>(height * width * channels));
  uLongf size = static_cast<uLongf>(residual.size());
  if (uncompress(residual.data(), &size, reinterpret_cast<const Bytef*>(packed.data()), packed.size()) !=
          Z_OK ||
      size != residual.size())
    fail("{}: not a zlib stream of {} bytes", relative, residual.size());
  std::vector<uint8_t> out(residual.size());
  auto at = [&](int64_t y, int64_t x, int c) -> int {
    return (y < 0 || x < 0) ? 0 : out[static_cast<size_t>((y * width + x) * channels + c)];
  };
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      for (int c = 0; c < channels; ++c) {
        const int a = at(y, x - 1, c), b = at(y - 1, x, c), d = at(y - 1, x - 1, c);
        const int hi = std::max(a, b), lo = std::min(a, b);
        const int prediction = d >= hi ? lo : (d <= lo ? hi : a + b - d);
        const size_t i = static_cast<size_t>((y * width + x) * channels + c);
        out[i] = static_cast<uint8_t>((residual[i] + prediction) & 0xFF);
      }
    }
  }
  return out;
}

}  // namespace forge::data::image_test
