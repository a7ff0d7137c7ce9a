// Helpers shared by the indexed / GPT / blended dataset tests: a per-test temporary directory, small
// datasets written with forge's writer, and file byte access.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "forge/data/text/indexed_dataset.h"

namespace forge::testing {
using namespace forge::data;

// A fresh directory per test, removed at the end.
class DatasetTempDir {
 public:
  explicit DatasetTempDir(const std::string& tag) {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("forge_{}_{}_{}", tag, ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~DatasetTempDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// GPT-style documents (one sequence each) written with forge's writer.
inline void write_documents(const std::string& prefix, const std::vector<std::vector<int32_t>>& documents,
                            IndexedDType dtype = IndexedDType::u16) {
  IndexedDatasetWriter writer(prefix, dtype);
  for (const auto& d : documents) writer.add_document(d);
  writer.finalize();
}

// Documents of the given lengths whose tokens are 1, 2, 3, ... in order, so every token of the corpus is
// distinct and names its position.
inline std::vector<std::vector<int32_t>> numbered_documents(const std::vector<int>& lengths,
                                                            int32_t first = 1) {
  std::vector<std::vector<int32_t>> documents;
  int32_t next = first;
  for (int length : lengths) {
    std::vector<int32_t> d(static_cast<size_t>(length));
    for (auto& t : d) t = next++;
    documents.push_back(std::move(d));
  }
  return documents;
}

}  // namespace forge::testing
