// PIL-exact resampling (see image_resize.h). The arithmetic follows Pillow's libImaging/Resample.c and
// Geometry.c (the affine nearest-neighbour scaler) step for step, because a single ulp in a weight can move
// a fixed-point coefficient and with it an output byte.
#include "forge/data/image/image_resize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "forge/core/error.h"

namespace forge::data {
namespace {

// PIL keeps 8 bits of result and 2 of headroom in a 32-bit accumulator.
constexpr int kPrecisionBits = 32 - 8 - 2;

// The filters are evaluated through volatile temporaries so that the compiler cannot contract a product and
// a sum into one fused multiply-add: PIL's Debian build rounds each operation separately.
double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  if (x < 1.0) return 1.0 - x;
  return 0.0;
}

double bicubic_filter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) {
    volatile double p = (a + 2.0) * x;
    volatile double q = (p - (a + 3.0)) * x * x;
    return q + 1;
  }
  if (x < 2.0) {
    volatile double p = (x - 5) * x;
    volatile double q = (p + 8) * x;
    return (q - 4) * a;
  }
  return 0.0;
}

// Per output index: the first source index, the number of taps, and ksize fixed-point weights.
struct Weights {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> fixed;
};

Weights precompute_weights(int64_t in_size, int64_t out_size, double (*filter)(double),
                           double filter_support) {
  // PIL passes the source box as floats: (in1 - in0) is a float, exact for sides up to 2^24.
  const double scale = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = filter_support * filterscale;
  Weights w;
  w.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  w.first.resize(static_cast<size_t>(out_size));
  w.count.resize(static_cast<size_t>(out_size));
  w.fixed.assign(static_cast<size_t>(out_size * w.ksize), 0);
  std::vector<double> k(static_cast<size_t>(w.ksize));
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = static_cast<int>(in_size);
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      volatile double at = (x + xmin - center + 0.5) * ss;
      const double weight = filter(at);
      k[static_cast<size_t>(x)] = weight;
      ww += weight;
    }
    for (int x = 0; x < xmax; ++x) {
      double normalised = k[static_cast<size_t>(x)];
      if (ww != 0.0) normalised /= ww;
      // Round half away from zero, as PIL's normalize_coeffs_8bpc does.
      w.fixed[static_cast<size_t>(xx * w.ksize + x)] =
          normalised < 0 ? static_cast<int32_t>(-0.5 + normalised * (1 << kPrecisionBits))
                         : static_cast<int32_t>(0.5 + normalised * (1 << kPrecisionBits));
    }
    w.first[static_cast<size_t>(xx)] = xmin;
    w.count[static_cast<size_t>(xx)] = xmax;
  }
  return w;
}

