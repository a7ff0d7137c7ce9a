// A checkpoint series as readers meet it (checkpoint_dir.h): the order steps are tried in, what is noted
// about a damaged `latest`, and a series with no usable step called corrupt or incomplete as it is.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"

namespace forge::ckpt::checkpoint_series_test {
namespace {
namespace fs = std::filesystem;

class CheckpointSeriesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("forge_series_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    self_ = comm::make_self();
    for (int64_t step : {2, 4}) save(step);
  }
  void TearDown() override { fs::remove_all(root_); }

  void save(int64_t step) {
    CheckpointState state;
    state.step = step;
    std::vector<float> weights(64, static_cast<float>(step));
    const ShardPiece piece{"w", {64}, {64}, -1, 0, 0, 64, weights.data()};
    save_checkpoint_step(root_.string(), *self_, {&piece, 1}, state);
  }
  fs::path step(int64_t s) const { return root_ / checkpoint_step_name(s); }
  std::string shard(int64_t s) const { return (step(s) / shard_file_name(0, 1)).string(); }
  void write(const fs::path& file, const std::string& text) const {
    std::ofstream(file, std::ios::binary) << text;
  }

  fs::path root_;
  std::unique_ptr<comm::Communicator> self_;
};

TEST_F(CheckpointSeriesTest, NewestFirstAndNothingNotedWhenIntact) {
  const CheckpointSeries series = checkpoint_series(root_.string());
  ASSERT_EQ(series.steps.size(), 2u);
  EXPECT_EQ(series.steps[0].step, 4);
  EXPECT_EQ(series.steps[1].step, 2);
  EXPECT_EQ(series.latest_note, "");
  const ResolvedCheckpoint r = resolve_checkpoint(root_.string());
  EXPECT_EQ(r.dir, step(4).string());
  EXPECT_EQ(r.step, 4);
  EXPECT_EQ(r.note, "");
  EXPECT_TRUE(r.passed_over.empty());
}

TEST_F(CheckpointSeriesTest, ADamagedLatestIsNotedAndTheNewestStepRead) {
  struct Case {
    std::string latest;  // "<none>": the file is deleted
    std::string note;
  };
  const std::vector<Case> cases = {
      {"<none>", "has no `latest` file"},
      {"", "latest is empty"},
      {"\xff\xfe step", "latest is not text (not valid UTF-8)"},
      {"checkpoint-4", "latest names \"checkpoint-4\", which is not a step folder name"},
      {"step-00000009", "latest names step-00000009, which does not exist"}};
  for (const Case& c : cases) {
    if (c.latest == "<none>")
      fs::remove(root_ / "latest");
    else
      write(root_ / "latest", c.latest + "\n");
    const ResolvedCheckpoint r = resolve_checkpoint(root_.string());
    EXPECT_EQ(r.dir, step(4).string()) << c.latest;
    EXPECT_NE(r.note.find(c.note), std::string::npos) << c.latest << ": " << r.note;
    EXPECT_NE(r.note.find(root_.string()), std::string::npos) << r.note;  // names the directory
  }
}

TEST_F(CheckpointSeriesTest, AnUnusableNewestStepIsPassedOverWithItsReason) {
  fs::remove(step(4) / "manifest.json");
  const ResolvedCheckpoint r = resolve_checkpoint(root_.string());
  EXPECT_EQ(r.dir, step(2).string());
  ASSERT_EQ(r.passed_over.size(), 1u);
  EXPECT_EQ(r.passed_over[0].name, "step-00000004");
  EXPECT_FALSE(r.passed_over[0].corrupt);
  EXPECT_NE(r.note.find("passed over step-00000004: it has no manifest.json"), std::string::npos) << r.note;
}

// With no usable step, the refusal says what the newest step's problem is: corrupt or incomplete.
TEST_F(CheckpointSeriesTest, NoUsableStepIsCalledCorruptOrIncompleteAsItIs) {
  for (int64_t s : {2, 4}) write(step(s) / "manifest.json", "{\"garbled");
  try {
    resolve_checkpoint(root_.string());
    FAIL() << "resolved a series whose manifests are garbled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(" is corrupt: "), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
  for (int64_t s : {2, 4}) fs::remove(step(s) / "manifest.json");
  try {
    resolve_checkpoint(root_.string());
    FAIL() << "resolved a series without manifests";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(" is incomplete: "), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointSeriesTest, ProblemsAreClassedAsDamageOrSomethingMissing) {
  fs::resize_file(shard(4), 100);
  const CheckpointSeries truncated = checkpoint_series(root_.string());
  EXPECT_TRUE(truncated.steps[0].corrupt) << truncated.steps[0].problem;
  fs::remove(shard(4));
  const CheckpointSeries missing = checkpoint_series(root_.string());
  EXPECT_FALSE(missing.steps[0].corrupt) << missing.steps[0].problem;
  EXPECT_NE(missing.steps[0].problem.find("is missing"), std::string::npos) << missing.steps[0].problem;
  EXPECT_EQ(missing.steps[1].problem, "");
}

}  // namespace
}  // namespace forge::ckpt::checkpoint_series_test
