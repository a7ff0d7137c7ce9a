// Image decoding (data/image.h) and PIL-exact resizing (data/image_resize.h) against the fixtures of
// tests/reference/image_twin.py, and every error path: missing, empty, truncated, mutated, wrong magic,
// absurd sizes, unsupported kinds. Each failure must be one forge::Error line naming the file.
#include "forge/data/image/image.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <random>

#include "data/image_test_util.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/image/image_resize.h"

namespace forge::data::image_test {
namespace {

using image_test::fixture_dir;
using image_test::manifest;
using image_test::read_dz;

std::vector<uint8_t> file_bytes(const std::filesystem::path& path) {
  const std::string s = read_file(path, "fixture");
  return {s.begin(), s.end()};
}

std::vector<std::string> decodable_fixtures() {
  std::vector<std::string> names;
  for (const auto& image : manifest()["images"]) names.push_back(image["file"].get<std::string>());
  return names;
}

// Decodes, or checks the refusal is one line that names `name`. Returns whether it decoded.
bool decodes_or_refuses_cleanly(const std::vector<uint8_t>& bytes, const std::string& name) {
  try {
    const RgbImage image = decode_image(bytes, name);
    EXPECT_GE(image.height, 1);
    EXPECT_EQ(image.pixels.size(), static_cast<size_t>(image.height * image.width * 3));
    return true;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(name + ": ", 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    return false;
  }
}

std::string refusal(const std::vector<uint8_t>& bytes, const std::string& name) {
  try {
    decode_image(bytes, name);
  } catch (const Error& e) {
    return e.what();
  }
  return "(decoded)";
}

TEST(Image, DecodedRgbEqualsPilForEveryFixture) {
  int checked = 0;
  for (const auto& entry : manifest()["images"]) {
    const std::string name = entry["file"];
    const RgbImage image = read_image(fixture_dir() / name);
    ASSERT_EQ(image.height, entry["height"].get<int64_t>()) << name;
    ASSERT_EQ(image.width, entry["width"].get<int64_t>()) << name;
    const std::vector<uint8_t> expected = read_dz(entry["rgb"], image.height, image.width);
    size_t differing = 0;
    for (size_t i = 0; i < expected.size(); ++i) differing += expected[i] != image.pixels[i];
    EXPECT_EQ(differing, 0u) << name << " (PIL mode " << entry["pil_mode"] << ")";
    ++checked;
  }
  EXPECT_GE(checked, 14);
}

TEST(Image, MemoryAndFileDecodingAgree) {
  for (const std::string& name : decodable_fixtures()) {
    const RgbImage a = read_image(fixture_dir() / name);
    const RgbImage b = decode_image(file_bytes(fixture_dir() / name), "buffer");
    EXPECT_EQ(a.pixels, b.pixels) << name;
  }
}

TEST(Image, FormatComesFromMagicBytesNotExtension) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("forge_image_{}", ::getpid());
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(fixture_dir() / "rgb_444_61x47.jpg", dir / "actually_a_jpeg.png",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(fixture_dir() / "rgb_37x23.png", dir / "actually_a_png.jpg",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_EQ(read_image(dir / "actually_a_jpeg.png").width, 61);
  EXPECT_EQ(read_image(dir / "actually_a_png.jpg").width, 37);
  std::filesystem::remove_all(dir);
}

TEST(Image, ResizeEqualsPilToTheByte) {
  int checked = 0;
  for (const auto& entry : manifest()["resizes"]) {
    const std::string name = entry["image"];
    const auto& source = *std::find_if(manifest()["images"].begin(), manifest()["images"].end(),
                                       [&](const auto& i) { return i["file"] == name; });
    RgbImage image;
    image.height = source["height"];
    image.width = source["width"];
    image.pixels = read_dz(source["rgb"], image.height, image.width);  // PIL's own decode
    const int64_t h = entry["height"], w = entry["width"];
    const auto filter = static_cast<Resample>(entry["resample"].get<int>());
    const RgbImage out = resize_like_pil(image, h, w, filter);
    ASSERT_EQ(out.height, h);
    ASSERT_EQ(out.width, w);
    const std::vector<uint8_t> expected = read_dz(entry["rgb"], h, w);
    size_t differing = 0;
    for (size_t i = 0; i < expected.size(); ++i) differing += expected[i] != out.pixels[i];
    EXPECT_EQ(differing, 0u) << name << " -> " << w << "x" << h << " resample " << resample_name(filter);
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

TEST(Image, UnimplementedResampleIsRefused) {
  RgbImage image{2, 2, std::vector<uint8_t>(12, 7)};
  for (Resample r : {Resample::lanczos, Resample::box, Resample::hamming}) {
    try {
      resize_like_pil(image, 3, 3, r);
      ADD_FAILURE() << resample_name(r);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not implemented"), std::string::npos) << e.what();
    }
  }
}

TEST(Image, UnsupportedKindsAreRefusedWithTheReason) {
  const auto gray16 = fixture_dir() / "refused_gray16_11x9.png";
  const auto cmyk = fixture_dir() / "refused_cmyk_12x10.jpg";
  EXPECT_THROW(
      {
        try {
          read_image(gray16);
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()),
                    gray16.string() +
                        ": 16-bit grayscale PNG is not supported (PIL's RGB conversion "
                        "clips it to 8 bits)");
          throw;
        }
      },
      Error);
  const std::string message = refusal(file_bytes(cmyk), cmyk.string());
  EXPECT_NE(message.find(cmyk.string() + ": JPEG with 4 components (CMYK) is not supported"),
            std::string::npos)
      << message;
}

TEST(Image, MissingEmptyAndForeignFilesAreRefused) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("forge_image_errors_{}", ::getpid());
  std::filesystem::create_directories(dir);
  try {
    read_image(dir / "missing.jpg");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "missing.jpg").string()), std::string::npos) << e.what();
  }
  { std::ofstream(dir / "empty.png"); }
  try {
    read_image(dir / "empty.png");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), (dir / "empty.png").string() + ": image file is empty");
  }
  std::filesystem::remove_all(dir);

  const std::vector<std::pair<std::string, std::string>> foreign = {
      {"GIF89a\x01\x00\x01\x00", "gif"},        {"BM\x36\x00\x00\x00", "bmp"},
      {"RIFF\x00\x00\x00\x00WEBPVP8 ", "webp"}, {"hello, world", "text"},
      {"\xFF\xD8", "two bytes of a JPEG"},      {"\x89PNG\r\n\x1a", "seven bytes of a PNG signature"}};
  for (const auto& [bytes, what] : foreign) {
    const std::string message = refusal({bytes.begin(), bytes.end()}, what);
    EXPECT_EQ(message, what +
                           ": not a JPEG or PNG file (the first bytes are neither FF D8 FF nor the PNG "
                           "signature)");
  }
}

