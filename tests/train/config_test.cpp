#include "forge/train/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "forge/core/error.h"
#include "op_harness.h"

namespace forge {
namespace {

const std::filesystem::path kRepoRoot = std::filesystem::path(FORGE_FIXTURE_DIR).parent_path().parent_path();

using testing::expect_error_containing;

void expect_parse_error(std::string_view text, std::initializer_list<std::string_view> fragments) {
  expect_error_containing([&] { TrainConfig::from_toml_string(text, "test.toml"); }, fragments);
}

void expect_override_error(std::string_view assignment, std::initializer_list<std::string_view> fragments) {
  TrainConfig config;
  expect_error_containing([&] { config.apply_override(assignment); }, fragments);
  EXPECT_EQ(config, TrainConfig{}) << "a failed override must not change the config";
}

void expect_invalid(void (*mutate)(TrainConfig&), std::initializer_list<std::string_view> fragments) {
  TrainConfig config;
  config.source = "test.toml";
  mutate(config);
  expect_error_containing([&] { config.validate(); }, fragments);
}

TEST(TrainConfig, DefaultsMatchTheDocumentedValues) {
  const TrainConfig c;
  EXPECT_EQ(c.model.config, "configs/llama-default.json");
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.02);
  EXPECT_EQ(c.model.seed, 1234u);
  EXPECT_EQ(c.data.corpus, "kjv");
  EXPECT_DOUBLE_EQ(c.data.heldout_fraction, 0.01);
  EXPECT_EQ(c.data.seq_len, 256);
  EXPECT_EQ(c.train.micro_batch, 8);
  EXPECT_EQ(c.train.steps, 0);  // the default job trains for a time budget
  EXPECT_DOUBLE_EQ(c.train.max_minutes, 8.5);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-3);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 3e-4);
  EXPECT_EQ(c.train.schedule, "wsd");
  EXPECT_EQ(c.train.dtype, "auto");
  EXPECT_EQ(c.train.recompute, "none");
  EXPECT_EQ(c.eval.every, 500);
  EXPECT_EQ(c.log.run_dir, "runs/default");
  EXPECT_EQ(c.sample.prompt, "And God said");
  EXPECT_EQ(c.sample.top_k, 40);
  EXPECT_EQ(c.tokens_per_step(), 8 * 256);
  EXPECT_NO_THROW(c.validate());
}

TEST(TrainConfig, DefaultTomlFileEqualsBuiltInDefaults) {
  const std::filesystem::path path = kRepoRoot / "configs/default.toml";
  const TrainConfig c = TrainConfig::from_toml_file(path);
  EXPECT_EQ(c, TrainConfig{});
  EXPECT_EQ(c.source, path.string());
  EXPECT_NO_THROW(c.validate());
  // Every key in the file says what it is for.
  std::ifstream in(path);
  std::string line;
  int keys = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line[0] == '[') continue;
    ++keys;
    EXPECT_NE(line.find(" # "), std::string::npos) << "no comment: " << line;
  }
  EXPECT_EQ(keys, 43);
}

TEST(TrainConfig, PartialFileKeepsDefaults) {
  const TrainConfig c = TrainConfig::from_toml_string(
      "[train]\nsteps = 50\nlr = 1  # an integer is fine for a float key\n[sample]\nprompt = \"In the\"\n",
      "x.toml");
  EXPECT_EQ(c.train.steps, 50);
  EXPECT_DOUBLE_EQ(c.train.lr, 1.0);
  EXPECT_EQ(c.sample.prompt, "In the");
  EXPECT_EQ(c.train.micro_batch, 8);
  EXPECT_EQ(c.data.corpus, "kjv");
  // Dotted keys are the same TOML.
  EXPECT_EQ(TrainConfig::from_toml_string("train.steps = 50\n", "x.toml").train.steps, 50);
}

