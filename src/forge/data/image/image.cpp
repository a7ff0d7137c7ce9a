// JPEG (libjpeg-turbo) and PNG (libpng) decoding to RGB, matching PIL's open + convert("RGB").
//
// Both libraries report fatal errors through a callback that must not return; here it longjmps back to the
// setjmp in decode_jpeg_raw / decode_png_raw. Those two functions therefore keep no C++ object with a
// destructor on their own frame: every buffer they fill belongs to the caller, and the error text is copied
// into a plain char array, turned into a forge::Error only after the C library has been cleaned up.
#include "forge/data/image/image.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <string>

// clang-format off
#include <jpeglib.h>  // needs <cstdio> first
#include <jerror.h>
// clang-format on
#include <png.h>

#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::data {
namespace {

constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
// A progressive JPEG can carry any number of scans, each re-decoding the whole image; real encoders write
// about 10. Far more is a denial-of-service pattern (libjpeg-turbo's own fuzzers stop at 500).
constexpr int kMaxJpegScans = 500;
// libjpeg's working memory (the coefficient buffer of a progressive image is the large one).
constexpr long kMaxJpegMemory = 4L << 30;

// Fails with the library's message once its cleanup is done.
struct DecodeError {
  char message[JMSG_LENGTH_MAX + 128] = {};
};

bool dimensions_acceptable(int64_t width, int64_t height, DecodeError* error) {
  if (width < 1 || height < 1) {
    std::snprintf(error->message, sizeof error->message, "image has no pixels (%lldx%lld)",
                  static_cast<long long>(width), static_cast<long long>(height));
    return false;
  }
  if (width > kMaxImageSide || height > kMaxImageSide || width * height > kMaxImagePixels) {
    std::snprintf(error->message, sizeof error->message,
                  "image is %lldx%lld, over the limit of %lld pixels a side and %lld pixels in all",
                  static_cast<long long>(width), static_cast<long long>(height),
                  static_cast<long long>(kMaxImageSide), static_cast<long long>(kMaxImagePixels));
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------- JPEG

struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  DecodeError* error;
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  char text[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, text);
  std::snprintf(manager->error->message, sizeof manager->error->message, "corrupt JPEG: %s", text);
  std::longjmp(manager->jump, 1);
}

// Level -1 is a warning: libjpeg found damaged data and carries on with made-up pixels (a truncated file is
// padded with grey). PIL would raise "image file is truncated" for the truncated case; forge refuses every
// such warning except extraneous bytes before a marker, which libjpeg skips without altering any pixel.
void jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code != JWRN_EXTRANEOUS_DATA) jpeg_fail(cinfo);
}

void jpeg_progress(j_common_ptr cinfo) {
  auto* decompress = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (decompress->input_scan_number > kMaxJpegScans) {
    auto* manager = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    std::snprintf(manager->error->message, sizeof manager->error->message, "corrupt JPEG: more than %d scans",
                  kMaxJpegScans);
    std::longjmp(manager->jump, 1);
  }
}