// A PNG whose IHDR claims the given size, followed by a tiny IDAT and IEND (every CRC valid).
std::vector<uint8_t> png_claiming_size(uint32_t width, uint32_t height) {
  std::vector<uint8_t> b = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  auto chunk = [&](const char* type, const std::vector<uint8_t>& data) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(data.size() >> s));
    const size_t start = b.size();
    b.insert(b.end(), type, type + 4);
    b.insert(b.end(), data.begin(), data.end());
    const uint32_t crc =
        static_cast<uint32_t>(crc32(0, b.data() + start, static_cast<uInt>(data.size() + 4)));
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(crc >> s));
  };
  std::vector<uint8_t> ihdr;
  for (uint32_t v : {width, height})
    for (int s = 24; s >= 0; s -= 8) ihdr.push_back(static_cast<uint8_t>(v >> s));
  for (uint8_t v : {8, 2, 0, 0, 0}) ihdr.push_back(v);
  chunk("IHDR", ihdr);
  chunk("IDAT", {0x78, 0x9c, 0x63, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01});  // zlib of one zero byte
  chunk("IEND", {});
  return b;
}

TEST(Image, AbsurdDimensionsInACraftedHeaderAreRefused) {
  for (auto [w, h] :
       {std::pair<uint32_t, uint32_t>{20000, 10}, {10, 16385}, {100000, 100000}, {0x7fffffff, 1}}) {
    const std::string message = refusal(png_claiming_size(w, h), "huge.png");
    EXPECT_NE(message.find(fmt::format("huge.png: image is {}x{}, over the limit", w, h)), std::string::npos)
        << message;
  }
  EXPECT_NE(refusal(png_claiming_size(0, 5), "zero.png").find("zero.png: corrupt PNG"), std::string::npos);

  // A real JPEG whose frame header claims 20000 x 47.
  std::vector<uint8_t> jpeg = file_bytes(fixture_dir() / "rgb_444_61x47.jpg");
  size_t sof = 2;
  while (sof + 9 < jpeg.size() && !(jpeg[sof] == 0xFF && (jpeg[sof + 1] == 0xC0 || jpeg[sof + 1] == 0xC2)))
    ++sof;
  ASSERT_LT(sof + 9, jpeg.size());
  jpeg[sof + 7] = 20000 >> 8, jpeg[sof + 8] = 20000 & 0xFF;
  const std::string message = refusal(jpeg, "wide.jpg");
  EXPECT_NE(message.find("wide.jpg: image is 20000x47, over the limit of 16384 pixels a side"),
            std::string::npos)
      << message;
}

