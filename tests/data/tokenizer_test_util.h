// Helpers shared by the tokenizer and BPE trainer tests: fixture paths, file reading, a temporary
// directory, and tokenizer.json documents built in code.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "test_files.h"

namespace forge::testing {

inline std::filesystem::path tokenizer_fixture(const std::string& name) {
  return std::filesystem::path(FORGE_FIXTURE_DIR) / "tokenizer" / name;
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(read_file(path));
}

// A fresh directory per test, removed at the end.
class TokenizerTempDir {
 public:
  TokenizerTempDir() {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("forge_tokenizer_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TokenizerTempDir() { std::filesystem::remove_all(path_); }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// The GPT-2 byte-level form of one byte.
inline std::string byte_level_char(unsigned char b) {
  auto stands_for_itself = [](int x) {
    return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
  };
  unsigned code = b;
  if (!stands_for_itself(b)) {
    code = 0x100;
    for (int x = 0; x < b; ++x)
      if (!stands_for_itself(x)) ++code;
  }
  std::string out;
  if (code < 0x80) {
    out.push_back(static_cast<char>(code));
  } else {
    out.push_back(static_cast<char>(0xC0 | (code >> 6)));
    out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
  }
  return out;
}

// A small byte-level BPE tokenizer.json (all 256 byte symbols, a few merges), to edit in error tests.
inline nlohmann::json small_tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level_char(static_cast<unsigned char>(b))] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", nlohmann::json::array({{{"id", 259},
                                               {"content", "<|endoftext|>"},
                                               {"single_word", false},
                                               {"lstrip", false},
                                               {"rstrip", false},
                                               {"normalized", false},
                                               {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", nlohmann::json::array({"h e", "l l", "he ll"})}}},
  };
}

}  // namespace forge::testing
