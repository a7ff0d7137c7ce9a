// The packed image-text file (layout in image_text_impl.h and docs/formats.md): written in one pass under a
// temporary name, read through a read-only mapping after checking every count against the file's size.
#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/int128.h"
#include "forge/data/image/image_text.h"
#include "forge/data/image/image_text_impl.h"

namespace forge::data {

MappedImageTextFile::MappedImageTextFile(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open packed image-text data ({})", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    fail("{}: cannot stat packed image-text data ({})", path.string(), std::strerror(error));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* data = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      fail("{}: cannot map packed image-text data ({})", path.string(), std::strerror(error));
    }
    data_ = static_cast<const uint8_t*>(data);
  }
  ::close(fd);
}

MappedImageTextFile::~MappedImageTextFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

constexpr size_t kHeaderBytes = sizeof(PackedImageTextHeader);

uint32_t crc32_of(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib's crc32 takes a uInt length
    const auto chunk = static_cast<uInt>(std::min<size_t>(size, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, chunk));
    p += chunk;
    size -= chunk;
  }
  return crc;
}

uint32_t header_crc(const PackedImageTextHeader& h) {
  return crc32_of(0, &h, offsetof(PackedImageTextHeader, header_crc32));
}

// Body bytes for these counts, or nullopt when they overflow.
std::optional<uint64_t> body_size(int64_t samples, int64_t images, int64_t seq_len, int64_t image_bytes) {
  constexpr int64_t limit = int64_t{1} << 50;  // a petabyte: larger counts are corruption
  if (samples < 0 || images < 0 || seq_len < 1 || image_bytes < 1 || samples > limit || images > limit ||
      seq_len > limit || image_bytes > limit)
    return std::nullopt;
  const int128 total = static_cast<int128>(samples + 1) * 8 + static_cast<int128>(samples) * seq_len * 8 +
                       static_cast<int128>(images) * image_bytes;
  if (total > static_cast<int128>(limit)) return std::nullopt;
  return static_cast<uint64_t>(total);
}

// A file written in order under "<path>.tmp", its header patched last, then fsynced and renamed.
class PackedWriter {
 public:
  explicit PackedWriter(const std::filesystem::path& path) : path_(path), tmp_(path) {
    tmp_ += ".tmp";
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot write packed image-text data {}: {}", tmp_.string(), std::strerror(errno));
  }
  ~PackedWriter() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  void write_at(const void* data, size_t size, off_t offset) {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::pwrite(fd_, p, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("cannot write packed image-text data {}: {}", tmp_.string(), std::strerror(errno));
      p += n, size -= static_cast<size_t>(n), offset += n;
    }
  }
  // Appends to the body, updating its CRC.
  void append(const void* data, size_t size) {
    write_at(data, size, static_cast<off_t>(kHeaderBytes + body_bytes_));
    body_crc_ = crc32_of(body_crc_, data, size);
    body_bytes_ += size;
  }
  uint64_t body_bytes() const { return body_bytes_; }
  uint32_t body_crc() const { return body_crc_; }
  void commit(const PackedImageTextHeader& header) {
    write_at(&header, kHeaderBytes, 0);
    if (::fsync(fd_) != 0)
      fail("cannot fsync packed image-text data {}: {}", tmp_.string(), std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      const int error = errno;
      ::unlink(tmp_.c_str());
      fail("cannot write packed image-text data {}: {}", tmp_.string(), std::strerror(error));
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int error = errno;
      ::unlink(tmp_.c_str());
      fail("cannot rename {} to {}: {}", tmp_.string(), path_.string(), std::strerror(error));
    }
    fsync_directory(path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path());
  }

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  uint64_t body_bytes_ = 0;
  uint32_t body_crc_ = 0;
};

}  // namespace

