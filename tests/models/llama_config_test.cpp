#include "forge/models/llama/llama_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"

namespace forge::llama_config_test {
using namespace forge::models;
namespace {

using nlohmann::json;

const std::filesystem::path kRepoRoot = std::filesystem::path(FORGE_FIXTURE_DIR).parent_path().parent_path();

// A fresh file under the temp dir per test, removed at the end.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("forge_llama_config_{}_{}.json", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

json tiny_config() {
  return json{{"hidden_size", 64},        {"intermediate_size", 172}, {"num_hidden_layers", 2},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", 256}};
}

// Expects from_json to throw forge::Error whose one-line message contains every fragment.
void expect_error(const json& j, std::initializer_list<std::string_view> fragments) {
  try {
    LlamaConfig::from_json(j, "config.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_TRUE(message.starts_with("config.json: ")) << message;
    for (std::string_view fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << message;
  }
}

TEST(LlamaConfig, ReadsTheDefaultModelConfig) {
  const LlamaConfig c = LlamaConfig::from_json_file(kRepoRoot / "configs/llama-default.json");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 352);
  EXPECT_EQ(c.num_hidden_layers, 6);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::none);
  EXPECT_EQ(c.vocab_size, 2048);  // the BPE vocabulary the default job learns on the corpus
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 512);
}

TEST(LlamaConfig, DefaultsFollowHuggingFace) {
  const LlamaConfig c = LlamaConfig::from_json(json{{"hidden_size", 64},
                                                    {"intermediate_size", 172},
                                                    {"num_hidden_layers", 2},
                                                    {"num_attention_heads", 4},
                                                    {"vocab_size", 256}},
                                               "config.json");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 2048);
}

// Llama 3.2 1B's published config (as HF writes it, with the keys forge ignores) and parameter count.
TEST(LlamaConfig, Llama32OneBillionMatchesPublishedParameterCount) {
  const json j = json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");
  const LlamaConfig c = LlamaConfig::from_json(j, "config.json");
  EXPECT_EQ(c.num_parameters(), 1235814400);
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
}

TEST(LlamaConfig, Llama2SevenBillionParameterCount) {
  json j = {{"hidden_size", 4096},         {"intermediate_size", 11008}, {"num_hidden_layers", 32},
            {"num_attention_heads", 32},   {"vocab_size", 32000},        {"rope_scaling", nullptr},
            {"tie_word_embeddings", false}};
  EXPECT_EQ(LlamaConfig::from_json(j, "config.json").num_parameters(), 6738415616);
}

// The PyTorch twin's fixtures are written by transformers' LlamaConfig.save_pretrained (tests/reference/).
TEST(LlamaConfig, ReadsConfigsWrittenByTransformers) {
  const std::filesystem::path fixtures(FORGE_FIXTURE_DIR);
  const LlamaConfig plain = LlamaConfig::from_json_file(fixtures / "llama_tiny.config.json");
  EXPECT_EQ(plain.num_key_value_heads, 2);
  EXPECT_EQ(plain.rope_scaling.kind, RopeScaling::Kind::none);
  // Carries both "rope_type" and the legacy "type".
  const LlamaConfig llama3 = LlamaConfig::from_json_file(fixtures / "llama_tiny_tied_llama3.config.json");
  EXPECT_EQ(llama3.rope_scaling.kind, RopeScaling::Kind::llama3);
  EXPECT_EQ(llama3.rope_scaling.original_max_position_embeddings, 8);
  EXPECT_TRUE(llama3.tie_word_embeddings);
}

TEST(LlamaConfig, FlopsPerTokenFollowsMegatron) {
  const LlamaConfig c = LlamaConfig::from_json_file(kRepoRoot / "configs/llama-default.json");
  const double h = 128, q = 8 * 16, kv = 4 * 16, ffn = 352, layers = 6, vocab = 2048, seq = 256;
  const double per_layer = h * q + 2 * h * kv + q * h + 3 * h * ffn;
  const double expected = 6 * (layers * per_layer + vocab * h) + 12 * layers * seq * q;
  EXPECT_DOUBLE_EQ(c.flops_per_token(256), expected);
  // Tying the embedding removes parameters but not the lm_head matmul.
  LlamaConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_DOUBLE_EQ(tied.flops_per_token(256), expected);
  EXPECT_EQ(tied.num_parameters(), c.num_parameters() - 2048 * 128);
  // Hand count of the default model: embedding + lm_head, 6 layers with two norms each, final norm.
  EXPECT_EQ(c.num_parameters(), 2 * 2048 * 128 + 6 * (static_cast<int64_t>(per_layer) + 2 * 128) + 128);
}

TEST(LlamaConfig, JsonRoundTrip) {
  LlamaConfig c = LlamaConfig::from_json(tiny_config(), "config.json");
  c.rope_scaling.kind = RopeScaling::Kind::llama3;
  c.rope_scaling.factor = 8;
  c.tie_word_embeddings = true;
  c.rms_norm_eps = 1e-5;
  EXPECT_EQ(LlamaConfig::from_json(c.to_json(), "round trip"), c);
  EXPECT_EQ(c.to_json()["architectures"][0], "LlamaForCausalLM");
}

TEST(LlamaConfig, RopeScalingAcceptsLegacyTypeKeyAndDefault) {
  json j = tiny_config();
  j["rope_scaling"] = {{"type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  EXPECT_EQ(LlamaConfig::from_json(j, "config.json").rope_scaling.kind, RopeScaling::Kind::llama3);
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(LlamaConfig::from_json(j, "config.json").rope_scaling.kind, RopeScaling::Kind::none);
}

TEST(LlamaConfigErrors, UnknownKeyWithHint) {
  json j = tiny_config();
  j["hiden_size"] = 64;
  expect_error(j, {"unknown key 'hiden_size'", "did you mean 'hidden_size'?"});
  j = tiny_config();
  j["sliding_window"] = 4096;
  expect_error(j, {"unknown key 'sliding_window'"});
}

TEST(LlamaConfigErrors, MissingAndWrongTypedKeys) {
  json j = tiny_config();
  j.erase("vocab_size");
  expect_error(j, {"missing required key 'vocab_size'"});
  j = tiny_config();
  j["hidden_size"] = "64";
  expect_error(j, {"'hidden_size'", "must be an integer", "string"});
  j = tiny_config();
  j["num_hidden_layers"] = 2.5;
  expect_error(j, {"'num_hidden_layers'", "must be an integer"});
  j = tiny_config();
  j["rms_norm_eps"] = "1e-5";
  expect_error(j, {"'rms_norm_eps'", "must be a number"});
  j = tiny_config();
  j["tie_word_embeddings"] = 1;
  expect_error(j, {"'tie_word_embeddings'", "true or false"});
  expect_error(json::array({1, 2}), {"JSON object"});
}

TEST(LlamaConfigErrors, SizesAndDivisibility) {
  json j = tiny_config();
  j["intermediate_size"] = 0;
  expect_error(j, {"'intermediate_size' must be positive, got 0"});
  j = tiny_config();
  j["num_hidden_layers"] = -1;
  expect_error(j, {"'num_hidden_layers' must be positive"});
  j = tiny_config();
  j["num_key_value_heads"] = 3;
  expect_error(j, {"'num_attention_heads' (4) must be divisible by 'num_key_value_heads' (3)"});
  j = tiny_config();
  j["hidden_size"] = 66;
  expect_error(j, {"'hidden_size' (66)", "'num_attention_heads' (4)", "'head_dim' is absent"});
  j["head_dim"] = 16;  // an explicit head_dim lifts the divisibility requirement
  EXPECT_NO_THROW(LlamaConfig::from_json(j, "config.json"));
  j["head_dim"] = 15;
  expect_error(j, {"'head_dim' must be even", "15"});
  j = tiny_config();
  j["rms_norm_eps"] = 0;
  expect_error(j, {"'rms_norm_eps'"});
}

TEST(LlamaConfigErrors, UnsupportedFeatures) {
  json j = tiny_config();
  j["hidden_act"] = "gelu";
  expect_error(j, {"'hidden_act'", "gelu", "silu"});
  j = tiny_config();
  j["attention_bias"] = true;
  expect_error(j, {"'attention_bias'", "false"});
  j = tiny_config();
  j["attention_dropout"] = 0.1;
  expect_error(j, {"'attention_dropout'"});
  j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  expect_error(j, {"unsupported rope_scaling type 'yarn'"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 4.0}, {"low_freq_factor", 1.0}};
  expect_error(j, {"missing required key 'rope_scaling.high_freq_factor'"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factr", 4.0}};
  expect_error(j, {"unknown key 'rope_scaling.factr'", "did you mean 'factor'?"});
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  expect_error(j, {"'rope_scaling.high_freq_factor' (4)", "greater than"});
}

// Sizes beyond forge's bounds are refused naming the key and the memory they would need, before any product
// of them could wrap: 2^32 + 2 layers used to build a 2-layer model, 2^31 a 0-layer one.
TEST(LlamaConfigErrors, HugeSizesAreRefusedNamingTheKey) {
  json j = tiny_config();
  j["num_hidden_layers"] = (int64_t{1} << 32) + 2;
  expect_error(j, {"key 'num_hidden_layers' is 4294967298, above forge's limit of 65536",
                   "for its fp32 weights alone", "TiB"});
  j["num_hidden_layers"] = int64_t{1} << 31;
  expect_error(j, {"key 'num_hidden_layers' is 2147483648"});
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"hidden_size", int64_t{1} << 22},
                                   {"intermediate_size", int64_t{1} << 23},
                                   {"num_attention_heads", int64_t{1} << 17},
                                   {"num_key_value_heads", int64_t{1} << 17},
                                   {"head_dim", int64_t{1} << 17},
                                   {"vocab_size", int64_t{1} << 31},
                                   {"max_position_embeddings", int64_t{1} << 25}}) {
    j = tiny_config();
    j["head_dim"] = 16;  // so that hidden_size need not divide by the heads
    j[key] = value;
    expect_error(j, {fmt::format("key '{}' is {}, above forge's limit", key, value)});
  }
  j = tiny_config();
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", int64_t{1} << 40}};
  expect_error(j, {"key 'rope_scaling.original_max_position_embeddings' is 1099511627776"});

  // Every size within bounds, but their product is not: the count is formed without wrapping.
  j = {{"hidden_size", int64_t{1} << 20},         {"intermediate_size", int64_t{1} << 22},
       {"num_hidden_layers", int64_t{1} << 16},   {"num_attention_heads", int64_t{1} << 16},
       {"num_key_value_heads", int64_t{1} << 16}, {"head_dim", int64_t{1} << 16},
       {"vocab_size", int64_t{1} << 30}};
  expect_error(
      j, {"the model would have 1.18e+21 parameters", "num_hidden_layers 65536", "ZiB", "limit is 2^50"});
}

// The memory a model needs is stated, and a model bigger than the machine refused, before allocation.
TEST(LlamaConfig, MemoryBytesAndTheMachinesLimit) {
  const LlamaConfig tiny = LlamaConfig::from_json(tiny_config(), "tiny.json");
  EXPECT_EQ(tiny.origin.name, "tiny.json");
  const int64_t rope = 2 * tiny.max_position_embeddings * (tiny.head_dim / 2) * 4;
  EXPECT_EQ(tiny.memory_bytes(false, false), 4 * tiny.num_parameters() + rope);
  EXPECT_EQ(tiny.memory_bytes(true, true), 18 * tiny.num_parameters() + rope);
  EXPECT_NO_THROW(tiny.check_fits_in_memory(true, true, tiny.memory_bytes(true, true), "tiny.json"));

  // LLaMA 3 70B: 70.6e9 parameters, 16 bytes each to train in fp32 with AdamW.
  const LlamaConfig big = LlamaConfig::from_json({{"hidden_size", 8192},
                                                  {"intermediate_size", 28672},
                                                  {"num_hidden_layers", 80},
                                                  {"num_attention_heads", 64},
                                                  {"num_key_value_heads", 8},
                                                  {"vocab_size", 128256}},
                                                 "70b/config.json");
  try {
    big.check_fits_in_memory(true, false, int64_t{24} << 30, big.origin.name);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()),
        "70b/config.json: the model needs 1.0 TiB for its weights, gradients and optimizer state (7.06e+10 "
        "parameters: hidden_size 8192, intermediate_size 28672, num_hidden_layers 80, vocab_size 128256); "
        "this machine has 24.0 GiB");
  }
  try {
    big.check_fits_in_memory(false, false, int64_t{24} << 30, big.origin.name);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs 262.8 GiB for its weights ("), std::string::npos) << e.what();
  }
}

// A key given twice in config.json is refused (nlohmann alone keeps the last, silently).
TEST(LlamaConfigErrors, DuplicateKeysAreRefused) {
  TempFile twice(R"({"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "vocab_size": 256, "num_hidden_layers": 4096})");
  try {
    LlamaConfig::from_json_file(twice.path());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), twice.path().string() + ": key 'num_hidden_layers' appears twice");
  }
}

TEST(LlamaConfigErrors, FileErrorsNameThePath) {
  const std::filesystem::path missing = std::filesystem::temp_directory_path() / "forge_no_such_config.json";
  try {
    LlamaConfig::from_json_file(missing);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing.string()), std::string::npos) << e.what();
  }
  TempFile bad("{\n  \"hidden_size\": 64,\n  \"vocab_size\": ,\n}\n");
  try {
    LlamaConfig::from_json_file(bad.path());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(bad.path().string() + ": invalid JSON"), std::string::npos) << message;
    EXPECT_NE(message.find("line 3"), std::string::npos) << message;
    EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;
  }
  TempFile typo(R"({"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "vocab_size": 256, "hiden_size": 64})");
  try {
    LlamaConfig::from_json_file(typo.path());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(typo.path().string() + ": unknown key 'hiden_size'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace forge::llama_config_test
