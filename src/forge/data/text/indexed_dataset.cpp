#include "forge/data/text/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>

#include "forge/core/error.h"

namespace forge::data {

static_assert(std::endian::native == std::endian::little, "Megatron indexed datasets are little-endian");

namespace {

constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, sequence count, document count

std::string errno_text() { return std::strerror(errno); }

template <typename T>
T load(const unsigned char* base, size_t at) {
  T value;
  std::memcpy(&value, base + at, sizeof(T));
  return value;
}

// Ranges a token of each integer dtype can hold.
void token_range(IndexedDType dtype, int64_t& lo, int64_t& hi) {
  switch (dtype) {
    case IndexedDType::u8:
      lo = 0, hi = 255;
      return;
    case IndexedDType::i8:
      lo = -128, hi = 127;
      return;
    case IndexedDType::i16:
      lo = -32768, hi = 32767;
      return;
    case IndexedDType::u16:
      lo = 0, hi = 65535;
      return;
    case IndexedDType::i32:
    case IndexedDType::i64:
      lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
      return;
    default:
      fail("indexed dataset: {} is not an integer token dtype", indexed_dtype_name(dtype));
  }
}

template <typename T>
void convert_tokens(std::span<const int32_t> tokens, unsigned char* out) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const T value = static_cast<T>(tokens[i]);
    std::memcpy(out + i * sizeof(T), &value, sizeof(T));
  }
}

// Writes a whole file-backed stream to disk before it is renamed into place.
void flush_and_sync(std::FILE* file, const std::string& path) {
  if (std::fflush(file) != 0) fail("indexed dataset '{}': write failed: {}", path, errno_text());
  if (::fsync(::fileno(file)) != 0) fail("indexed dataset '{}': fsync failed: {}", path, errno_text());
}

void sync_directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string directory = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Maps a whole file read-only; an empty file maps to nullptr.
const unsigned char* map_file(const std::string& path, size_t& size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("indexed dataset '{}': cannot open: {}", path, errno_text());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    fail("indexed dataset '{}': cannot stat: {}", path, why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("indexed dataset '{}': not a regular file", path);
  }
  size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return nullptr;
  }
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const std::string why = data == MAP_FAILED ? errno_text() : std::string();
  ::close(fd);
  if (data == MAP_FAILED) fail("indexed dataset '{}': cannot map: {}", path, why);
  return static_cast<const unsigned char*>(data);
}

}  // namespace

bool indexed_dtype_known(uint8_t code) { return code >= 1 && code <= 8; }

int64_t indexed_dtype_size(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::u8:
    case IndexedDType::i8:
      return 1;
    case IndexedDType::i16:
    case IndexedDType::u16:
      return 2;
    case IndexedDType::i32:
    case IndexedDType::f32:
      return 4;
    case IndexedDType::i64:
    case IndexedDType::f64:
      return 8;
  }
  fail("indexed dataset: unknown dtype code {}", static_cast<int>(dtype));
}

std::string_view indexed_dtype_name(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::u8:
      return "uint8";
    case IndexedDType::i8:
      return "int8";
    case IndexedDType::i16:
      return "int16";
    case IndexedDType::i32:
      return "int32";
    case IndexedDType::i64:
      return "int64";
    case IndexedDType::f64:
      return "float64";
    case IndexedDType::f32:
      return "float32";
    case IndexedDType::u16:
      return "uint16";
  }
  return "unknown";
}

bool indexed_dtype_is_integer(IndexedDType dtype) {
  return dtype != IndexedDType::f32 && dtype != IndexedDType::f64;
}

IndexedDType indexed_dtype_for_vocab(int64_t vocab_size) {
  if (vocab_size <= 0) fail("indexed dataset: vocabulary size must be positive, got {}", vocab_size);
  return vocab_size < 65500 ? IndexedDType::u16 : IndexedDType::i32;
}

std::string indexed_bin_path(const std::string& prefix) { return prefix + ".bin"; }
std::string indexed_idx_path(const std::string& prefix) { return prefix + ".idx"; }

// ---------------------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexedDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  if (prefix_.empty()) fail("indexed dataset: the output prefix is empty");
  if (!indexed_dtype_is_integer(dtype_))
    fail("indexed dataset '{}': tokens must use an integer dtype, not {}", prefix_,
         indexed_dtype_name(dtype_));
  const std::string tmp = indexed_bin_path(prefix_) + ".tmp";
  bin_ = std::fopen(tmp.c_str(), "wb");
  if (!bin_) fail("indexed dataset '{}': cannot create: {}", tmp, errno_text());
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (!finalized_) discard();
}