PackImageTextStats write_packed_image_text(const ImageTextDataset& dataset, const std::filesystem::path& out,
                                           uint64_t text_fingerprint, int workers) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t samples = dataset.num_samples(), seq_len = dataset.seq_len();
  const auto shape = dataset.image_shape();
  const int64_t image_bytes = shape[0] * shape[1] * shape[2];

  // Everything but the pixels comes straight from the dataset's views.
  std::vector<int64_t> offsets(static_cast<size_t>(samples) + 1, 0);
  for (int64_t s = 0; s < samples; ++s)
    offsets[static_cast<size_t>(s) + 1] = offsets[s] + dataset.images_in_sample(s);
  PackedWriter writer(out);
  writer.append(offsets.data(), offsets.size() * sizeof(int64_t));
  // Rows straight from the dataset (no second copy of every id in memory).
  for (int64_t s = 0; s < samples; ++s)
    writer.append(dataset.sample_ids(s).data(), sizeof(int32_t) * seq_len);
  for (int64_t s = 0; s < samples; ++s)
    writer.append(dataset.sample_targets(s).data(), sizeof(int32_t) * seq_len);

  // Pixels: decoded in parallel a chunk of samples at a time, written in sample order.
  const int64_t chunk = 256;
  const int threads = workers > 0 ? workers : omp_get_max_threads();
  std::vector<std::vector<uint8_t>> crops(static_cast<size_t>(chunk));
  std::vector<std::string> errors(static_cast<size_t>(chunk));
  for (int64_t s = 0; s < samples; s += chunk) {
    const int64_t n = std::min(chunk, samples - s);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < n; ++b) {
      try {
        crops[static_cast<size_t>(b)] = dataset.sample_image_bytes(s + b);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(b)] = e.what();
      }
    }
    for (int64_t b = 0; b < n; ++b) {
      if (!errors[static_cast<size_t>(b)].empty()) throw Error(errors[static_cast<size_t>(b)]);
      const auto& bytes = crops[static_cast<size_t>(b)];
      if (static_cast<int64_t>(bytes.size()) != dataset.images_in_sample(s + b) * image_bytes)
        fail("{}: sample {} gave {} image bytes, not {}", out.string(), s + b, bytes.size(),
             dataset.images_in_sample(s + b) * image_bytes);
      writer.append(bytes.data(), bytes.size());
      crops[static_cast<size_t>(b)] = {};
    }
  }

  PackedImageTextHeader h{};
  std::memcpy(h.magic, kPackedImageTextMagic, sizeof h.magic);
  h.version = kPackedImageTextVersion;
  h.header_bytes = kHeaderBytes;
  h.samples = samples;
  h.images = dataset.num_images();
  h.seq_len = seq_len;
  h.channels = shape[0];
  h.height = shape[1];
  h.width = shape[2];
  h.image_token_id = dataset.image_token_id();
  h.tokens_per_image = dataset.tokens_per_image();
  h.resize_crop_fingerprint = resize_crop_fingerprint(dataset.processor().config());
  h.text_fingerprint = text_fingerprint;
  h.skipped_bad = dataset.skipped_bad();
  h.skipped_too_long = dataset.skipped_too_long();
  h.body_bytes = writer.body_bytes();
  h.body_crc32 = writer.body_crc();
  h.header_crc32 = header_crc(h);
  writer.commit(h);

  PackImageTextStats stats;
  stats.samples = samples;
  stats.images = h.images;
  stats.bytes = static_cast<int64_t>(kHeaderBytes + h.body_bytes);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