TEST(TrainConfig, TomlRoundTripPreservesEveryValue) {
  TrainConfig c;
  c.model.config = "models/tiny \"quoted\".json";
  c.model.seed = 9'000'000'000'000'000'000ull;
  c.data.corpus = "/tmp/my corpus.txt";
  c.data.heldout_fraction = 0.0123456789;
  c.train.lr = 1e-3;
  c.train.min_lr = 0.0;
  c.train.eps = 1e-12;
  c.train.max_minutes = 2.5;
  c.train.schedule = "wsd";
  c.train.dtype = "fp32";
  c.train.recompute = "selective";
  c.checkpoint.resume = "auto";
  c.sample.prompt = "line one\nline\ttwo \\ \"three\"";
  c.sample.temperature = 0.1 + 0.2;  // not exactly 0.3: the text must carry all digits
  const std::string text = c.to_toml();
  const TrainConfig back = TrainConfig::from_toml_string(text, "round trip");
  EXPECT_EQ(back, c) << text;
  EXPECT_EQ(back.sample.prompt, c.sample.prompt);
  EXPECT_EQ(back.sample.temperature, c.sample.temperature);
}

TEST(TrainConfig, Overrides) {
  TrainConfig c;
  c.apply_override("train.lr=1e-3");
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  c.apply_override(" train.steps = 20 ");
  EXPECT_EQ(c.train.steps, 20);
  c.apply_override("train.schedule=wsd");
  EXPECT_EQ(c.train.schedule, "wsd");
  c.apply_override("sample.prompt=\"In the beginning\"");
  EXPECT_EQ(c.sample.prompt, "In the beginning");
  c.apply_override("sample.prompt=a=b");
  EXPECT_EQ(c.sample.prompt, "a=b");
  c.apply_override("model.seed=5");
  EXPECT_EQ(c.model.seed, 5u);
  c.apply_override("train.max_minutes=3");
  EXPECT_DOUBLE_EQ(c.train.max_minutes, 3.0);
  c.apply_override("checkpoint.dir=");
  EXPECT_EQ(c.checkpoint.dir, "");
}

TEST(TrainConfigErrors, Overrides) {
  expect_override_error("train.lr", {"--set 'train.lr'", "expected section.key=value"});
  expect_override_error("train.lrr=1", {"unknown key 'train.lrr'", "did you mean 'train.lr'?"});
  expect_override_error("lr=1", {"unknown key 'lr'", "did you mean 'train.lr'?"});
  expect_override_error("train.steps=abc", {"'abc' is not an integer", "train.steps"});
  expect_override_error("train.steps=1.5", {"'1.5' is not an integer"});
  expect_override_error("train.lr=fast", {"'fast' is not a finite number", "train.lr"});
  expect_override_error("train.lr=nan", {"'nan'"});
  expect_override_error("train.lr=", {"is not a finite number"});
  expect_override_error("model.seed=-1", {"model.seed must be >= 0"});
  expect_override_error("train.schedule=linear",
                        {"train.schedule must be one of 'cosine', 'wsd', 'constant'", "got 'linear'"});
}

TEST(TrainConfigErrors, UnknownKeysAndSections) {
  expect_parse_error("[train]\nsteps = 5\nlrr = 1\n",
                     {"test.toml:3: unknown key 'train.lrr'", "did you mean 'lr'?"});
  expect_parse_error("[train]\nbatch_size = 1\n", {"unknown key 'train.batch_size'"});
  expect_parse_error("\n[trian]\nsteps = 5\n",
                     {"test.toml:2: unknown section [trian]", "did you mean 'train'?"});
  expect_parse_error("[optimizer]\n", {"unknown section [optimizer]"});
  expect_parse_error("lr = 1\n", {"test.toml:1: unknown key 'lr' outside any section", "under [train]"});
  expect_parse_error("[train.lr]\n", {"train.lr must be a number, got table"});
  expect_parse_error("train = 5\n", {"'train' must be a section"});
}

TEST(TrainConfigErrors, WrongTypesAndValues) {
  expect_parse_error("[train]\n\nsteps = 2.5\n", {"test.toml:3: train.steps must be an integer, got float"});
  expect_parse_error("[train]\nlr = \"fast\"\n", {"train.lr must be a number, got string"});
  expect_parse_error("[data]\ncorpus = 3\n", {"data.corpus must be a string, got integer"});
  expect_parse_error("[train]\nschedule = \"linear\"\n", {"test.toml:2", "train.schedule must be one of"});
  expect_parse_error("[train]\ndtype = \"fp16\"\n", {"train.dtype must be one of 'auto', 'bf16', 'fp32'"});
  expect_parse_error("[model]\nseed = -3\n", {"model.seed must be >= 0"});
}

