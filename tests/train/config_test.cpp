#include "forge/train/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "op_harness.h"

namespace forge::config_test {
using namespace forge::optim;
using namespace forge::train;
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
  EXPECT_EQ(c.train.schedule.name(), "wsd");
  EXPECT_EQ(c.train.dtype.name(), "auto");
  EXPECT_EQ(c.train.recompute.name(), "none");
  EXPECT_EQ(c.eval.every, 500);
  EXPECT_EQ(c.log.run_dir, "runs/default");
  EXPECT_EQ(c.sample.prompt, "And God said");
  EXPECT_EQ(c.sample.top_k, 40);
  EXPECT_DOUBLE_EQ(c.moe.seq_aux_loss_coeff, 1e-4);
  EXPECT_EQ(c.moe.aux_loss_coeff, 0.0);   // off
  EXPECT_EQ(c.moe.capacity_factor, 0.0);  // dropless
  EXPECT_EQ(c.tokens_per_step(), 8 * 256);
  EXPECT_EQ(c.parallel.tp, 1);
  EXPECT_EQ(c.parallel.pp, 1);
  EXPECT_EQ(c.parallel.dp, 0);  // derived from the world size
  EXPECT_EQ(c.parallel.cp, 1);
  EXPECT_EQ(c.parallel.ep, 1);
  EXPECT_FALSE(c.parallel.sequence_parallel);
  EXPECT_FALSE(c.parallel.distributed_optimizer);
  EXPECT_TRUE(c.parallel.overlap_grad_reduce);
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 0.0);  // by device (parallel::default_bucket_bytes)
  EXPECT_EQ(c.parallel.make_vocab_size_divisible_by, 128);
  EXPECT_DOUBLE_EQ(c.parallel.timeout_s, 300.0);
  EXPECT_EQ(c.layout_spec(), (parallel::LayoutSpec{.tp = 1, .pp = 1, .dp = 0, .cp = 1, .ep = 1}));
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
  EXPECT_EQ(keys, 125);
}

TEST(TrainConfig, DefaultTomlFileIsTheGeneratedText) {
  // The file is its header comment followed by to_toml() of the defaults: same keys, order and comments.
  const std::string text = read_file(kRepoRoot / "configs/default.toml", "config");
  const std::string generated = TrainConfig{}.to_toml();
  ASSERT_GE(text.size(), generated.size());
  EXPECT_EQ(text.substr(text.size() - generated.size()), generated);
}

// What the logs say of recomputation.
TEST(TrainConfig, RecomputeSummaryNamesTheLayers) {
  TrainConfig c;
  EXPECT_EQ(c.recompute_summary(), "none");
  c.train.recompute = "full";
  EXPECT_EQ(c.recompute_summary(), "full");
  c.train.recompute_layers = 1;
  EXPECT_EQ(c.recompute_summary(), "full, first layer of each stage");
  c.train.recompute_layers = 4;
  EXPECT_EQ(c.recompute_summary(), "full, first 4 layers of each stage");
  c = TrainConfig::from_toml_string("[train]\nrecompute = \"selective\"\nrecompute_layers = 2\n", "a.toml");
  EXPECT_EQ(c.recompute_summary(), "selective, first 2 layers of each stage");
  c = TrainConfig::from_toml_string(
      "[train]\nrecompute = \"selective\"\nrecompute_modules = \"norm, mla_up_proj\"\n", "a.toml");
  EXPECT_EQ(c.recompute_summary(), "selective (norm,mla_up_proj)");
  EXPECT_EQ(c.recompute_modules(),
            nn::module_bit(nn::RecomputeModule::norm) | nn::module_bit(nn::RecomputeModule::mla_up_proj));
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
  c.parallel.tp = 2;
  c.parallel.pp = 4;
  c.parallel.dp = 3;
  c.parallel.cp = 2;
  c.parallel.ep = 6;
  c.parallel.sequence_parallel = true;
  c.parallel.distributed_optimizer = true;
  c.parallel.overlap_grad_reduce = false;
  c.parallel.bucket_mb = 0.25;
  c.parallel.make_vocab_size_divisible_by = 64;
  c.parallel.timeout_s = 12.5;
  c.moe.aux_loss_coeff = 0.001 + 0.002;  // all digits
  c.moe.capacity_factor = 1.25;
  c.moe.pad_to_capacity = true;
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
  EXPECT_EQ(c.train.schedule.name(), "wsd");
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
  c.apply_override("parallel.tp=2");
  EXPECT_EQ(c.parallel.tp, 2);
  c.apply_override("parallel.sequence_parallel=true");
  EXPECT_TRUE(c.parallel.sequence_parallel);
  c.apply_override("parallel.overlap_grad_reduce = false");
  EXPECT_FALSE(c.parallel.overlap_grad_reduce);
  c.apply_override("parallel.timeout_s=60");
  EXPECT_DOUBLE_EQ(c.parallel.timeout_s, 60.0);
}