void IndexedDatasetWriter::discard() {
  if (bin_) std::fclose(bin_);
  bin_ = nullptr;
  ::unlink((indexed_bin_path(prefix_) + ".tmp").c_str());
  ::unlink((indexed_idx_path(prefix_) + ".tmp").c_str());
}

void IndexedDatasetWriter::write_bin(const void* data, size_t bytes) {
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, bin_) != bytes)
    fail("indexed dataset '{}.tmp': write failed: {}", indexed_bin_path(prefix_), errno_text());
}

void IndexedDatasetWriter::add_item(std::span<const int32_t> tokens) {
  if (finalized_) fail("indexed dataset '{}': add_item after finalize", prefix_);
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail("indexed dataset '{}': a sequence of {} tokens exceeds the format's int32 length", prefix_,
         tokens.size());
  int64_t lo, hi;
  token_range(dtype_, lo, hi);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < lo || tokens[i] > hi)
      fail("indexed dataset '{}': token {} of sequence {} is {}, which does not fit {}", prefix_, i,
           lengths_.size(), tokens[i], indexed_dtype_name(dtype_));
  const size_t itemsize = static_cast<size_t>(indexed_dtype_size(dtype_));
  convert_buffer_.resize(tokens.size() * itemsize);
  switch (dtype_) {
    case IndexedDType::u8:
      convert_tokens<uint8_t>(tokens, convert_buffer_.data());
      break;
    case IndexedDType::i8:
      convert_tokens<int8_t>(tokens, convert_buffer_.data());
      break;
    case IndexedDType::i16:
      convert_tokens<int16_t>(tokens, convert_buffer_.data());
      break;
    case IndexedDType::u16:
      convert_tokens<uint16_t>(tokens, convert_buffer_.data());
      break;
    case IndexedDType::i32:
      convert_tokens<int32_t>(tokens, convert_buffer_.data());
      break;
    case IndexedDType::i64:
      convert_tokens<int64_t>(tokens, convert_buffer_.data());
      break;
    default:
      fail("indexed dataset '{}': unsupported token dtype", prefix_);
  }
  write_bin(convert_buffer_.data(), convert_buffer_.size());
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::end_document() {
  if (finalized_) fail("indexed dataset '{}': end_document after finalize", prefix_);
  document_indices_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  add_item(tokens);
  end_document();
}

void IndexedDatasetWriter::add_index(const std::string& other_prefix) {
  if (finalized_) fail("indexed dataset '{}': add_index after finalize", prefix_);
  if (document_indices_.back() != static_cast<int64_t>(lengths_.size()))
    fail("indexed dataset '{}': add_index('{}') inside an unfinished document (call end_document first)",
         prefix_, other_prefix);
  IndexedDataset other(other_prefix);
  if (other.dtype() != dtype_)
    fail("indexed dataset '{}': cannot append '{}': its tokens are {}, this dataset's are {}", prefix_,
         other_prefix, indexed_dtype_name(other.dtype()), indexed_dtype_name(dtype_));
  const int64_t base = static_cast<int64_t>(lengths_.size());
  for (int64_t s = 0; s < other.num_sequences(); ++s) {
    lengths_.push_back(static_cast<int32_t>(other.sequence_length(s)));
    const auto bytes = other.sequence_bytes(s);
    write_bin(bytes.data(), bytes.size());
  }
  for (int64_t d = 1; d <= other.num_documents(); ++d)
    document_indices_.push_back(base + other.document_index(d));
  tokens_ += other.total_tokens();
}

