#include "forge/data/text/text_corpus.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "op_harness.h"

namespace forge::text_corpus_test {
using namespace forge::data;
namespace {

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("forge_text_corpus_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

using testing::expect_error_containing;

bool bible_installed() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::filesystem::path candidate = std::filesystem::path(dirs.substr(start, end - start)) / "bible";
    if (::access(candidate.c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

TEST(TextCorpus, StripsVerseLabels) {
  const std::string raw =
      "Ge1:1 In the beginning God created the heaven and the earth.\n"
      "Ge1:2 And the earth was without form, and void.\n"
      "1Chr1:1 Adam, Sheth, Enosh,\n"
      "SSol2:3 As the apple tree among the trees of the wood, so is my beloved.\n"
      "Psa119:176 I have gone astray like a lost sheep.\n";
  EXPECT_EQ(strip_verse_labels(raw),
            "In the beginning God created the heaven and the earth.\n"
            "And the earth was without form, and void.\n"
            "Adam, Sheth, Enosh,\n"
            "As the apple tree among the trees of the wood, so is my beloved.\n"
            "I have gone astray like a lost sheep.\n");
}

TEST(TextCorpus, LabelStrippingIsRobustToLayout) {
  // CRLF, trailing spaces, a banner before the first verse, blank lines, a wrapped continuation line,
  // and a missing final newline.
  const std::string raw =
      "King James Version\r\n\r\n"
      "Ge1:1   In the beginning God created  \r\n"
      "   the heaven and the earth.\r\n"
      "\n"
      "Rev22:21 Amen.";
  EXPECT_EQ(strip_verse_labels(raw), "In the beginning God created the heaven and the earth.\nAmen.\n");
  // "Ge1:" alone is not a label: text that merely starts like one is kept.
  EXPECT_EQ(strip_verse_labels("Ge1:1 x\nActs 2:3 not a label\n"), "x Acts 2:3 not a label\n");
}

TEST(TextCorpus, OutputWithoutLabelsIsAnError) {
  expect_error_containing([] { strip_verse_labels("bible: data file not found\n"); }, {"no verse labels"});
}

TEST(TextCorpus, LoadsAndCachesTheKingJamesBible) {
  if (!bible_installed()) GTEST_SKIP() << "bible-kjv is not installed (scripts/install-deps.sh)";
  TempDir cache;
  const std::string text = load_kjv_text(cache.path() / "nested");
  EXPECT_TRUE(text.starts_with("In the beginning God created the heaven and the earth.\n"))
      << text.substr(0, 80);
  EXPECT_TRUE(text.ends_with("The grace of our Lord Jesus Christ be with you all. Amen.\n"));
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 31102);  // verses in the KJV
  EXPECT_GT(text.size(), 4'000'000u);
  // No line keeps a label; sample every 97th line to keep the regex cheap.
  const std::regex label("^[0-9]?[A-Za-z]+[0-9]+:[0-9]+");
  size_t line_start = 0, line_number = 0, checked = 0;
  while (line_start < text.size()) {
    const size_t end = text.find('\n', line_start);
    if (line_number++ % 97 == 0) {
      const std::string line = text.substr(line_start, end - line_start);
      EXPECT_FALSE(line.empty());
      EXPECT_FALSE(std::regex_search(line, label)) << line;
      ++checked;
    }
    line_start = end + 1;
  }
  EXPECT_GT(checked, 300u);

  // The cache holds exactly the text, no temporary is left behind, and later calls read the cache.
  const std::filesystem::path cached = cache.path() / "nested" / "kjv.txt";
  ASSERT_TRUE(std::filesystem::exists(cached));
  EXPECT_EQ(std::filesystem::file_size(cached), text.size());
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(cache.path() / "nested"),
                          std::filesystem::directory_iterator()),
            1);
  std::ofstream(cached, std::ios::trunc) << "cached text\n";
  EXPECT_EQ(load_kjv_text(cache.path() / "nested"), "cached text\n");
  EXPECT_EQ(load_corpus("kjv", cache.path() / "nested"), "cached text\n");

  const TextSplit split = split_heldout(text, 0.01);
  EXPECT_EQ(split.train + split.heldout, text);
  EXPECT_LE(split.heldout.size(), text.size() / 100);
  EXPECT_GT(split.heldout.size(), text.size() / 100 - 300);  // within one verse of 1%
}

TEST(TextCorpus, MissingBibleProgramIsAClearError) {
  TempDir empty;
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", empty.path().c_str(), 1);
  try {
    load_kjv_text(empty.path() / "cache");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("install bible-kjv (scripts/install-deps.sh)"), std::string::npos)
        << e.what();
  }
  ::setenv("PATH", saved.c_str(), 1);
  EXPECT_FALSE(std::filesystem::exists(empty.path() / "cache" / "kjv.txt"));
}

// Filling the cache on a full disk (this process's temporary linked to /dev/full): one line with the reason
// and nothing left in the cache folder, which a full disk cannot spare; with space, the cache is written.
TEST(TextCorpus, CacheOnAFullDiskFailsAndLeavesNoTemporary) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  TempDir dir;
  const std::filesystem::path bin = dir.path() / "bin", cache = dir.path() / "cache";
  std::filesystem::create_directories(bin);
  std::filesystem::create_directories(cache);
  std::ofstream(bin / "bible") << "#!/bin/sh\nprintf 'Ge1:1 In the beginning.\\nGe1:2 And the earth.\\n'\n";
  std::filesystem::permissions(bin / "bible", std::filesystem::perms::owner_all);
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", (bin.string() + ":" + saved).c_str(), 1);
  const std::filesystem::path temporary = cache / fmt::format("kjv.txt.{}.tmp", ::getpid());
  std::filesystem::create_symlink("/dev/full", temporary);
  expect_error_containing([&] { load_kjv_text(cache); },
                          {"corpus cache", temporary.string(), "No space left on device"});
  EXPECT_TRUE(std::filesystem::is_empty(cache));
  const std::string text = load_kjv_text(cache);
  ::setenv("PATH", saved.c_str(), 1);
  EXPECT_EQ(text, "In the beginning.\nAnd the earth.\n");
  EXPECT_EQ(read_file(cache / "kjv.txt", "cache"), text);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(cache), std::filesystem::directory_iterator()),
            1);
}

