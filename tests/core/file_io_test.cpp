// Durable writes leave either the old file or the new one, never a temporary; strict JSON refuses keys given
// twice at any depth, naming them.
#include "forge/core/file_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"

namespace forge::file_io_test {
namespace {
namespace fs = std::filesystem;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(FileIo, WriteFileAtomicallyReplacesTheFileAndLeavesNoTemporary) {
  const fs::path dir = fs::temp_directory_path() / ("forge_file_io_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_file_atomically(dir / "a.txt", "first", "test file");
  write_file_atomically(dir / "a.txt", "second", "test file");
  EXPECT_EQ(read_file(dir / "a.txt", "test file"), "second");
  EXPECT_FALSE(fs::exists(dir / "a.txt.tmp"));
  // An unwritable place: one line naming the file, the old content untouched.
  const std::string e = error_of([&] { write_file_atomically(dir / "missing" / "b.txt", "x", "test file"); });
  EXPECT_NE(e.find("test file"), std::string::npos) << e;
  EXPECT_NE(e.find("missing/b.txt.tmp"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);
  fs::remove_all(dir);
}

// /dev/full fails every write with ENOSPC: the error says so and no temporary is left.
TEST(FileIo, WriteFileAtomicallyReportsAFullDisk) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const fs::path dir = fs::temp_directory_path() / ("forge_file_io_full_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink("/dev/full", dir / "f.txt.tmp");  // the temporary's writes go to the full device
  const std::string e =
      error_of([&] { write_file_atomically(dir / "f.txt", std::string(1 << 16, 'x'), "metrics"); });
  EXPECT_NE(e.find("No space left on device"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "f.txt"));
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir / "f.txt.tmp")));
  fs::remove_all(dir);
}

TEST(FileIo, ParseJsonStrictRefusesDuplicateKeysAtAnyDepth) {
  EXPECT_EQ(parse_json_strict(R"({"a": 1, "b": {"a": 2}, "c": [{"a": 1}, {"a": 2}]})", "x.json")["b"]["a"],
            2);
  EXPECT_EQ(error_of([] { parse_json_strict(R"({"a": 1, "a": 2})", "x.json"); }),
            "x.json: key 'a' appears twice");
  EXPECT_EQ(error_of([] { parse_json_strict(R"({"s": {"k": 1, "j": 2, "k": 3}})", "m.json"); }),
            "m.json: key 's.k' appears twice");
  EXPECT_EQ(error_of([] { parse_json_strict(R"({"t": [{"x": 1}, {"x": 2, "x": 3}]})", "m.json"); }),
            "m.json: key 't.x' appears twice");
  const std::string bad = error_of([] { parse_json_strict("{\"a\": ", "y.json"); });
  EXPECT_TRUE(bad.starts_with("y.json: invalid JSON")) << bad;
}

}  // namespace
}  // namespace forge::file_io_test
