// Image decoding for multimodal data: a JPEG or PNG file (told apart by its magic bytes, not its name)
// becomes 8-bit RGB, height x width x 3, exactly as PIL's `Image.open(f).convert("RGB")` computes it
// (Pillow 9.4 on Debian; both use the system libjpeg-turbo for JPEG). libjpeg-turbo and libpng do the
// decoding; their errors become one forge::Error line naming the file and the reason. PNG writing
// (encode_png, write_png) serves forge's own synthetic datasets.
//
// What is refused (one line each): files that are neither JPEG nor PNG, CMYK/YCCK JPEGs, 16-bit grayscale
// PNGs (PIL opens them as 32-bit mode "I" and its RGB conversion clips every value above 255 to white, so
// there is nothing sensible to match), sides over kMaxImageSide or more than kMaxImagePixels pixels, and any
// corrupt or truncated file, including JPEG data libjpeg would otherwise patch up with a warning (premature
// end, corrupt entropy data). EXIF orientation is not applied, as neither PIL's open nor Hugging Face's
// processors apply it. See docs/formats.md ("Images").
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace forge::data {

inline constexpr int64_t kMaxImageSide = 16384;
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

// 8-bit RGB, row-major, channels last: pixel (y, x) channel c is pixels[(y * width + x) * 3 + c].
struct RgbImage {
  int64_t height = 0;
  int64_t width = 0;
  std::vector<uint8_t> pixels;

  uint8_t at(int64_t y, int64_t x, int c) const {
    return pixels[static_cast<size_t>((y * width + x) * 3 + c)];
  }
};

enum class ImageFormat { unknown, jpeg, png };

// The format the first bytes announce (JPEG: FF D8 FF; PNG: the 8-byte PNG signature).
ImageFormat sniff_image_format(std::span<const uint8_t> bytes);

// Decodes an in-memory JPEG or PNG. `name` names the source in error messages (a path, "sample 17", ...).
RgbImage decode_image(std::span<const uint8_t> bytes, std::string_view name);

// Reads and decodes a file; errors name the path.
RgbImage read_image(const std::filesystem::path& path);

// An 8-bit RGB PNG of `image` (non-interlaced, zlib level 6, no time or text chunks), so the same pixels
// always give the same bytes. `name` names the image in error messages.
std::string encode_png(const RgbImage& image, std::string_view name);

// encode_png written atomically (temporary file, fsync, rename); errors name the path.
void write_png(const RgbImage& image, const std::filesystem::path& path);

}  // namespace forge::data