TEST(TrainConfig, ParallelSection) {
  const TrainConfig c = TrainConfig::from_toml_string(
      "[parallel]\ntp = 2\npp = 2\ndp = 2\nep = 2\nsequence_parallel = true\ndistributed_optimizer = true\n"
      "overlap_grad_reduce = false\nbucket_mb = 25\nmake_vocab_size_divisible_by = 1\ntimeout_s = 0\n",
      "x.toml");
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.layout_spec(), (parallel::LayoutSpec{.tp = 2, .pp = 2, .dp = 2, .cp = 1, .ep = 2}));
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_TRUE(c.parallel.distributed_optimizer);
  EXPECT_FALSE(c.parallel.overlap_grad_reduce);
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 25.0);
  EXPECT_EQ(c.parallel.make_vocab_size_divisible_by, 1);
  EXPECT_DOUBLE_EQ(c.parallel.timeout_s, 0.0);  // wait forever
  EXPECT_NE(c, TrainConfig{});
  TrainConfig unchecked;  // layout_spec() narrows to int even without validate()
  unchecked.parallel.ep = int64_t{1} << 33;
  expect_error_containing([&] { unchecked.layout_spec(); }, {"parallel.ep is out of range: 8589934592"});
}

TEST(TrainConfig, Fp8Section) {
  EXPECT_FALSE(TrainConfig{}.fp8_options().has_value());  // off by default
  TrainConfig c = TrainConfig::from_toml_string(
      "[fp8]\nrecipe = \"delayed\"\nformat = \"e4m3\"\namax_history_len = 16\namax_compute = "
      "\"most_recent\"\n"
      "margin = 1\nbf16_first_layers = 1\nbf16_last_layers = 2\nsave_fp8_inputs = false\naccumulator_bits = "
      "14\n"
      "promote_every = 256\n",
      "x.toml");
  EXPECT_NO_THROW(c.validate());
  std::optional<nn::Fp8Options> o = c.fp8_options();
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->recipe.recipe, fp8::Recipe::delayed);
  EXPECT_EQ(o->recipe.format, fp8::Format::e4m3);
  EXPECT_EQ(o->recipe.amax_history_len, 16);
  EXPECT_EQ(o->recipe.amax_compute, fp8::AmaxCompute::most_recent);
  EXPECT_EQ(o->recipe.margin, 1);
  EXPECT_EQ(o->bf16_first_layers, 1);
  EXPECT_EQ(o->bf16_last_layers, 2);
  EXPECT_FALSE(o->save_fp8_inputs);
  EXPECT_EQ(o->accumulator_bits, 14);
  EXPECT_EQ(o->promote_every, 256);
  // format = auto: hybrid (E5M2 gradients) for the per-tensor recipes, E4M3 throughout for block
  // (DeepSeek-V3).
  c.fp8.format = "auto";
  EXPECT_EQ(c.fp8_options()->recipe.format, fp8::Format::hybrid);
  c.fp8.recipe = "block";
  c.fp8.promote_every = 128;
  EXPECT_EQ(c.fp8_options()->recipe.format, fp8::Format::e4m3);
  EXPECT_TRUE(c.fp8_options()->recipe.power_of_two_scales);
}

// The pipeline schedule and the activation dtype are refused when read, naming the key and what it takes;
// bf16 activations under fp32 GEMMs by validate(), naming both keys. The keyword-or-path settings answer
// their enums.
TEST(TrainConfigErrors, ScheduleActivationDtypeAndKeywords) {
  expect_override_error("parallel.schedule=gpipe",
                        {"parallel.schedule", "gpipe", "1f1b", "zb-h1", "dualpipev"});
  expect_override_error("train.activation_dtype=fp16", {"train.activation_dtype", "fp16", "auto", "bf16"});
  expect_invalid(
      [](TrainConfig& c) {
        c.train.dtype = "fp32";
        c.train.activation_dtype = "bf16";
      },
      {"train.activation_dtype = bf16 needs bf16 GEMMs", "train.dtype"});
  TrainConfig c;
  c.train.dtype = "bf16";
  EXPECT_EQ(c.activation_dtype(), DType::bf16);  // auto: the GEMM dtype
  c.train.activation_dtype = "fp32";
  EXPECT_EQ(c.activation_dtype(), DType::f32);
  c.train.dtype = "fp32", c.train.activation_dtype = "auto";
  EXPECT_EQ(c.gemm_dtype(), DType::f32);
  EXPECT_EQ(c.activation_dtype(), DType::f32);
  EXPECT_EQ(c.tokenizer_source(), TokenizerSource::train);
  c.data.tokenizer = "bytes";
  EXPECT_EQ(c.tokenizer_source(), TokenizerSource::bytes);
  c.data.tokenizer = "tok/tokenizer.json";
  EXPECT_EQ(c.tokenizer_source(), TokenizerSource::file);
  EXPECT_EQ(c.resume_mode(), ResumeMode::fresh);
  c.checkpoint.resume = "auto";
  EXPECT_EQ(c.resume_mode(), ResumeMode::automatic);
  c.checkpoint.resume = "runs/a/checkpoint";
  EXPECT_EQ(c.resume_mode(), ResumeMode::path);
}