void IndexedDatasetWriter::finalize() {
  if (finalized_) fail("indexed dataset '{}': finalize called twice", prefix_);
  if (document_indices_.back() != static_cast<int64_t>(lengths_.size()))
    fail("indexed dataset '{}': {} sequence(s) after the last end_document belong to no document", prefix_,
         static_cast<int64_t>(lengths_.size()) - document_indices_.back());
  const std::string bin_path = indexed_bin_path(prefix_), idx_path = indexed_idx_path(prefix_);
  const std::string bin_tmp = bin_path + ".tmp", idx_tmp = idx_path + ".tmp";
  try {
    flush_and_sync(bin_, bin_tmp);
    const int closed = std::fclose(bin_);
    bin_ = nullptr;
    if (closed != 0) fail("indexed dataset '{}': close failed: {}", bin_tmp, errno_text());

    std::FILE* idx = std::fopen(idx_tmp.c_str(), "wb");
    if (!idx) fail("indexed dataset '{}': cannot create: {}", idx_tmp, errno_text());
    try {
      std::vector<unsigned char> out;
      const uint64_t version = 1, sequences = lengths_.size(), documents = document_indices_.size();
      const uint8_t code = static_cast<uint8_t>(dtype_);
      auto put = [&out](const void* p, size_t n) {
        const auto* b = static_cast<const unsigned char*>(p);
        out.insert(out.end(), b, b + n);
      };
      put(kMagic, sizeof(kMagic));
      put(&version, 8);
      put(&code, 1);
      put(&sequences, 8);
      put(&documents, 8);
      put(lengths_.data(), lengths_.size() * sizeof(int32_t));
      const int64_t itemsize = indexed_dtype_size(dtype_);
      int64_t pointer = 0;
      for (int32_t length : lengths_) {
        put(&pointer, 8);
        pointer += static_cast<int64_t>(length) * itemsize;
      }
      put(document_indices_.data(), document_indices_.size() * sizeof(int64_t));
      if (std::fwrite(out.data(), 1, out.size(), idx) != out.size())
        fail("indexed dataset '{}': write failed: {}", idx_tmp, errno_text());
      flush_and_sync(idx, idx_tmp);
    } catch (...) {
      std::fclose(idx);
      throw;
    }
    if (std::fclose(idx) != 0) fail("indexed dataset '{}': close failed: {}", idx_tmp, errno_text());

    // An older index next to the new tokens would look like a complete pair: remove it first, then
    // publish the tokens, then the index.
    if (::unlink(idx_path.c_str()) != 0 && errno != ENOENT)
      fail("indexed dataset '{}': cannot remove the old index: {}", idx_path, errno_text());
    if (::rename(bin_tmp.c_str(), bin_path.c_str()) != 0)
      fail("indexed dataset '{}': cannot rename '{}' over it: {}", bin_path, bin_tmp, errno_text());
    sync_directory_of(bin_path);
    if (::rename(idx_tmp.c_str(), idx_path.c_str()) != 0)
      fail("indexed dataset '{}': cannot rename '{}' over it: {}", idx_path, idx_tmp, errno_text());
    sync_directory_of(idx_path);
  } catch (...) {
    discard();
    finalized_ = true;
    throw;
  }
  finalized_ = true;
}

