// Megatron indexed datasets: a token file `<prefix>.bin` and an index `<prefix>.idx`, byte-compatible with
// Megatron-LM's IndexedDataset / IndexedDatasetBuilder (format "MMIDIDX", version 1).
//
// `.idx`, little-endian: 9 bytes magic "MMIDIDX\0\0" | u64 version (1) | u8 token dtype code | u64 sequence
// count S | u64 document-index count D | int32 lengths[S] | int64 byte offsets[S] into `.bin` (running sum
// of length * itemsize from 0) | int64 document indices[D] (sequence index where each document starts,
// beginning with 0 and ending with S, so the file holds D - 1 documents). `.bin` holds the token arrays of
// the sequences back to back. A document is one or more consecutive sequences; GPT-style data has one
// sequence per document.
//
// IndexedDatasetWriter writes both files under temporary names and renames them into place, `.bin` first
// and `.idx` last (after removing an older `.idx`), so an interrupted write never leaves a pair that looks
// complete. IndexedDataset maps both files and validates the whole index before anything is read; any
// inconsistency is one forge::Error line naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace forge::data {

// Megatron's dtype codes.
enum class IndexedDType : uint8_t { u8 = 1, i8 = 2, i16 = 3, i32 = 4, i64 = 5, f64 = 6, f32 = 7, u16 = 8 };

bool indexed_dtype_known(uint8_t code);
int64_t indexed_dtype_size(IndexedDType dtype);
std::string_view indexed_dtype_name(IndexedDType dtype);  // "uint16", "int32", ...
bool indexed_dtype_is_integer(IndexedDType dtype);
// Megatron's choice for token files: uint16 when vocab_size < 65500, else int32.
IndexedDType indexed_dtype_for_vocab(int64_t vocab_size);

std::string indexed_bin_path(const std::string& prefix);  // prefix + ".bin"
std::string indexed_idx_path(const std::string& prefix);  // prefix + ".idx"

class IndexedDatasetWriter {
 public:
  // Creates `<prefix>.bin.tmp`; nothing appears under the final names until finalize(). Integer dtypes
  // only. Throws forge::Error naming the file when it cannot be created.
  IndexedDatasetWriter(std::string prefix, IndexedDType dtype);
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  // Without finalize() (an error, an interrupted run) the temporary files are removed.
  ~IndexedDatasetWriter();

  // One sequence; every token must fit the dtype (an error names the token and its value otherwise).
  void add_item(std::span<const int32_t> tokens);
  // Closes the current document at the sequences added so far (Megatron's end_document).
  void end_document();
  // add_item + end_document: a GPT document of one sequence.
  void add_document(std::span<const int32_t> tokens);
  // Appends every sequence and document of an existing dataset of the same dtype (Megatron's add_index).
  // Call between documents; the appended documents keep their boundaries.
  void add_index(const std::string& other_prefix);
  // Writes the index and renames both files into place. The writer cannot be used afterwards.
  void finalize();

  const std::string& prefix() const { return prefix_; }
  IndexedDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return tokens_; }

 private:
  void write_bin(const void* data, size_t bytes);
  void discard();

  std::string prefix_;
  IndexedDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> document_indices_{0};
  std::vector<unsigned char> convert_buffer_;
  int64_t tokens_ = 0;
  bool finalized_ = false;
};

class IndexedDataset {
 public:
  // Maps `<prefix>.idx` and `<prefix>.bin` and validates them: magic, version 1, a known dtype code,
  // counts that match the .idx size, non-negative lengths, offsets equal to the running sum of
  // length * itemsize, document indices non-decreasing from 0 to S, and a .bin of exactly the size the
  // index describes. Throws forge::Error naming the offending file.
  explicit IndexedDataset(const std::string& prefix);
  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  IndexedDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_document_indices_ - 1; }
  int64_t total_tokens() const { return total_tokens_; }

  int64_t sequence_length(int64_t sequence) const;
  int64_t sequence_offset(int64_t sequence) const;  // byte offset in .bin
  int64_t document_index(int64_t i) const;          // i in [0, num_documents()]: first sequence of document i
  // Sequences [first, last) of document `document`.
  std::pair<int64_t, int64_t> document_sequences(int64_t document) const;

  // The tokens of one sequence in the stored type; T must match dtype() (an error otherwise).
  template <typename T>
  std::span<const T> get(int64_t sequence) const {
    check_type(sizeof(T), std::is_signed_v<T>, std::is_floating_point_v<T>);
    const auto bytes = sequence_bytes(sequence);
    return {reinterpret_cast<const T*>(bytes.data()), bytes.size() / sizeof(T)};
  }
  std::span<const std::byte> sequence_bytes(int64_t sequence) const;

  // Tokens [offset, offset + count) of `sequence` converted to int32 (integer dtypes only). A negative
  // token or one above INT32_MAX is an error naming the file, sequence and position.
  void read_tokens(int64_t sequence, int64_t offset, int64_t count, int32_t* out) const;

 private:
  void check_sequence(int64_t sequence) const;
  void check_type(size_t size, bool is_signed, bool is_float) const;
  void release();

  std::string prefix_;
  IndexedDType dtype_ = IndexedDType::u16;
  int64_t num_sequences_ = 0, num_document_indices_ = 0, total_tokens_ = 0;
  const unsigned char* idx_ = nullptr;  // mapped .idx (nullptr when empty)
  size_t idx_size_ = 0;
  const unsigned char* bin_ = nullptr;  // mapped .bin (nullptr when empty)
  size_t bin_size_ = 0;
  // Byte positions of the three arrays inside .idx (they are not naturally aligned: lengths start at 34).
  size_t lengths_at_ = 0, offsets_at_ = 0, documents_at_ = 0;
};

}  // namespace forge::data
