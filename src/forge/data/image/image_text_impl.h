// What image_text.cpp (JSONL, batches) and image_text_packed.cpp (the packed file) share: the dataset's
// state, and the packed file's header.
#pragma once

#include <bit>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/image/image_text.h"

namespace forge::data {

static_assert(std::endian::native == std::endian::little, "the packed image-text format is little-endian");

// A read-only mapping of a whole file.
class MappedImageTextFile {
 public:
  explicit MappedImageTextFile(const std::filesystem::path& path);
  MappedImageTextFile(const MappedImageTextFile&) = delete;
  MappedImageTextFile& operator=(const MappedImageTextFile&) = delete;
  ~MappedImageTextFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct ImageTextDataset::Impl {
  ImageProcessor processor;
  int64_t seq_len = 0, tokens_per_image = 0;
  int32_t image_token_id = -1;
  int64_t height = 0, width = 0;
  int64_t samples = 0, images = 0;
  int64_t skipped_bad = 0, skipped_too_long = 0;
  std::vector<std::string> skip_reasons;

  // Views of the samples: into the vectors below (JSONL) or into the mapping (packed).
  const int64_t* image_offsets = nullptr;  // [samples + 1]: the first image of each sample
  const int32_t* ids = nullptr;            // [samples, seq_len]
  const int32_t* targets = nullptr;        // [samples, seq_len]
  const uint8_t* pixels = nullptr;         // packed: [images, 3, H, W]

  // JSONL
  std::vector<int64_t> offsets_storage;
  std::vector<int32_t> ids_storage, targets_storage;
  std::vector<std::filesystem::path> image_paths;  // [images]
  std::vector<int64_t> lines;                      // [samples]: 1-based JSONL line

  // packed
  std::unique_ptr<MappedImageTextFile> mapping;

  explicit Impl(const ImageProcessor& p) : processor(p) {}
  int64_t image_bytes() const { return 3 * height * width; }
};

// The packed file: a 128-byte header, then int64 image_offsets[samples + 1], int32 ids[samples * seq_len],
// int32 targets[samples * seq_len], uint8 pixels[images * 3 * H * W], all little-endian.
inline constexpr char kPackedImageTextMagic[8] = {'F', 'O', 'R', 'G', 'E', 'I', 'T', 'X'};
inline constexpr uint32_t kPackedImageTextVersion = 1;

struct PackedImageTextHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;  // 128
  int64_t samples;
  int64_t images;
  int64_t seq_len;
  int64_t channels;  // 3
  int64_t height;
  int64_t width;
  int32_t image_token_id;
  uint32_t reserved;  // 0
  int64_t tokens_per_image;
  uint64_t resize_crop_fingerprint;
  uint64_t text_fingerprint;
  int64_t skipped_bad;
  int64_t skipped_too_long;
  uint64_t body_bytes;
  uint32_t body_crc32;    // of every byte after the header
  uint32_t header_crc32;  // of the 124 bytes before it
};
static_assert(sizeof(PackedImageTextHeader) == 128);

// 64-bit FNV-1a.
uint64_t fnv1a64(std::string_view bytes);

// The sample's images' 8-bit crops, [3, H, W] each, decoded from the JSONL's image files.
std::vector<uint8_t> decode_sample_crops(const ImageTextDataset::Impl& impl, int64_t index);

}  // namespace forge::data
