// forge convert, run as the real binary: Hugging Face <-> forge round trips on the committed bf16 fixture,
// companion files, --overwrite, and bad arguments answered with one "forge: error:" line and status 1.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "forge/ckpt/safetensors.h"
#include "forge/models/llama/llama_config.h"
#include "tools/cli_harness.h"
using namespace forge::models;
using namespace forge::ckpt;

namespace forge::convert_cli_test {
namespace {
namespace fs = std::filesystem;
using forge::testing::cli::expect_one_line_error;
using forge::testing::cli::Outcome;
using forge::testing::cli::run_forge;

const fs::path kFixture = fs::path(FORGE_FIXTURE_DIR) / "hf_llama_tiny_bf16";
const fs::path kTokenizer = fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "gpt2_style.tokenizer.json";

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The shard holding each tensor of a Hugging Face folder.
std::map<std::string, fs::path> tensor_files(const fs::path& folder) {
  std::map<std::string, fs::path> files;
  if (fs::exists(folder / "model.safetensors.index.json")) {
    // Kept in a local: a temporary's items() in the range-for would dangle (C++20 lifetime rules).
    const nlohmann::json index = read_json(folder / "model.safetensors.index.json");
    for (const auto& [tensor, file] : index["weight_map"].items())
      files[tensor] = folder / file.get<std::string>();
  } else {
    auto st = forge::ckpt::SafetensorsFile::open((folder / "model.safetensors").string());
    for (const auto& entry : st.entries()) files[entry.name] = folder / "model.safetensors";
  }
  return files;
}

// Overwrites element `index` of BF16 tensor `tensor` in safetensors file `file` with the raw bits `bits`.
void poke_bf16(const fs::path& file, const std::string& tensor, int64_t index, uint16_t bits) {
  const auto st = forge::ckpt::SafetensorsFile::open(file.string());
  const forge::ckpt::SafetensorsEntry* entry = st.find(tensor);
  ASSERT_NE(entry, nullptr) << tensor;
  ASSERT_EQ(entry->dtype, forge::DType::bf16);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  f.seekp(static_cast<std::streamoff>(8 + header + entry->begin + 2 * index));
  f.write(reinterpret_cast<const char*>(&bits), 2);
  ASSERT_TRUE(f.good());
}

class ConvertCli : public forge::testing::cli::ScratchDirTest {};

TEST_F(ConvertCli, HelpListsTheOptions) {
  Outcome o = run_forge("convert --help");
  EXPECT_EQ(o.status, 0);
  for (const char* option : {"--input", "--output", "--dtype", "--max-shard-size", "--overwrite", "--to"})
    EXPECT_NE(o.output.find(option), std::string::npos) << option;
}

// HF bf16 (3 shards) -> forge -> HF bf16: every tensor's bytes survive; companion files are copied.
TEST_F(ConvertCli, RoundTripThroughForgeKeepsBf16BytesAndCompanions) {
  fs::copy(kFixture, path("in"), fs::copy_options::recursive);
  fs::copy_file(kTokenizer, path("in") + "/tokenizer.json");
  std::ofstream(path("in") + "/generation_config.json") << R"({"bos_token_id": 1})";

  Outcome to_forge = run_forge("convert --input " + path("in") + " --output " + path("ckpt") + " --to forge");
  ASSERT_EQ(to_forge.status, 0) << to_forge.output;
  EXPECT_NE(to_forge.output.find("forge checkpoint"), std::string::npos) << to_forge.output;
  EXPECT_TRUE(fs::exists(path("ckpt") + "/manifest.json"));
  EXPECT_TRUE(fs::exists(path("ckpt") + "/tokenizer.json"));

  Outcome to_hf =
      run_forge("convert -i " + path("ckpt") + " -o " + path("out") + " --dtype bf16 --max-shard-size 6000");
  ASSERT_EQ(to_hf.status, 0) << to_hf.output;
  EXPECT_TRUE(fs::exists(path("out") + "/model.safetensors.index.json"));
  EXPECT_EQ(read_json(path("out") + "/config.json")["torch_dtype"], "bfloat16");
  EXPECT_EQ(read_json(path("out") + "/generation_config.json")["bos_token_id"], 1);
  EXPECT_TRUE(fs::exists(path("out") + "/tokenizer.json"));

  const auto original = tensor_files(kFixture), converted = tensor_files(path("out"));
  size_t compared = 0;
  for (const auto& [tensor, file] : original) {
    if (tensor.find("rotary_emb") != std::string::npos) {
      EXPECT_FALSE(converted.count(tensor)) << "computed buffers are not exported";
      continue;
    }
    ASSERT_TRUE(converted.count(tensor)) << tensor;
    auto a = forge::ckpt::SafetensorsFile::open(file.string()).read(tensor);
    auto b = forge::ckpt::SafetensorsFile::open(converted.at(tensor).string()).read(tensor);
    ASSERT_EQ(b.dtype(), forge::DType::bf16) << tensor;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.bytes()), 0) << tensor;
    ++compared;
  }
  EXPECT_EQ(compared, converted.size());
}

