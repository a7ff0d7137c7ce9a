// Resizing 8-bit RGB images exactly as PIL's `Image.resize(size, resample)` does (Pillow 9.4), byte for
// byte, since Hugging Face's image processors resize through PIL.
//
// Bilinear and bicubic (a = -0.5) are PIL's separable convolution: a horizontal pass, then a vertical one,
// each skipped when that side keeps its length; when shrinking, the filter's support widens by the scale
// factor (antialiasing); each output's weights are normalised to sum to one, then rounded to 22-bit fixed
// point; each pass rounds and clips to 8 bits. Nearest picks source index floor((i + 0.5) * in / out),
// accumulated in double as PIL's affine scaler does. An unchanged size returns a copy.
#pragma once

#include <cstdint>

#include "forge/data/image/image.h"

namespace forge::data {

// PIL's resampling codes (PIL.Image.Resampling), as Hugging Face configs write them.
enum class Resample : int { nearest = 0, lanczos = 1, bilinear = 2, bicubic = 3, box = 4, hamming = 5 };

// True for the filters resize_like_pil implements (nearest, bilinear, bicubic).
bool resample_supported(Resample filter);
const char* resample_name(Resample filter);

// `image` resized to height x width (both >= 1). Throws forge::Error for a filter it does not implement.
RgbImage resize_like_pil(const RgbImage& image, int64_t height, int64_t width, Resample filter);

}  // namespace forge::data