// Decodes into `out` (sized here). Returns false with `error` filled on any failure.
bool decode_jpeg_raw(const uint8_t* data, size_t size, RgbImage* out, DecodeError* error) {
  jpeg_decompress_struct cinfo;
  JpegErrorManager manager;
  jpeg_progress_mgr progress;
  cinfo.err = jpeg_std_error(&manager.pub);
  manager.pub.error_exit = jpeg_fail;
  manager.pub.emit_message = jpeg_message;
  manager.error = error;
  if (setjmp(manager.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  progress.progress_monitor = jpeg_progress;
  cinfo.progress = &progress;
  cinfo.mem->max_memory_to_use = kMaxJpegMemory;
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);

  bool ok = dimensions_acceptable(cinfo.image_width, cinfo.image_height, error);
  if (ok && cinfo.num_components != 1 && cinfo.num_components != 3) {
    // PIL reads 4-component JPEGs as CMYK (Adobe-inverted) and converts them with its own formula; forge
    // does not implement that conversion.
    const char* space = cinfo.jpeg_color_space == JCS_CMYK   ? "CMYK"
                        : cinfo.jpeg_color_space == JCS_YCCK ? "YCCK"
                                                             : "an unsupported colour space";
    std::snprintf(
        error->message, sizeof error->message,
        "JPEG with %d components (%s) is not supported; forge decodes grayscale and RGB/YCbCr JPEGs",
        cinfo.num_components, space);
    ok = false;
  }
  if (!ok) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  // PIL's defaults: libjpeg's colour-space guess from the markers, fancy upsampling, the accurate integer
  // IDCT (JDCT_ISLOW). Grayscale to RGB replicates the channel, as PIL's L -> RGB conversion does.
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  if (cinfo.output_components != 3) {
    std::snprintf(error->message, sizeof error->message, "corrupt JPEG: decoder gave %d components",
                  cinfo.output_components);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  out->width = cinfo.output_width;
  out->height = cinfo.output_height;
  try {
    out->pixels.resize(static_cast<size_t>(out->width * out->height * 3));
  } catch (...) {
    jpeg_destroy_decompress(&cinfo);
    throw;
  }
  const size_t stride = static_cast<size_t>(out->width) * 3;
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out->pixels.data() + stride * cinfo.output_scanline;
    if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
      std::snprintf(error->message, sizeof error->message, "corrupt JPEG: decoding stopped at row %u",
                    cinfo.output_scanline);
      jpeg_destroy_decompress(&cinfo);
      return false;
    }
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

// ----------------------------------------------------------------------------------------------------- PNG

struct PngReader {
  const uint8_t* data;
  size_t size;
  size_t position;
  std::jmp_buf jump;
  DecodeError* error;
};

[[noreturn]] void png_fail(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->error->message, sizeof reader->error->message, "corrupt PNG: %s", message);
  std::longjmp(reader->jump, 1);
}

// Warnings are about ancillary data forge does not use (a bad iCCP profile, an unknown chunk).
void png_warn(png_structp, png_const_charp) {}

void png_read_bytes(png_structp png, png_bytep into, size_t count) {
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  if (count > reader->size - reader->position) png_error(png, "file is truncated");
  std::memcpy(into, reader->data + reader->position, count);
  reader->position += count;
}

// What libpng hands back before forge's own conversion to RGB.
struct PngRaw {
  int64_t width = 0, height = 0;
  int channels = 0;  // 1 (gray or palette index), 2 (gray + alpha), 3 (RGB), 4 (RGBA)
  bool palette = false;
  int palette_size = 0;
  uint8_t palette_rgb[256 * 3] = {};
  std::vector<uint8_t> samples;  // height rows of width * channels bytes
  std::vector<png_bytep> rows;
};

bool decode_png_raw(const uint8_t* data, size_t size, PngRaw* out, DecodeError* error) {
  PngReader reader{data, size, 0, {}, error};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, png_fail, png_warn);
  if (png == nullptr) {
    std::snprintf(error->message, sizeof error->message, "cannot create a PNG reader");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    std::snprintf(error->message, sizeof error->message, "cannot create a PNG reader");
    return false;
  }
  if (setjmp(reader.jump)) {
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  png_set_read_fn(png, &reader, png_read_bytes);
  // forge checks the size itself, with its own message; libpng's default limit (1e6 a side) stays as a
  // guard only above the PNG format's own maximum.
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
  // PIL maps an out-of-range palette index to grey (index, index, index); forge does the lookup itself.
  png_set_check_for_invalid_index(png, -1);
  png_read_info(png, info);

  const int64_t width = png_get_image_width(png, info);
  const int64_t height = png_get_image_height(png, info);
  const int bit_depth = png_get_bit_depth(png, info);
  const int color_type = png_get_color_type(png, info);
  bool ok = dimensions_acceptable(width, height, error);
  if (ok && bit_depth == 16 && color_type == PNG_COLOR_TYPE_GRAY) {
    std::snprintf(error->message, sizeof error->message,
                  "16-bit grayscale PNG is not supported (PIL's RGB conversion clips it to 8 bits)");
    ok = false;
  }
  if (!ok) {
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  // PIL keeps the high byte of 16-bit samples (its ";16B" unpackers), scales 1/2/4-bit gray to 0..255,
  // ignores tRNS for RGB/gray images and gAMA/cHRM/iCCP altogether: so does this reader.
  if (bit_depth == 16) png_set_strip_16(png);
  if (color_type == PNG_COLOR_TYPE_PALETTE) {
    png_set_packing(png);  // 1/2/4-bit indices to one byte each
    png_colorp palette = nullptr;
    int count = 0;
    if (png_get_PLTE(png, info, &palette, &count) == 0) png_error(png, "palette image without PLTE");
    out->palette = true;
    out->palette_size = count;
    for (int i = 0; i < count; ++i) {
      out->palette_rgb[i * 3 + 0] = palette[i].red;
      out->palette_rgb[i * 3 + 1] = palette[i].green;
      out->palette_rgb[i * 3 + 2] = palette[i].blue;
    }
  } else if (color_type == PNG_COLOR_TYPE_GRAY && bit_depth < 8) {
    png_set_expand_gray_1_2_4_to_8(png);
  }
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out->width = width;
  out->height = height;
  out->channels = png_get_channels(png, info);
  const size_t row_bytes = png_get_rowbytes(png, info);
  if (out->channels < 1 || out->channels > 4 || row_bytes != static_cast<size_t>(width) * out->channels ||
      (out->palette && out->channels != 1)) {
    png_error(png, "unexpected sample layout");
  }
  try {
    out->samples.resize(row_bytes * static_cast<size_t>(height));
    out->rows.resize(static_cast<size_t>(height));
  } catch (...) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw;
  }
  for (int64_t y = 0; y < height; ++y)
    out->rows[static_cast<size_t>(y)] = out->samples.data() + row_bytes * y;
  png_read_image(png, out->rows.data());
  png_read_end(png, nullptr);  // checks the remaining chunks' CRCs and that IEND is there
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

RgbImage png_to_rgb(const PngRaw& raw) {
  RgbImage image;
  image.width = raw.width;
  image.height = raw.height;
  const size_t count = static_cast<size_t>(raw.width * raw.height);
  image.pixels.resize(count * 3);
  uint8_t* out = image.pixels.data();
  const uint8_t* in = raw.samples.data();
  for (size_t i = 0; i < count; ++i, out += 3) {
    const uint8_t* px = in + i * static_cast<size_t>(raw.channels);
    if (raw.palette) {
      const int index = px[0];
      if (index < raw.palette_size) {
        std::memcpy(out, raw.palette_rgb + index * 3, 3);
      } else {
        out[0] = out[1] = out[2] = static_cast<uint8_t>(index);
      }
    } else if (raw.channels <= 2) {  // gray, gray + alpha: alpha dropped as PIL's LA -> RGB does
      out[0] = out[1] = out[2] = px[0];
    } else {  // RGB, RGBA: alpha dropped (no compositing), as PIL's RGBA -> RGB does
      out[0] = px[0], out[1] = px[1], out[2] = px[2];
    }
  }
  return image;
}

// ------------------------------------------------------------------------------------------- PNG writing

struct PngWriter {
  std::string* out;
  std::jmp_buf jump;
  DecodeError* error;
};

[[noreturn]] void png_write_fail(png_structp png, png_const_charp message) {
  auto* writer = static_cast<PngWriter*>(png_get_error_ptr(png));
  std::snprintf(writer->error->message, sizeof writer->error->message, "cannot encode PNG: %s", message);
  std::longjmp(writer->jump, 1);
}

void png_write_bytes(png_structp png, png_bytep data, size_t count) {
  auto* writer = static_cast<PngWriter*>(png_get_io_ptr(png));
  bool appended = true;
  try {  // no exception may cross libpng's C frames
    writer->out->append(reinterpret_cast<const char*>(data), count);
  } catch (...) {
    appended = false;
  }
  if (!appended) png_error(png, "out of memory");
}

void png_flush_nothing(png_structp) {}

// Appends the PNG to `out`; `rows` holds one pointer per row of `image`. The caller owns every buffer
// (nothing with a destructor lives on this frame, see the top of the file).
bool encode_png_raw(const RgbImage& image, png_bytep* rows, std::string* out, DecodeError* error) {
  PngWriter writer{out, {}, error};
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &writer, png_write_fail, png_warn);
  if (png == nullptr) {
    std::snprintf(error->message, sizeof error->message, "cannot create a PNG writer");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_write_struct(&png, nullptr);
    std::snprintf(error->message, sizeof error->message, "cannot create a PNG writer");
    return false;
  }
  if (setjmp(writer.jump)) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_set_write_fn(png, &writer, png_write_bytes, png_flush_nothing);
  png_set_compression_level(png, 6);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width), static_cast<png_uint_32>(image.height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

}  // namespace

ImageFormat sniff_image_format(std::span<const uint8_t> bytes) {
  if (bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) return ImageFormat::jpeg;
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPngSignature, 8) == 0) return ImageFormat::png;
  return ImageFormat::unknown;
}