TEST_F(ConvertCli, OverwriteReplacesAModelFolder) {
  ASSERT_EQ(run_forge("convert --input " + kFixture.string() + " --output " + path("out")).status, 0);
  EXPECT_EQ(read_json(path("out") + "/config.json")["torch_dtype"], "float32");
  expect_one_line_error("convert --input " + kFixture.string() + " --output " + path("out"), path("out"));
  Outcome o = run_forge("convert --input " + kFixture.string() + " --output " + path("out") +
                        " --dtype fp16 --overwrite");
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_EQ(read_json(path("out") + "/config.json")["torch_dtype"], "float16");
}

TEST_F(ConvertCli, BadArgumentsGetOneLine) {
  const std::string in = " --input " + kFixture.string();
  const std::string out = " --output " + path("out");
  expect_one_line_error("convert" + out, "--input");
  expect_one_line_error("convert" + in, "--output");
  expect_one_line_error("convert" + in + out + " --dtype fp8",
                        "--dtype must be fp32, bf16 or fp16, got 'fp8'");
  // Only the listed names are accepted (float16 used to be taken without being listed).
  expect_one_line_error("convert" + in + out + " --dtype float16", "got 'float16'");
  expect_one_line_error("convert" + in + out + " --dtype int32", "int32");
  expect_one_line_error("convert" + in + out + " --max-shard-size 5XB", "5XB");
  expect_one_line_error("convert" + in + out + " --max-shard-size 0", "'0'");
  expect_one_line_error("convert" + in + out + " --to onnx", "onnx");
  expect_one_line_error("convert" + in + out + " --to forge --dtype bf16", "--dtype");
  expect_one_line_error("convert" + in + out + " --to forge --max-shard-size 1GB", "--max-shard-size");
  expect_one_line_error("convert --input " + path("missing") + out, path("missing"));
  // A config.json too big for the machine is refused before the model is built (2^48 parameters: 1 PiB).
  fs::create_directories(path("huge"));
  write("huge/config.json", R"({"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 4096,
      "num_attention_heads": 512, "vocab_size": 1048576})");
  write("huge/model.safetensors", "");
  expect_one_line_error("convert --input " + path("huge") + out, "huge/config.json: the model needs 1.0 PiB");
  fs::create_directories(path("empty_in"));
  expect_one_line_error("convert --input " + path("empty_in") + out, "empty_in");
  EXPECT_FALSE(fs::exists(path("out")));
}

// A NaN or infinity in the weights is refused while loading, naming the tensor, the file, the count and the
// first index; nothing is written.
TEST_F(ConvertCli, NonFiniteWeightsAreRefused) {
  fs::copy(kFixture, path("in"), fs::copy_options::recursive);
  const std::string tensor = "model.layers.1.mlp.up_proj.weight";
  const fs::path shard = tensor_files(path("in")).at(tensor);
  poke_bf16(shard, tensor, 37, 0x7fc0);  // NaN
  poke_bf16(shard, tensor, 90, 0xff80);  // -inf
  for (const char* to : {"hf", "forge"}) {
    SCOPED_TRACE(to);
    const Outcome o = run_forge("convert --input " + path("in") + " --output " + path("out") + " --to " + to);
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_EQ(
        o.output,
        "forge: error: " + shard.string() + ": tensor '" + tensor +
            "' holds 2 non-finite values (NaN or infinity) of 640, the first at index 37 (nan); refusing "
            "to load it\n");
    EXPECT_FALSE(fs::exists(path("out")));
  }
}