TEST(TextCorpus, LoadTextFile) {
  TempDir dir;
  const auto path = dir.path() / "corpus.txt";
  std::ofstream(path) << "hello\nworld\n";
  EXPECT_EQ(load_text_file(path), "hello\nworld\n");
  EXPECT_EQ(load_corpus(path.string(), dir.path()), "hello\nworld\n");
  expect_error_containing([&] { load_text_file(dir.path() / "missing.txt"); },
                          {(dir.path() / "missing.txt").string(), "not found"});
  std::ofstream(dir.path() / "empty.txt");
  expect_error_containing([&] { load_text_file(dir.path() / "empty.txt"); }, {"empty.txt", "empty"});
  expect_error_containing([&] { load_text_file(dir.path()); }, {"directory"});
}

TEST(TextCorpus, SplitIsAtALineBoundary) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += fmt::format("line {} {}\n", i, std::string(i % 7, 'x'));
  for (double fraction : {0.01, 0.05, 0.1, 0.37, 0.5, 0.9}) {
    const TextSplit split = split_heldout(text, fraction);
    EXPECT_EQ(split.train + split.heldout, text) << fraction;
    EXPECT_FALSE(split.train.empty());
    EXPECT_FALSE(split.heldout.empty());
    EXPECT_EQ(split.train.back(), '\n') << fraction;
    EXPECT_TRUE(split.heldout.starts_with("line ")) << fraction;
    EXPECT_LE(split.heldout.size(), fraction * text.size()) << fraction;
    EXPECT_EQ(split_heldout(text, fraction).heldout, split.heldout);  // deterministic
  }
}

// Held out from several parts: each part of the text (cut at its first line start after an equal share)
// gives its own tail, so the held-out lines come from all over the text, in order, and every line lands on
// exactly one side.
TEST(TextCorpus, SplitInPartsHoldsOutEachPartsTail) {
  // 1000 lines of 10 bytes: each tenth of the bytes is 100 lines, and 2.5% of a tenth (25 bytes) starts
  // inside a line, so each part holds out its last two lines.
  std::string text;
  for (int i = 0; i < 1000; ++i) text += fmt::format("line {:04d}\n", i);
  const TextSplit split = split_heldout(text, 0.025, 10);
  EXPECT_EQ(split.train.size() + split.heldout.size(), text.size());
  EXPECT_EQ(split.heldout.size(), 10u * 2 * 10);
  // Which lines were held out: their numbers fall in ten runs, the end of each tenth.
  std::vector<int> held;
  std::istringstream lines(split.heldout);
  for (std::string line; std::getline(lines, line);) {
    ASSERT_TRUE(line.starts_with("line ")) << line;
    held.push_back(std::stoi(line.substr(5)));
  }
  for (int k = 0; k < 10; ++k) {
    ASSERT_EQ(held.size(), 20u);
    EXPECT_EQ(held[2 * k], 100 * (k + 1) - 2) << k;
    EXPECT_EQ(held[2 * k + 1], 100 * (k + 1) - 1) << k;
  }
  // Every line is on exactly one side: the train text is the other lines, in order.
  std::string rebuilt_train;
  for (int i = 0, h = 0; i < 1000; ++i) {
    if (h < static_cast<int>(held.size()) && held[h] == i) {
      ++h;
      continue;
    }
    rebuilt_train += fmt::format("line {:04d}\n", i);
  }
  EXPECT_EQ(split.train, rebuilt_train);
  // One part is the plain tail.
  EXPECT_EQ(split_heldout(text, 0.025, 1).heldout, split_heldout(text, 0.025).heldout);
  EXPECT_EQ(split_heldout(text, 0.025).heldout.size(), 250u);
  expect_error_containing([&] { split_heldout(text, 0.025, 0); }, {"parts must be >= 1, got 0"});
}

TEST(TextCorpus, SplitEdgeCases) {
  // The tail's first line start is the final line; a 1-byte held-out target falls back to the last line.
  EXPECT_EQ(split_heldout("aaaa\nbbbb\ncc\n", 0.1).heldout, "cc\n");
  // A single line is cut at the byte offset.
  EXPECT_EQ(split_heldout("abcdefghij", 0.3).heldout, "hij");
  EXPECT_EQ(split_heldout("one line only\n", 0.5).heldout, "e only\n");
  expect_error_containing([] { split_heldout("abc\n", 0.0); }, {"(0, 1)", "0"});
  expect_error_containing([] { split_heldout("abc\n", 1.0); }, {"(0, 1)"});
  expect_error_containing([] { split_heldout("abc\n", 0.01); }, {"empty"});
}

}  // namespace
}  // namespace forge::text_corpus_test
