// AsyncCheckpointSave: a background save writes exactly the state it was given, whether it copied it first
// (Source::copy) or read the live memory until detach() (Source::live), however far the writer had got when
// the memory changed; a failed write is thrown by finish() and leaves no checkpoint; the commit happens only
// in finish().
#include "forge/ckpt/async_save.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/fault_injection.h"

namespace forge::ckpt::async_save_test {
namespace {
namespace fs = std::filesystem;

class AsyncSave : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("forge_async_save_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    self_ = comm::make_self();
    // Three tensors of 8M, 1 and 4M floats (48 MB): large enough that the writer is mid-way for a while.
    for (int64_t n : {int64_t{8} << 20, int64_t{1}, int64_t{4} << 20}) {
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i % 1000) * 0.5f + 1;
      data_.push_back(std::move(v));
    }
    want_ = data_;
  }
  void TearDown() override { fs::remove_all(root_); }

  std::vector<ShardPiece> pieces(std::vector<std::vector<float>>& data) const {
    std::vector<ShardPiece> out;
    const char* names[] = {"a", "b", "c"};
    for (size_t t = 0; t < data.size(); ++t) {
      const int64_t n = static_cast<int64_t>(data[t].size());
      out.push_back({names[t], {n}, {n}, -1, 0, 0, n, data[t].data()});
    }
    return out;
  }
  // What the checkpoint of `step` under root_ holds.
  std::vector<std::vector<float>> load(int64_t step) {
    std::vector<std::vector<float>> got;
    for (const std::vector<float>& v : want_) got.emplace_back(v.size(), -1.0f);
    const std::vector<ShardPiece> destinations = pieces(got);
    load_sharded_checkpoint((root_ / checkpoint_step_name(step)).string(), *self_, destinations);
    return got;
  }
  void scribble() {  // the training step changes the memory
    for (std::vector<float>& v : data_)
      for (float& x : v) x = -7.0f;
  }

  fs::path root_;
  std::unique_ptr<comm::Communicator> self_;
  std::vector<std::vector<float>> data_, want_;
};

TEST_F(AsyncSave, CopiedStateIsWrittenWhateverTheMemoryDoesNext) {
  CheckpointState state;
  state.step = 3;
  std::vector<float> buffer;
  AsyncCheckpointSave save(root_.string(), *self_, pieces(data_), state, {}, &buffer);
  scribble();
  EXPECT_FALSE(fs::exists(root_ / checkpoint_step_name(3))) << "committed before finish()";
  EXPECT_EQ(save.finish(), (root_ / checkpoint_step_name(3)).string());
  EXPECT_EQ(load(3), want_);
  EXPECT_GE(buffer.size(), (size_t{12} << 20) + 1);  // the copy lives in the lent buffer
}

// Live: detach() at various moments of the write (at once, after a little, after it is done), then the memory
// changes; the checkpoint always holds the state as it was at the save.
TEST_F(AsyncSave, LiveStateDetachedAtAnyMomentIsWrittenAsItWasAtTheSave) {
  std::vector<float> buffer;
  int64_t step = 0;
  for (int delay_us : {0, 200, 2000, 20000, -1}) {
    data_ = want_;
    CheckpointState state;
    state.step = ++step;
    AsyncCheckpointSave save(root_.string(), *self_, pieces(data_), state, {}, &buffer,
                             AsyncCheckpointSave::Source::live);
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    if (delay_us < 0)
      while (!save.written()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    save.detach();
    scribble();
    save.detach();  // a second detach is a no-op
    save.finish();
    EXPECT_EQ(load(step), want_) << "detached after " << delay_us << " us";
  }
}

// A write that fails (a full disk) is thrown by finish(), and the previous checkpoint stays the newest.
TEST_F(AsyncSave, FailedWriteIsThrownByFinishAndCommitsNothing) {
  CheckpointState state;
  state.step = 1;
  AsyncCheckpointSave(root_.string(), *self_, pieces(data_), state, {}).finish();
  state.step = 2;
  arm_fail_point("save.write_shard", "No space left on device (test)");
  AsyncCheckpointSave save(root_.string(), *self_, pieces(data_), state, {}, nullptr,
                           AsyncCheckpointSave::Source::live);
  try {
    save.finish();
    ADD_FAILURE() << "finish() did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device (test)"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(root_ / checkpoint_step_name(2)));
  EXPECT_EQ(resolve_checkpoint(root_.string()).dir, (root_ / checkpoint_step_name(1)).string());
  for (const auto& entry : fs::directory_iterator(root_))
    EXPECT_FALSE(entry.path().filename().string().ends_with(".partial")) << entry.path();
}

}  // namespace
}  // namespace forge::ckpt::async_save_test