// A tokenizer.json that does not load is not copied along: one line naming it, no output.
TEST_F(ConvertCli, CorruptTokenizerIsRefused) {
  fs::copy(kFixture, path("in"), fs::copy_options::recursive);
  std::ofstream(path("in") + "/tokenizer.json")
      << R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [)";
  expect_one_line_error("convert --input " + path("in") + " --output " + path("out"),
                        path("in") + "/tokenizer.json");
  EXPECT_FALSE(fs::exists(path("out")));
  std::ofstream(path("in") + "/tokenizer.json", std::ios::trunc)
      << R"({"version": "1.0"})";  // valid JSON, no model
  expect_one_line_error("convert --input " + path("in") + " --output " + path("out") + " --to forge",
                        path("in") + "/tokenizer.json");
  EXPECT_FALSE(fs::exists(path("out")));
}

// --output naming the input (however spelled, through a link, or one folder inside the other) would replace
// the source with its own conversion, and a training checkpoint would lose its optimizer state: refused.
TEST_F(ConvertCli, OutputThatIsTheInputIsRefused) {
  ASSERT_EQ(
      run_forge("convert --input " + kFixture.string() + " --output " + path("ckpt") + " --to forge").status,
      0);
  const std::string manifest_before = forge::testing::cli::read_file(path("ckpt") + "/manifest.json");
  fs::create_directory_symlink(path("ckpt"), path("link"));
  fs::create_directories(path("parent"));
  ASSERT_EQ(
      run_forge("convert --input " + kFixture.string() + " --output " + path("parent") + "/model").status, 0);
  std::ofstream(path("parent") + "/config.json") << "{}";  // makes the parent look like a model too
  for (const auto& [input, output] :
       std::vector<std::pair<std::string, std::string>>{{path("ckpt"), path("ckpt")},
                                                        {path("ckpt"), path("ckpt") + "/"},
                                                        {path("ckpt"), dir_.string() + "/./x/../ckpt"},
                                                        {path("ckpt"), path("link")},
                                                        {path("ckpt"), path("ckpt") + "/hf"},
                                                        {path("parent") + "/model", path("parent")}}) {
    SCOPED_TRACE(input + " -> " + output);
    for (const char* to : {"forge", "hf"})
      expect_one_line_error("convert --input " + input + " --output " + output + " --overwrite --to " + to,
                            "--output " + output);
  }
  EXPECT_EQ(forge::testing::cli::read_file(path("ckpt") + "/manifest.json"), manifest_before);
  EXPECT_FALSE(fs::exists(path("ckpt") + "/hf"));
  EXPECT_TRUE(fs::exists(path("parent") + "/model/config.json"));
}

// The weights-only checkpoint records the model config exactly as the trainer does (LlamaConfig::to_json),
// so resuming or comparing configs sees the same architecture, not the source's config.json text.
TEST_F(ConvertCli, ForgeCheckpointRecordsTheTrainersModelConfig) {
  ASSERT_EQ(
      run_forge("convert --input " + kFixture.string() + " --output " + path("ckpt") + " --to forge").status,
      0);
  const nlohmann::json recorded = read_json(path("ckpt") + "/manifest.json")["model_config"];
  const nlohmann::json expected =
      forge::models::LlamaConfig::from_json(read_json(kFixture / "config.json"), "fixture").to_json();
  EXPECT_EQ(recorded, expected) << recorded.dump(2);
  // And a checkpoint converted from that checkpoint again records the same.
  ASSERT_EQ(
      run_forge("convert --input " + path("ckpt") + " --output " + path("again") + " --to forge").status, 0);
  EXPECT_EQ(read_json(path("again") + "/manifest.json")["model_config"], expected);
}

}  // namespace
}  // namespace forge::convert_cli_test