RgbImage decode_image(std::span<const uint8_t> bytes, std::string_view name) {
  DecodeError error;
  switch (sniff_image_format(bytes)) {
    case ImageFormat::jpeg: {
      RgbImage image;
      if (!decode_jpeg_raw(bytes.data(), bytes.size(), &image, &error)) fail("{}: {}", name, error.message);
      return image;
    }
    case ImageFormat::png: {
      PngRaw raw;
      if (!decode_png_raw(bytes.data(), bytes.size(), &raw, &error)) fail("{}: {}", name, error.message);
      return png_to_rgb(raw);
    }
    case ImageFormat::unknown:
      break;
  }
  if (bytes.empty()) fail("{}: image file is empty", name);
  fail("{}: not a JPEG or PNG file (the first bytes are neither FF D8 FF nor the PNG signature)", name);
}

RgbImage read_image(const std::filesystem::path& path) {
  const std::string bytes = read_file(path, "image file");
  return decode_image(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), path.string());
}

std::string encode_png(const RgbImage& image, std::string_view name) {
  if (image.height < 1 || image.width < 1 || image.height > kMaxImageSide || image.width > kMaxImageSide)
    fail("{}: cannot encode a {}x{} image as PNG", name, image.width, image.height);
  if (image.pixels.size() != static_cast<size_t>(image.height * image.width * 3))
    fail("{}: image holds {} bytes, not {}x{}x3", name, image.pixels.size(), image.width, image.height);
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  auto* base = const_cast<uint8_t*>(image.pixels.data());  // libpng's API is not const; it only reads
  for (int64_t y = 0; y < image.height; ++y) rows[static_cast<size_t>(y)] = base + y * image.width * 3;
  std::string out;
  out.reserve(static_cast<size_t>(image.height * image.width) + 1024);
  DecodeError error;
  if (!encode_png_raw(image, rows.data(), &out, &error)) fail("{}: {}", name, error.message);
  return out;
}

void write_png(const RgbImage& image, const std::filesystem::path& path) {
  write_file_atomically(path, encode_png(image, path.string()), "PNG image");
}

}  // namespace forge::data
