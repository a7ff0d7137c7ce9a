// The commands that read a model (generate, eval, convert), run as the real binary on a checkpoint series of
// two steps whose newest is damaged every way a disk or a person can damage it: each command refuses in one
// line naming the step, the damage and --allow-older-checkpoint, and with the flag reads step 2 and says what
// it passed over. An intact series names the step read; a damaged `latest` is noted, never fatal.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/sharded.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/models/llama/llama_config.h"
#include "forge/models/llama/llama_model.h"
#include "tools/cli_harness.h"

namespace forge::checkpoint_series_cli_test {
using namespace forge::models;
using namespace forge::ckpt;
namespace {
namespace fs = std::filesystem;
using testing::cli::Outcome;
using testing::cli::RunOptions;
using testing::cli::Stderr;

// How the newest step is damaged, and a phrase of the reason the commands give.
struct Damage {
  const char* name;
  const char* reason;
};
const Damage kDamages[] = {{"manifest_deleted", "it has no manifest.json"},
                           {"manifest_garbled", "invalid JSON"},
                           {"manifest_edited", "manifest.json does not match its checksum"},
                           {"shard_truncated", "manifest.json says"},
                           {"shard_deleted", "is missing"},
                           {"shard_flipped", "does not match its checksum in manifest.json"}};

class CheckpointSeriesCli : public testing::cli::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    const nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                                   {"model_type", "llama"},
                                   {"hidden_size", 32},
                                   {"intermediate_size", 64},
                                   {"num_hidden_layers", 2},
                                   {"num_attention_heads", 4},
                                   {"num_key_value_heads", 2},
                                   {"vocab_size", 256},
                                   {"max_position_embeddings", 64}};
    for (int64_t step : {2, 4}) {
      LlamaModel model(LlamaConfig::from_json(config, "series"), {DType::f32, nn::Recompute::none}, 0.5f);
      model.initialize(static_cast<uint64_t>(step));
      save_checkpoint((series() / checkpoint_step_name(step)).string(), model.params(), nullptr,
                      {step, config, {}});
    }
    std::ofstream(series() / "latest") << "step-00000004\n";
    data::IndexedDatasetWriter writer((dir_ / "eval").string(), data::IndexedDType::u16);
    writer.add_document(std::vector<int32_t>{72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100});
    writer.finalize();
  }
  fs::path series() const { return dir_ / "ck"; }
  fs::path newest() const { return series() / "step-00000004"; }
  std::string shard() const { return (newest() / shard_file_name(0, 1)).string(); }

  void damage(const std::string& how) const {
    if (how == "manifest_deleted") fs::remove(newest() / "manifest.json");
    if (how == "manifest_garbled") std::ofstream(newest() / "manifest.json") << "{\"format\": ";
    if (how == "manifest_edited") {
      std::ifstream in(newest() / "manifest.json");
      nlohmann::json manifest = nlohmann::json::parse(in);
      manifest["extra"] = {{"edited", true}};
      std::ofstream(newest() / "manifest.json") << manifest.dump();
    }
    if (how == "shard_truncated") fs::resize_file(shard(), fs::file_size(shard()) / 2);
    if (how == "shard_deleted") fs::remove(shard());
    if (how == "shard_flipped") {
      std::fstream f(shard(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(fs::file_size(shard()) - 100));
      const char byte = static_cast<char>(f.get() ^ 0x5a);
      f.seekp(static_cast<std::streamoff>(fs::file_size(shard()) - 100));
      f.put(byte);
    }
  }

  // Each command's arguments on the series (convert writes a fresh folder each time).
  std::vector<std::pair<std::string, std::string>> commands() {
    const std::string model = series().string();
    return {
        {"generate",
         "generate --model " + model + " --tokenizer bytes --prompt Hi --max-new-tokens 2 --greedy"},
        {"eval", "eval --model " + model + " --data " + (dir_ / "eval").string() + " --seq-len 4"},
        {"convert", "convert --input " + model + " --output " + path("out" + std::to_string(outputs_++))}};
  }
  Outcome run(const std::string& args) const {
    return testing::cli::run_forge(args, RunOptions{.stderr_to = Stderr::apart,
                                                    .input = "",
                                                    .environment = "OMP_NUM_THREADS=1",
                                                    .scratch_dir = dir_});
  }
  int outputs_ = 0;
};

TEST_F(CheckpointSeriesCli, EveryCommandNamesTheStepItReads) {
  for (const auto& [name, args] : commands()) {
    const Outcome o = run(args);
    ASSERT_EQ(o.status, 0) << name << ": " << o.output << o.err;
    EXPECT_NE(o.err.find("forge " + name + ": reading checkpoint " + series().string() +
                         " at step 4 (step-00000004)\n"),
              std::string::npos)
        << name << ": " << o.err;
    EXPECT_EQ(o.err.find("passed over"), std::string::npos) << name << ": " << o.err;
  }
}

TEST_F(CheckpointSeriesCli, EveryCommandRefusesADamagedNewestStepUnlessAllowed) {
  for (const Damage& d : kDamages) {
    ScratchDirTest::TearDown();
    SetUp();
    damage(d.name);
    for (const auto& [name, args] : commands()) {
      const std::string what = std::string(d.name) + ", " + name;
      testing::cli::expect_one_line_error(
          args, "step-00000004",
          {.stderr_to = Stderr::apart, .input = "", .environment = "OMP_NUM_THREADS=1", .scratch_dir = dir_});
      const Outcome refused = run(args);
      EXPECT_NE(refused.err.find(d.reason), std::string::npos) << what << ": " << refused.err;
      EXPECT_NE(refused.err.find("--allow-older-checkpoint"), std::string::npos)
          << what << ": " << refused.err;

      const Outcome allowed = run(args + " --allow-older-checkpoint");
      ASSERT_EQ(allowed.status, 0) << what << ": " << allowed.output << allowed.err;
      EXPECT_NE(allowed.err.find("at step 2 (step-00000002); passed over step-00000004: "), std::string::npos)
          << what << ": " << allowed.err;
      EXPECT_NE(allowed.err.find(d.reason), std::string::npos) << what << ": " << allowed.err;
    }
  }
}

TEST_F(CheckpointSeriesCli, ADamagedLatestIsNotedAndTheNewestStepRead) {
  const std::vector<std::pair<std::string, std::string>> latests = {
      {"\xff\xfe\n", "latest is not text (not valid UTF-8)"},
      {"", "latest is empty"},
      {"step-00000009\n", "latest names step-00000009, which does not exist"}};
  for (const auto& [text, note] : latests) {
    std::ofstream(series() / "latest", std::ios::binary | std::ios::trunc) << text;
    for (const auto& [name, args] : commands()) {
      const Outcome o = run(args);
      ASSERT_EQ(o.status, 0) << name << ": " << o.output << o.err;
      EXPECT_NE(o.err.find("at step 4 (step-00000004); "), std::string::npos) << name << ": " << o.err;
      EXPECT_NE(o.err.find(note), std::string::npos) << name << ": " << o.err;
    }
  }
  fs::remove(series() / "latest");
  const Outcome o = run(commands()[0].second);
  ASSERT_EQ(o.status, 0) << o.output << o.err;
  EXPECT_NE(o.err.find("has no `latest` file"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace forge::checkpoint_series_cli_test