TEST(Image, TruncatedFilesAreRefusedAtEveryCut) {
  for (const std::string& name : decodable_fixtures()) {
    const std::vector<uint8_t> bytes = file_bytes(fixture_dir() / name);
    std::vector<size_t> cuts;
    for (size_t n = 0; n < std::min<size_t>(bytes.size(), 160); ++n) cuts.push_back(n);
    for (size_t n = 160; n < bytes.size(); n += std::max<size_t>(1, bytes.size() / 97)) cuts.push_back(n);
    for (size_t back = 1; back <= 16 && back < bytes.size(); ++back) cuts.push_back(bytes.size() - back);
    for (size_t n : cuts) {
      const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
      const std::string label = fmt::format("{}[:{}]", name, n);
      EXPECT_FALSE(decodes_or_refuses_cleanly(cut, label)) << label << " decoded although truncated";
    }
  }
}

TEST(Image, TruncatedJpegIsAnErrorNotGreyFill) {
  const std::vector<uint8_t> bytes = file_bytes(fixture_dir() / "rgb_420_320x240.jpg");
  const std::vector<uint8_t> half(bytes.begin(),
                                  bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() / 2));
  EXPECT_EQ(refusal(half, "half.jpg"), "half.jpg: corrupt JPEG: Premature end of JPEG file");
}

TEST(Image, ExtraneousBytesBeforeAMarkerAreSkippedAsPilDoes) {
  // libjpeg warns "Corrupt JPEG data: 3 extraneous bytes before marker 0xd9" and changes no pixel; PIL
  // decodes such files, so forge does too (every other libjpeg warning is an error).
  std::vector<uint8_t> bytes = file_bytes(fixture_dir() / "rgb_444_61x47.jpg");
  ASSERT_EQ(bytes[bytes.size() - 2], 0xFF);
  ASSERT_EQ(bytes[bytes.size() - 1], 0xD9);
  const std::vector<uint8_t> original = bytes;
  bytes.insert(bytes.end() - 2, {0x12, 0x34, 0x56});
  EXPECT_EQ(decode_image(bytes, "junk.jpg").pixels, decode_image(original, "clean.jpg").pixels);
}

// Recomputes every chunk CRC so that a mutation reaches libpng's decoder rather than its CRC check.
void fix_png_crcs(std::vector<uint8_t>& b) {
  size_t at = 8;
  while (at + 12 <= b.size()) {
    const uint32_t length =
        (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | b[at + 3];
    if (length > b.size() - at - 12) return;
    const uint32_t crc = static_cast<uint32_t>(crc32(0, b.data() + at + 4, length + 4));
    for (int i = 0; i < 4; ++i)
      b[at + 8 + length + static_cast<size_t>(i)] = static_cast<uint8_t>(crc >> (24 - 8 * i));
    at += 12 + length;
  }
}

TEST(Image, RandomMutationsNeverCrashOrHang) {
  std::vector<std::vector<uint8_t>> sources;
  std::vector<std::string> names;
  for (const std::string& name : decodable_fixtures()) {
    sources.push_back(file_bytes(fixture_dir() / name));
    names.push_back(name);
  }
  std::mt19937 rng(20240601);  // std::mt19937's output sequence is fixed by the standard
  const auto start = std::chrono::steady_clock::now();
  int decoded = 0, refused = 0;
  constexpr int kMutations = 6000;
  for (int i = 0; i < kMutations; ++i) {
    const size_t which = i % sources.size();
    std::vector<uint8_t> bytes = sources[which];
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      // Half the flips land in the first 256 bytes, where the headers are.
      const size_t span = (rng() % 2 == 0) ? std::min<size_t>(bytes.size(), 256) : bytes.size();
      bytes[rng() % span] ^= static_cast<uint8_t>(1 + rng() % 255);
    }
    if (bytes[1] == 'P' && i % 2 == 0) fix_png_crcs(bytes);
    const std::string label = fmt::format("{}#{}", names[which], i);
    (decodes_or_refuses_cleanly(bytes, label) ? decoded : refused)++;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(decoded + refused, kMutations);
  EXPECT_GT(refused, 0);
  EXPECT_LT(seconds, 10.0);
  std::printf("mutations: %d decoded, %d refused, %.2f s\n", decoded, refused, seconds);
}

}  // namespace
}  // namespace forge::data::image_test