ImageTextDataset ImageTextDataset::from_packed(const std::filesystem::path& path,
                                               const ImageProcessor& processor,
                                               const PackedImageTextExpectation& expect) {
  const std::string name = path.string();
  auto mapping = std::make_unique<MappedImageTextFile>(path);
  const size_t size = mapping->size();
  if (size < kHeaderBytes)
    fail("{}: truncated packed image-text data: {} bytes, shorter than its {}-byte header", name, size,
         kHeaderBytes);
  PackedImageTextHeader h;
  std::memcpy(&h, mapping->data(), kHeaderBytes);
  if (std::memcmp(h.magic, kPackedImageTextMagic, sizeof h.magic) != 0)
    fail("{}: not a packed image-text file (its first bytes are not FORGEITX)", name);
  if (h.version != kPackedImageTextVersion)
    fail("{}: packed image-text version {} is not supported (forge reads version {})", name, h.version,
         kPackedImageTextVersion);
  if (h.header_bytes != kHeaderBytes || header_crc(h) != h.header_crc32)
    fail("{}: corrupt packed image-text header (checksum mismatch)", name);
  const auto body = body_size(h.samples, h.images, h.seq_len, h.channels * h.height * h.width);
  if (h.channels != 3 || h.height < 1 || h.width < 1 || !body || *body != h.body_bytes)
    fail("{}: corrupt packed image-text header (counts that do not add up)", name);
  if (size != kHeaderBytes + h.body_bytes)
    fail("{}: {} packed image-text data: {} bytes, but its header describes {}", name,
         size < kHeaderBytes + h.body_bytes ? "truncated" : "oversized", size, kHeaderBytes + h.body_bytes);
  if (expect.verify_checksum && crc32_of(0, mapping->data() + kHeaderBytes, h.body_bytes) != h.body_crc32)
    fail("{}: corrupt packed image-text data (body checksum mismatch)", name);

  // Agreement with the caller's model and processor.
  auto mismatch = [&](const char* what, auto file_value, auto caller_value) {
    if (file_value != caller_value)
      fail("{}: packed with {} {}, but this run uses {}; repack it with `forge data preprocess-images`", name,
           what, file_value, caller_value);
  };
  mismatch("seq_len", h.seq_len, expect.seq_len);
  mismatch("image_token_id", h.image_token_id, expect.image_token_id);
  mismatch("tokens_per_image", h.tokens_per_image, expect.tokens_per_image);
  const auto [oh, ow] = [&] {
    const ImageProcessorConfig& c = processor.config();
    if (c.kind == ImageProcessorConfig::Kind::clip && c.do_center_crop)
      return std::array<int64_t, 2>{c.crop_height, c.crop_width};
    if (c.do_resize && c.shortest_edge <= 0) return std::array<int64_t, 2>{c.resize_height, c.resize_width};
    fail(
        "image-text data needs every image at one size: the image processor must center-crop or resize to a "
        "height and width");
  }();
  if (h.height != oh || h.width != ow)
    fail("{}: packed with {}x{} images, but the image processor makes {}x{}", name, h.width, h.height, ow,
         oh);
  if (h.resize_crop_fingerprint != resize_crop_fingerprint(processor.config()))
    fail("{}: packed with other resize/crop settings than this preprocessor config (size, resample or crop)",
         name);
  if (expect.text_fingerprint != 0 && h.text_fingerprint != expect.text_fingerprint)
    fail("{}: packed with another tokenizer than this run's", name);

  auto impl = std::make_unique<Impl>(processor);
  impl->seq_len = h.seq_len;
  impl->tokens_per_image = h.tokens_per_image;
  impl->image_token_id = h.image_token_id;
  impl->height = h.height;
  impl->width = h.width;
  impl->samples = h.samples;
  impl->images = h.images;
  impl->skipped_bad = h.skipped_bad;
  impl->skipped_too_long = h.skipped_too_long;
  const uint8_t* p = mapping->data() + kHeaderBytes;
  impl->image_offsets = reinterpret_cast<const int64_t*>(p);
  impl->ids = reinterpret_cast<const int32_t*>(p + (h.samples + 1) * 8);
  impl->targets = impl->ids + h.samples * h.seq_len;
  impl->pixels = reinterpret_cast<const uint8_t*>(impl->targets + h.samples * h.seq_len);

  // The offsets and the image tokens must agree, so a batch never reads past the pixels.
  if (impl->image_offsets[0] != 0 || impl->image_offsets[h.samples] != h.images)
    fail("{}: corrupt packed image-text data (image offsets)", name);
  for (int64_t s = 0; s < h.samples; ++s) {
    const int64_t count = impl->image_offsets[s + 1] - impl->image_offsets[s];
    int64_t image_tokens = 0;
    for (int64_t i = 0; i < h.seq_len; ++i) image_tokens += impl->ids[s * h.seq_len + i] == h.image_token_id;
    if (count < 0 || image_tokens != count * h.tokens_per_image)
      fail("{}: corrupt packed image-text data (sample {} has {} image tokens for {} images)", name, s,
           image_tokens, count);
  }
  impl->mapping = std::move(mapping);
  return ImageTextDataset(std::move(impl));
}

bool is_packed_image_text(const std::filesystem::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  char magic[8] = {};
  const size_t n = std::fread(magic, 1, sizeof(magic), f);
  std::fclose(f);
  return n == sizeof(magic) && std::string_view(magic, 8) == "FORGEITX";
}

}  // namespace forge::data