TEST(TrainConfigErrors, InvalidTomlAndMissingFile) {
  expect_parse_error("[train\nsteps = 1\n", {"test.toml:1:", "invalid TOML"});
  expect_parse_error("[train]\nsteps = \n", {"test.toml:2:", "invalid TOML"});
  const auto missing = std::filesystem::temp_directory_path() / "forge_no_such_config.toml";
  expect_error_containing([&] { TrainConfig::from_toml_file(missing); }, {missing.string(), "cannot open"});
}

TEST(TrainConfigErrors, Validation) {
  expect_invalid([](TrainConfig& c) { c.train.min_lr = 0.01; },
                 {"test.toml: train.min_lr (0.01) must not exceed train.lr (0.003)"});
  expect_invalid([](TrainConfig& c) { c.train.lr = 0; }, {"train.lr must be > 0"});
  expect_invalid([](TrainConfig& c) { c.train.min_lr = -1e-4; }, {"train.min_lr must be >= 0"});
  expect_invalid([](TrainConfig& c) { c.data.heldout_fraction = 0; }, {"data.heldout_fraction", "(0, 1)"});
  expect_invalid([](TrainConfig& c) { c.data.heldout_fraction = 1; }, {"data.heldout_fraction"});
  expect_invalid([](TrainConfig& c) { c.data.seq_len = 0; }, {"data.seq_len must be > 0, got 0"});
  expect_invalid([](TrainConfig& c) { c.train.micro_batch = -2; }, {"train.micro_batch"});
  expect_invalid([](TrainConfig& c) { c.train.grad_accum = 0; }, {"train.grad_accum"});
  expect_invalid(
      [](TrainConfig& c) {
        c.train.steps = 0;
        c.train.max_minutes = 0;
      },
      {"train.steps"});
  expect_invalid([](TrainConfig& c) { c.train.steps = -1; }, {"train.steps"});
  expect_invalid([](TrainConfig& c) { c.train.max_minutes = -1; }, {"train.max_minutes"});
  expect_invalid([](TrainConfig& c) { c.train.warmup = -1; }, {"train.warmup"});
  expect_invalid([](TrainConfig& c) { c.train.wsd_decay_fraction = 1.5; }, {"train.wsd_decay_fraction"});
  expect_invalid([](TrainConfig& c) { c.train.beta2 = 1.0; }, {"train.beta2 must be in [0, 1)"});
  expect_invalid([](TrainConfig& c) { c.train.eps = 0; }, {"train.eps"});
  expect_invalid([](TrainConfig& c) { c.train.grad_clip = -1; }, {"train.grad_clip"});
  expect_invalid([](TrainConfig& c) { c.train.threads = -1; }, {"train.threads"});
  expect_invalid([](TrainConfig& c) { c.train.recompute = "some"; }, {"train.recompute must be one of"});
  expect_invalid([](TrainConfig& c) { c.eval.batches = 0; }, {"eval.batches"});
  expect_invalid([](TrainConfig& c) { c.log.every = 0; }, {"log.every"});
  expect_invalid([](TrainConfig& c) { c.sample.temperature = -0.5; }, {"sample.temperature"});
  expect_invalid([](TrainConfig& c) { c.model.config.clear(); }, {"model.config"});
}

TEST(TrainConfig, DerivedSettings) {
  TrainConfig c;
  EXPECT_EQ(c.checkpoint_dir(), std::filesystem::path("runs/default/checkpoint"));
  c.checkpoint.dir = "/ckpt";
  EXPECT_EQ(c.checkpoint_dir(), std::filesystem::path("/ckpt"));
  c.train.schedule = "wsd";
  c.train.steps = 100;
  c.train.warmup = 10;
  c.train.wsd_decay_fraction = 0.2;
  const LrSchedule s = c.lr_schedule();
  EXPECT_EQ(s.kind, LrSchedule::Kind::wsd);
  EXPECT_FLOAT_EQ(s.peak_lr, 3e-3f);
  EXPECT_FLOAT_EQ(s.min_lr, 3e-4f);
  EXPECT_EQ(s.warmup_steps, 10);
  EXPECT_EQ(s.total_steps, 100);
  EXPECT_DOUBLE_EQ(s.decay_fraction, 0.2);
}

}  // namespace
}  // namespace forge