// ---------------------------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = indexed_idx_path(prefix), bin_path = indexed_bin_path(prefix);
  if (::access(idx_path.c_str(), F_OK) != 0) fail("indexed dataset '{}': missing (no such file)", idx_path);
  if (::access(bin_path.c_str(), F_OK) != 0) fail("indexed dataset '{}': missing (no such file)", bin_path);
  try {
    idx_ = map_file(idx_path, idx_size_);
    if (idx_size_ < kHeaderBytes)
      fail("indexed dataset '{}': truncated header: {} bytes, a Megatron index has at least {}", idx_path,
           idx_size_, kHeaderBytes);
    if (std::memcmp(idx_, kMagic, sizeof(kMagic)) != 0)
      fail("indexed dataset '{}': bad magic: not a Megatron MMIDIDX index", idx_path);
    const uint64_t version = load<uint64_t>(idx_, 9);
    if (version != 1) fail("indexed dataset '{}': unsupported version {} (expected 1)", idx_path, version);
    const uint8_t code = load<uint8_t>(idx_, 17);
    if (!indexed_dtype_known(code)) fail("indexed dataset '{}': unknown token dtype code {}", idx_path, code);
    dtype_ = static_cast<IndexedDType>(code);
    const uint64_t sequences = load<uint64_t>(idx_, 18), documents = load<uint64_t>(idx_, 26);

    // Check the counts against the file size without overflowing: each sequence needs 12 bytes, each
    // document index 8.
    const uint64_t body = idx_size_ - kHeaderBytes;
    if (sequences > body / 12 || documents > body / 8 || sequences * 12 + documents * 8 != body) {
      const bool fits = sequences <= body / 12 && documents <= body / 8;
      if (fits && sequences * 13 + documents * 8 == body)
        fail(
            "indexed dataset '{}': holds per-sequence modes (a multimodal dataset), which forge does not "
            "read",
            idx_path);
      fail(
          "indexed dataset '{}': the header counts {} sequences and {} document indices, which need {} "
          "bytes, "
          "but the file has {} (truncated or corrupt)",
          idx_path, sequences, documents,
          fits ? fmt::format("{}", kHeaderBytes + sequences * 12 + documents * 8) : std::string("more"),
          idx_size_);
    }
    num_sequences_ = static_cast<int64_t>(sequences);
    num_document_indices_ = static_cast<int64_t>(documents);
    lengths_at_ = kHeaderBytes;
    offsets_at_ = lengths_at_ + sequences * 4;
    documents_at_ = offsets_at_ + sequences * 8;

    if (num_document_indices_ == 0)
      fail(
          "indexed dataset '{}': no document indices (the list must start with 0 and end with the sequence "
          "count)",
          idx_path);
    int64_t previous = document_index(0);
    if (previous != 0)
      fail("indexed dataset '{}': the first document index is {}, expected 0", idx_path, previous);
    for (int64_t d = 1; d < num_document_indices_; ++d) {
      const int64_t current = document_index(d);
      if (current < previous)
        fail("indexed dataset '{}': document indices are not monotone: index {} is {} after {}", idx_path, d,
             current, previous);
      previous = current;
    }
    if (previous != num_sequences_)
      fail("indexed dataset '{}': the last document index is {}, expected the sequence count {}", idx_path,
           previous, num_sequences_);

    const int64_t itemsize = indexed_dtype_size(dtype_);
    int64_t expected_offset = 0;
    for (int64_t s = 0; s < num_sequences_; ++s) {
      const int64_t length = load<int32_t>(idx_, lengths_at_ + static_cast<size_t>(s) * 4);
      const int64_t offset = load<int64_t>(idx_, offsets_at_ + static_cast<size_t>(s) * 8);
      if (length < 0) fail("indexed dataset '{}': sequence {} has negative length {}", idx_path, s, length);
      if (offset != expected_offset)
        fail(
            "indexed dataset '{}': sequence {} starts at byte {} of the .bin, but the lengths before it end "
            "at "
            "byte {}",
            idx_path, s, offset, expected_offset);
      if (expected_offset > std::numeric_limits<int64_t>::max() - length * itemsize)
        fail("indexed dataset '{}': sequence lengths overflow a 64-bit byte offset", idx_path);
      expected_offset += length * itemsize;
      total_tokens_ += length;
    }

    bin_ = map_file(bin_path, bin_size_);
    if (static_cast<uint64_t>(expected_offset) != bin_size_)
      fail("indexed dataset '{}': {} bytes, but the index '{}' describes {} bytes of {} tokens", bin_path,
           bin_size_, idx_path, expected_offset, indexed_dtype_name(dtype_));
  } catch (...) {
    release();
    throw;
  }
}

IndexedDataset::IndexedDataset(IndexedDataset&& other) noexcept { *this = std::move(other); }

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& other) noexcept {
  if (this != &other) {
    release();
    prefix_ = std::move(other.prefix_);
    dtype_ = other.dtype_;
    num_sequences_ = other.num_sequences_;
    num_document_indices_ = other.num_document_indices_;
    total_tokens_ = other.total_tokens_;
    idx_ = std::exchange(other.idx_, nullptr);
    idx_size_ = std::exchange(other.idx_size_, 0);
    bin_ = std::exchange(other.bin_, nullptr);
    bin_size_ = std::exchange(other.bin_size_, 0);
    lengths_at_ = other.lengths_at_;
    offsets_at_ = other.offsets_at_;
    documents_at_ = other.documents_at_;
  }
  return *this;
}

IndexedDataset::~IndexedDataset() { release(); }

void IndexedDataset::release() {
  if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
  if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
  idx_ = bin_ = nullptr;
  idx_size_ = bin_size_ = 0;
}

void IndexedDataset::check_sequence(int64_t sequence) const {
  if (sequence < 0 || sequence >= num_sequences_)
    fail("indexed dataset '{}': sequence {} is out of range [0, {})", prefix_, sequence, num_sequences_);
}

int64_t IndexedDataset::sequence_length(int64_t sequence) const {
  check_sequence(sequence);
  return load<int32_t>(idx_, lengths_at_ + static_cast<size_t>(sequence) * 4);
}

int64_t IndexedDataset::sequence_offset(int64_t sequence) const {
  check_sequence(sequence);
  return load<int64_t>(idx_, offsets_at_ + static_cast<size_t>(sequence) * 8);
}

