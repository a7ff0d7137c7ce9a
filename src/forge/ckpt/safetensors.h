// Hugging Face safetensors, read and written strictly. Layout: u64 little-endian header length N, N bytes
// of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the raw
// little-endian tensor bytes; offsets count from the end of the header.
//
// open() validates the whole header before any tensor is read: a malformed file is rejected with one
// forge::Error line naming the file and, where there is one, the tensor. Tensors are read on demand with
// pread, so opening a multi-gigabyte shard costs only its header.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/tensor.h"

namespace forge::ckpt {

// safetensors dtype strings ("F32", "BF16", "F16", "F8_E4M3", "F8_E5M2", "I32", "I64", "U8").
std::string_view safetensors_dtype_name(DType dtype);
// Throws forge::Error naming `name` when it is not one of the strings above.
DType safetensors_dtype_from_name(std::string_view name);

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;  // byte range in the data section (after the header)
  uint64_t end;
};

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // In data-section order (ascending begin offset).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A new tensor of the stored dtype and shape.
  Tensor read(std::string_view name) const;
  // A new fp32 tensor; F32, BF16, F16, F8_E4M3 and F8_E5M2 convert exactly, integer dtypes are refused.
  Tensor read_f32(std::string_view name) const;
  // Reads into an existing tensor (a view into a parameter buffer, say) of the same number of elements,
  // whose dtype is either the stored dtype (raw copy) or fp32 (converted as read_f32).
  void read_into(std::string_view name, const Tensor& destination) const;

 private:
  SafetensorsFile() = default;
  const SafetensorsEntry& require(std::string_view name) const;
  void read_bytes(const SafetensorsEntry& entry, void* destination) const;

  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` in the given order (CPU tensors, unique names) with `metadata` as "__metadata__".
// Atomic: the bytes go to `path`.tmp, which is fsynced and renamed over `path`, so a crash leaves either
// the old file or the complete new one, never a truncated file under the final name.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same from raw host memory (no staging copy), returning the CRC32 of the file's bytes, summed as they
// are written.
struct SafetensorsBlob {
  std::string name;
  DType dtype;
  Shape shape;
  const void* data;
  uint64_t bytes;
};
// `read`, when given, fetches the bytes instead of the blobs' data pointers (which may then be null):
// read(blob, offset, destination, bytes), called in order, blob after blob, a chunk of at most 8 MiB at a
// time (a background checkpoint save reads live memory through it under a lock).
using BlobReader = std::function<void(size_t blob, uint64_t offset, void* destination, size_t bytes)>;
uint32_t write_safetensors_blobs(const std::string& path, const std::vector<SafetensorsBlob>& blobs,
                                 const std::map<std::string, std::string>& metadata = {},
                                 const BlobReader& read = {});

}  // namespace forge::ckpt