inline uint8_t clip8(int32_t accumulator) {
  const int32_t v = accumulator >> kPrecisionBits;  // arithmetic shift: floor, as PIL's lookup table index
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Rows [row0, row0 + rows) of `in`, resampled along x to out_width.
RgbImage resample_horizontal(const RgbImage& in, int64_t row0, int64_t rows, int64_t out_width,
                             const Weights& w) {
  RgbImage out;
  out.height = rows;
  out.width = out_width;
  out.pixels.resize(static_cast<size_t>(rows * out_width * 3));
  for (int64_t y = 0; y < rows; ++y) {
    const uint8_t* src = in.pixels.data() + (row0 + y) * in.width * 3;
    uint8_t* dst = out.pixels.data() + y * out_width * 3;
    for (int64_t xx = 0; xx < out_width; ++xx) {
      const int32_t* k = w.fixed.data() + xx * w.ksize;
      const uint8_t* s = src + static_cast<int64_t>(w.first[static_cast<size_t>(xx)]) * 3;
      const int count = w.count[static_cast<size_t>(xx)];
      int32_t s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
      for (int x = 0; x < count; ++x) {
        s0 += s[x * 3 + 0] * k[x];
        s1 += s[x * 3 + 1] * k[x];
        s2 += s[x * 3 + 2] * k[x];
      }
      dst[xx * 3 + 0] = clip8(s0);
      dst[xx * 3 + 1] = clip8(s1);
      dst[xx * 3 + 2] = clip8(s2);
    }
  }
  return out;
}

// `in` resampled along y; the weights' first rows are taken relative to `row0` (the first row `in` holds).
RgbImage resample_vertical(const RgbImage& in, int64_t row0, int64_t out_height, const Weights& w) {
  RgbImage out;
  out.height = out_height;
  out.width = in.width;
  out.pixels.resize(static_cast<size_t>(out_height * in.width * 3));
  const int64_t stride = in.width * 3;
  for (int64_t yy = 0; yy < out_height; ++yy) {
    const int32_t* k = w.fixed.data() + yy * w.ksize;
    const uint8_t* src = in.pixels.data() + (w.first[static_cast<size_t>(yy)] - row0) * stride;
    const int count = w.count[static_cast<size_t>(yy)];
    uint8_t* dst = out.pixels.data() + yy * stride;
    for (int64_t i = 0; i < stride; ++i) {
      int32_t s = 1 << (kPrecisionBits - 1);
      for (int y = 0; y < count; ++y) s += src[y * stride + i] * k[y];
      dst[i] = clip8(s);
    }
  }
  return out;
}

RgbImage resample_separable(const RgbImage& image, int64_t height, int64_t width, double (*filter)(double),
                            double support) {
  const bool horizontal = width != image.width;
  const bool vertical = height != image.height;
  const Weights wx = horizontal ? precompute_weights(image.width, width, filter, support) : Weights{};
  const Weights wy = vertical ? precompute_weights(image.height, height, filter, support) : Weights{};
  if (horizontal && vertical) {
    // Only the source rows the vertical pass reads go through the horizontal one (as in PIL).
    const int64_t first = wy.first.front();
    const int64_t last = wy.first.back() + wy.count.back();
    return resample_vertical(resample_horizontal(image, first, last - first, width, wx), first, height, wy);
  }
  if (horizontal) return resample_horizontal(image, 0, image.height, width, wx);
  if (vertical) return resample_vertical(image, 0, height, wy);
  return image;
}

RgbImage resample_nearest(const RgbImage& image, int64_t height, int64_t width) {
  // PIL's affine scaler: source coordinate (i + 0.5) * in / out, accumulated step by step in double.
  const double ax = static_cast<double>(static_cast<float>(image.width)) / static_cast<double>(width);
  const double ay = static_cast<double>(static_cast<float>(image.height)) / static_cast<double>(height);
  std::vector<int64_t> source_x(static_cast<size_t>(width));
  double xo = ax * 0.5;
  for (int64_t x = 0; x < width; ++x, xo += ax)
    source_x[static_cast<size_t>(x)] = xo < 0.0 ? -1 : static_cast<int64_t>(xo);
  RgbImage out;
  out.height = height;
  out.width = width;
  out.pixels.assign(static_cast<size_t>(height * width * 3), 0);
  double yo = ay * 0.5;
  for (int64_t y = 0; y < height; ++y, yo += ay) {
    const int64_t sy = yo < 0.0 ? -1 : static_cast<int64_t>(yo);
    if (sy < 0 || sy >= image.height) continue;
    for (int64_t x = 0; x < width; ++x) {
      const int64_t sx = source_x[static_cast<size_t>(x)];
      if (sx < 0 || sx >= image.width) continue;
      for (int c = 0; c < 3; ++c)
        out.pixels[static_cast<size_t>((y * width + x) * 3 + c)] = image.at(sy, sx, c);
    }
  }
  return out;
}

}  // namespace

bool resample_supported(Resample filter) {
  return filter == Resample::nearest || filter == Resample::bilinear || filter == Resample::bicubic;
}

const char* resample_name(Resample filter) {
  switch (filter) {
    case Resample::nearest:
      return "nearest";
    case Resample::lanczos:
      return "lanczos";
    case Resample::bilinear:
      return "bilinear";
    case Resample::bicubic:
      return "bicubic";
    case Resample::box:
      return "box";
    case Resample::hamming:
      return "hamming";
  }
  return "unknown";
}

RgbImage resize_like_pil(const RgbImage& image, int64_t height, int64_t width, Resample filter) {
  if (height < 1 || width < 1) fail("image resize: target size {}x{} must be at least 1x1", width, height);
  if (image.height < 1 || image.width < 1) fail("image resize: the source image is empty");
  if (height == image.height && width == image.width) return image;  // PIL returns a copy
  switch (filter) {
    case Resample::nearest:
      return resample_nearest(image, height, width);
    case Resample::bilinear:
      return resample_separable(image, height, width, bilinear_filter, 1.0);
    case Resample::bicubic:
      return resample_separable(image, height, width, bicubic_filter, 2.0);
    default:
      break;
  }
  fail(
      "image resize: resample {} ({}) is not implemented; forge implements 0 (nearest), 2 (bilinear) and 3 "
      "(bicubic)",
      static_cast<int>(filter), resample_name(filter));
}

}  // namespace forge::data