int64_t IndexedDataset::document_index(int64_t i) const {
  if (i < 0 || i >= num_document_indices_)
    fail("indexed dataset '{}': document index {} is out of range [0, {})", prefix_, i,
         num_document_indices_);
  return load<int64_t>(idx_, documents_at_ + static_cast<size_t>(i) * 8);
}

std::pair<int64_t, int64_t> IndexedDataset::document_sequences(int64_t document) const {
  if (document < 0 || document >= num_documents())
    fail("indexed dataset '{}': document {} is out of range [0, {})", prefix_, document, num_documents());
  return {document_index(document), document_index(document + 1)};
}

std::span<const std::byte> IndexedDataset::sequence_bytes(int64_t sequence) const {
  const int64_t length = sequence_length(sequence);
  const int64_t offset = sequence_offset(sequence);
  if (length == 0) return {};
  return {reinterpret_cast<const std::byte*>(bin_) + offset,
          static_cast<size_t>(length * indexed_dtype_size(dtype_))};
}

void IndexedDataset::check_type(size_t size, bool is_signed, bool is_float) const {
  bool ok = false;
  switch (dtype_) {
    case IndexedDType::u8:
      ok = size == 1 && !is_signed && !is_float;
      break;
    case IndexedDType::i8:
      ok = size == 1 && is_signed && !is_float;
      break;
    case IndexedDType::i16:
      ok = size == 2 && is_signed && !is_float;
      break;
    case IndexedDType::u16:
      ok = size == 2 && !is_signed && !is_float;
      break;
    case IndexedDType::i32:
      ok = size == 4 && is_signed && !is_float;
      break;
    case IndexedDType::i64:
      ok = size == 8 && is_signed && !is_float;
      break;
    case IndexedDType::f32:
      ok = size == 4 && is_float;
      break;
    case IndexedDType::f64:
      ok = size == 8 && is_float;
      break;
  }
  if (!ok)
    fail("indexed dataset '{}': tokens are {}, read with a different {}-byte type", prefix_,
         indexed_dtype_name(dtype_), size);
}

namespace {

template <typename T>
void widen_tokens(const std::byte* data, int64_t count, int32_t* out, const std::string& prefix,
                  int64_t sequence, int64_t offset) {
  const T* tokens = reinterpret_cast<const T*>(data);
  for (int64_t i = 0; i < count; ++i) {
    const T value = tokens[i];
    if constexpr (std::is_signed_v<T> || sizeof(T) >= 4) {
      if (value < 0 || static_cast<int64_t>(value) > std::numeric_limits<int32_t>::max())
        fail("indexed dataset '{}': token {} of sequence {} is {}, not a valid token id",
             indexed_bin_path(prefix), offset + i, sequence, static_cast<int64_t>(value));
    }
    out[i] = static_cast<int32_t>(value);
  }
}

}  // namespace

void IndexedDataset::read_tokens(int64_t sequence, int64_t offset, int64_t count, int32_t* out) const {
  const int64_t length = sequence_length(sequence);
  if (offset < 0 || count < 0 || offset > length || count > length - offset)
    fail("indexed dataset '{}': tokens [{}, {}) of sequence {} are outside its {} tokens", prefix_, offset,
         offset + count, sequence, length);
  if (count == 0) return;
  const std::byte* data = reinterpret_cast<const std::byte*>(bin_) + sequence_offset(sequence) +
                          offset * indexed_dtype_size(dtype_);
  switch (dtype_) {
    case IndexedDType::u8:
      return widen_tokens<uint8_t>(data, count, out, prefix_, sequence, offset);
    case IndexedDType::i8:
      return widen_tokens<int8_t>(data, count, out, prefix_, sequence, offset);
    case IndexedDType::i16:
      return widen_tokens<int16_t>(data, count, out, prefix_, sequence, offset);
    case IndexedDType::u16:
      return widen_tokens<uint16_t>(data, count, out, prefix_, sequence, offset);
    case IndexedDType::i32:
      return widen_tokens<int32_t>(data, count, out, prefix_, sequence, offset);
    case IndexedDType::i64:
      return widen_tokens<int64_t>(data, count, out, prefix_, sequence, offset);
    default:
      fail("indexed dataset '{}': tokens are {}, not integer token ids", indexed_bin_path(prefix_),
           indexed_dtype_name(dtype_));
  }
}

}  // namespace forge::data