// Context parallelism's attention mode and the memory cap: one line naming the key and what it takes.
TEST(TrainConfigErrors, ContextParallelAndMemoryLimit) {
  expect_override_error("parallel.cp_comm=allgather", {"parallel.cp_comm", "allgather", "p2p", "a2a"});
  expect_invalid([](TrainConfig& c) { c.train.memory_limit_mb = -1; },
                 {"train.memory_limit_mb must be >= 0 (0 = no limit), got -1"});
  expect_invalid(
      [](TrainConfig& c) {
        c.train.memory_limit_mb = 512;
        c.train.device = "cuda";
      },
      {"train.memory_limit_mb", "0 with train.device = cuda (a GPU's own memory is its limit)"});
}

TEST(TrainConfigErrors, Fp8Settings) {
  expect_override_error("fp8.recipe=mxfp8", {"fp8.recipe", "mxfp8", "delayed", "current", "block"});
  expect_override_error("fp8.format=e5m2", {"fp8.format", "e5m2", "hybrid"});
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "delayed", c.fp8.amax_history_len = 0; },
                 {"test.toml", "fp8.amax_history_len must be >= 1, got 0"});
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "current", c.fp8.margin = -1; }, {"fp8.margin", "-1"});
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "delayed", c.fp8.margin = 65; },
                 {"test.toml: fp8.margin must be in [0, 64], got 65"});
  // Too large for the int it becomes: refused before the conversion could wrap it into range.
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "delayed", c.fp8.margin = 4294967296; },
                 {"fp8.margin", "range of an int", "4294967296"});
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "current", c.fp8.bf16_last_layers = -2; },
                 {"fp8.bf16_last_layers must be >= 0, got -2"});
  expect_invalid([](TrainConfig& c) { c.train.hidden_dropout = 1; },
                 {"test.toml", "train.hidden_dropout must be in [0, 1), got 1"});
  expect_invalid([](TrainConfig& c) { c.data.heldout_parts = 0; },
                 {"data.heldout_parts must be in [1, 100000], got 0"});
  expect_invalid([](TrainConfig& c) { c.train.hidden_dropout = -0.1; },
                 {"train.hidden_dropout must be in [0, 1), got -0.1"});
  expect_invalid([](TrainConfig& c) { c.fp8.recipe = "current", c.fp8.accumulator_bits = 24; },
                 {"fp8.accumulator_bits", "24"});
  expect_invalid(
      [](TrainConfig& c) { c.fp8.recipe = "block", c.fp8.accumulator_bits = 14, c.fp8.promote_every = 256; },
      {"fp8.promote_every", "divisor", "256"});
  expect_invalid(
      [](TrainConfig& c) {
        c.fp8.recipe = "delayed", c.fp8.accumulator_bits = 14, c.fp8.promote_every = 100;
      },
      {"fp8.promote_every", "multiple of 32", "100"});
  // Settings of an unused recipe are not checked while FP8 is off.
  TrainConfig off;
  off.fp8.amax_history_len = 0;
  EXPECT_NO_THROW(off.validate());
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
  expect_override_error("parallel.sequence_parallel=yes",
                        {"'yes' is not a boolean (true or false)", "parallel.sequence_parallel"});
  expect_override_error("parallel.overlap_grad_reduce=1", {"'1' is not a boolean"});
  expect_override_error("parallel.distributed_optimizer=True", {"'True' is not a boolean"});
  expect_override_error("parallel.tp=two", {"'two' is not an integer", "parallel.tp"});
  expect_override_error("tp=2", {"unknown key 'tp'", "did you mean 'parallel.tp'?"});
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
  expect_parse_error("[train]\ndevice = \"tpu\"\n",
                     {"train.device must be one of 'cpu', 'cuda'", "got 'tpu'"});
  expect_parse_error("[model]\nseed = -3\n", {"model.seed must be >= 0"});
  expect_parse_error(
      "[parallel]\nsequence_parallel = 1\n",
      {"test.toml:2: parallel.sequence_parallel must be a boolean (true or false), got integer"});
  expect_parse_error("[parallel]\noverlap_grad_reduce = \"true\"\n",
                     {"parallel.overlap_grad_reduce must be a boolean", "got string"});
  expect_parse_error("[parallel]\ntp = 2.0\n", {"parallel.tp must be an integer, got float"});
  expect_parse_error("[parallel]\ntensor_parallel = 2\n", {"unknown key 'parallel.tensor_parallel'"});
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
  expect_invalid([](TrainConfig& c) { c.train.recompute_layers = -1; },
                 {"train.recompute_layers must be >= 0 (0 = every layer), got -1"});
  expect_invalid(
      [](TrainConfig& c) { c.train.recompute_layers = 2; },
      {"train.recompute_layers = 2 limits recomputation to some layers, but train.recompute is none"});
  expect_invalid(
      [](TrainConfig& c) { c.train.recompute = "selective", c.train.recompute_modules = "norm,attn"; },
      {"train.recompute_modules = \"norm,attn\": unknown recompute module 'attn' (expected core_attn"});
  expect_invalid([](TrainConfig& c) { c.train.recompute = "full", c.train.recompute_modules = "norm"; },
                 {"train.recompute_modules = \"norm\" chooses what selective recompute drops, but "
                  "train.recompute is full"});
  expect_invalid([](TrainConfig& c) { c.train.optimizer_offload = true; },
                 {"train.optimizer_offload = true moves a GPU's optimizer state to the host, but "
                  "train.device = cpu keeps it there already"});
  expect_invalid(
      [](TrainConfig& c) {
        c.train.optimizer_offload = true, c.train.device = "cuda", c.train.dtype = "fp32";
      },
      {"train.optimizer_offload = true needs bf16 weights on the device (train.dtype = bf16), not fp32"});
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
  // A choice is an enum once parsed: a bad name is refused where it is assigned, not left for validate().
  expect_error_containing([] { TrainConfig().train.recompute = "some"; },
                          {"'some' is not one of 'none', 'selective', 'full'"});
  expect_parse_error("[train]\nrecompute = \"some\"\n", {"test.toml:2", "train.recompute must be one of"});
  expect_invalid([](TrainConfig& c) { c.eval.batches = 0; }, {"eval.batches"});
  expect_invalid([](TrainConfig& c) { c.log.every = 0; }, {"log.every"});
  expect_invalid([](TrainConfig& c) { c.log.profile_step = -1; },
                 {"log.profile_step must be >= 0 (0 = off), got -1"});
  expect_invalid([](TrainConfig& c) { c.sample.temperature = -0.5; }, {"sample.temperature"});
  expect_invalid([](TrainConfig& c) { c.model.config.clear(); }, {"model.config"});
  expect_invalid([](TrainConfig& c) { c.parallel.tp = 0; }, {"test.toml: parallel.tp must be >= 1, got 0"});
  expect_invalid([](TrainConfig& c) { c.parallel.pp = -2; }, {"parallel.pp must be >= 1, got -2"});
  expect_invalid([](TrainConfig& c) { c.parallel.cp = 0; }, {"parallel.cp must be >= 1, got 0"});
  expect_invalid([](TrainConfig& c) { c.parallel.ep = 0; }, {"parallel.ep must be >= 1, got 0"});
  expect_invalid([](TrainConfig& c) { c.parallel.dp = -1; },
                 {"parallel.dp must be >= 1 (or 0 = derived from the world size), got -1"});
  expect_invalid([](TrainConfig& c) { c.parallel.tp = int64_t{1} << 40; },
                 {"parallel.tp must be at most 2147483647"});
  expect_invalid([](TrainConfig& c) { c.parallel.dp = int64_t{1} << 31; }, {"parallel.dp must be at most"});
  expect_invalid([](TrainConfig& c) { c.parallel.bucket_mb = -1; },
                 {"parallel.bucket_mb must be >= 0 (0 = by device), got -1"});
  expect_invalid([](TrainConfig& c) { c.parallel.bucket_mb = std::nan(""); }, {"parallel.bucket_mb"});
  expect_invalid([](TrainConfig& c) { c.parallel.make_vocab_size_divisible_by = 0; },
                 {"parallel.make_vocab_size_divisible_by must be >= 1, got 0"});
  expect_invalid([](TrainConfig& c) { c.parallel.timeout_s = -5; }, {"parallel.timeout_s must be >= 0"});
  expect_invalid([](TrainConfig& c) { c.moe.aux_loss_coeff = -1e-3; }, {"moe.aux_loss_coeff must be >= 0"});
  expect_invalid([](TrainConfig& c) { c.moe.aux_loss_coeff = std::nan(""); }, {"moe.aux_loss_coeff"});
  expect_invalid([](TrainConfig& c) { c.moe.capacity_factor = -0.5; },
                 {"moe.capacity_factor must be >= 0 (0 = dropless), got -0.5"});
  expect_invalid([](TrainConfig& c) { c.moe.capacity_factor = HUGE_VAL; }, {"moe.capacity_factor"});
  expect_invalid([](TrainConfig& c) { c.moe.pad_to_capacity = true; },
                 {"moe.pad_to_capacity", "moe.capacity_factor = 0"});
}

// validate() blames the origin of the value at fault: the file and line, or the --set that set it.
TEST(TrainConfigErrors, ValidationNamesWhereTheValueCameFrom) {
  auto validate_error = [](const TrainConfig& c) {
    try {
      c.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  TrainConfig c = TrainConfig::from_toml_string("[train]\nsteps = 5\nlr = -1\n", "a.toml");
  EXPECT_EQ(validate_error(c), "a.toml:3: train.lr must be > 0, got -1");
  EXPECT_EQ(c.origin_of("train.lr"), "a.toml:3");
  EXPECT_EQ(c.origin_of("train.min_lr"), "a.toml");  // a default

  // The case: a bad --set over a good file is the --set's fault, not the file's.
  c = TrainConfig::from_toml_string("[train]\nsteps = 5\nlr = 0.001\n", "configs/default.toml");
  c.apply_override("train.lr=-1");
  EXPECT_EQ(validate_error(c), "--set 'train.lr=-1': train.lr must be > 0, got -1");
  EXPECT_EQ(validate_error(c).find("configs/default.toml"), std::string::npos);

  // A rule over two keys names both origins.
  c = TrainConfig::from_toml_string("[train]\nsteps = 5\nmin_lr = 0.01\n", "a.toml");
  c.apply_override("train.lr=0.001");
  EXPECT_EQ(
      validate_error(c),
      "a.toml:3: train.min_lr (0.01) must not exceed train.lr (0.001) (train.lr: --set 'train.lr=0.001')");
  c = TrainConfig::from_toml_string("[train]\nsteps = 5\n", "a.toml");
  c.apply_override("train.lr=0.0001");  // below the default min_lr
  EXPECT_EQ(
      validate_error(c),
      "--set 'train.lr=0.0001': train.min_lr (0.0003) must not exceed train.lr (0.0001) (train.min_lr: its "
      "default)");
  c = TrainConfig::from_toml_string("[train]\nmax_minutes = 0\n", "a.toml");
  EXPECT_EQ(validate_error(c).rfind("a.toml:2: train.steps must be > 0", 0), 0u) << validate_error(c);
  EXPECT_NE(validate_error(c).find("train.steps: its default"), std::string::npos) << validate_error(c);

  // FP8 rules: the key the message names, and the recipe that turned its check on.
  c = TrainConfig::from_toml_string("[fp8]\nrecipe = \"delayed\"\nmargin = 65\n", "a.toml");
  EXPECT_EQ(validate_error(c), "a.toml:3: fp8.margin must be in [0, 64], got 65 (fp8.recipe: a.toml:2)");
  c = TrainConfig::from_toml_string("[fp8]\nmargin = 65\n", "a.toml");
  c.apply_override("fp8.recipe=current");
  EXPECT_EQ(validate_error(c),
            "a.toml:2: fp8.margin must be in [0, 64], got 65 (fp8.recipe: --set 'fp8.recipe=current')");

  // Where a value came from is not a setting.
  TrainConfig from_file = TrainConfig::from_toml_string("[train]\nsteps = 5\n", "a.toml");
  TrainConfig from_set;
  from_set.apply_override("train.steps=5");
  EXPECT_NE(from_file.origins, from_set.origins);
  EXPECT_EQ(from_file, from_set);
}

// train.threads = 100000 crashed libgomp; anything above 4096 is refused up front.
TEST(TrainConfigErrors, ThreadsAreBounded) {
  TrainConfig c;
  c.train.threads = 4096;
  EXPECT_NO_THROW(c.validate());
  c.apply_override("train.threads=100000");
  expect_error_containing([&] { c.validate(); },
                          {"--set 'train.threads=100000': train.threads must be in [0, 4096]", "got 100000"});
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
}  // namespace forge::config_test
