// Pretrained models in and out: Hugging Face folders (single file and sharded, F32/BF16/F16) and forge
// checkpoints; exact round trips, sharding, golden parity with the PyTorch twin (tests/reference/
// hf_checkpoint_fixture.py) and safe export. Malformed inputs: pretrained_errors_test.cpp.
#include "forge/models/pretrained.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <tuple>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/safetensors.h"
#include "forge/ckpt/sharded.h"
#include "forge/optim/adamw.h"
#include "models/pretrained_test_util.h"
#include "op_harness.h"

namespace forge::pretrained_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::ckpt;
namespace {

namespace fs = std::filesystem;
using namespace pretrained_testing;
using nlohmann::json;
using testing::expect_error_containing;

TEST_F(PretrainedTest, TensorShapesFollowTheModelsRegistrationOrder) {
  for (bool tied : {false, true}) {
    auto model = tiny_model(tied, 1);
    const auto shapes = model->config().tensor_shapes();
    ASSERT_EQ(static_cast<int>(shapes.size()), model->params().count());
    for (int i = 0; i < model->params().count(); ++i) {
      EXPECT_EQ(shapes[i].first, model->params().info(i).name);
      EXPECT_EQ(shapes[i].second, model->params().info(i).shape) << shapes[i].first;
    }
    EXPECT_EQ(tied, std::none_of(shapes.begin(), shapes.end(),
                                 [](auto& s) { return s.first == "lm_head.weight"; }));
  }
}

// Loaded models are for inference: no gradient buffers (a third of a training model's fp32 state), and
// training calls on them are refused with a clear message.
TEST_F(PretrainedTest, LoadedModelsCarryNoGradients) {
  auto original = tiny_model(false, 7);
  export_hugging_face(original->params(), original->config().to_json(), path("hf"), {});
  auto loaded = load_pretrained_model(path("hf"), kFp32);
  EXPECT_TRUE(original->params().has_grads());
  EXPECT_FALSE(loaded->params().has_grads());
  std::vector<int32_t> ids = {1, 2, 3, 4}, targets = {2, 3, 4, 5};
  expect_error_containing([&] { loaded->forward_backward(ids.data(), targets.data(), 1, 4, 1.0f); },
                          {"inference"});
  expect_error_containing([&] { AdamW optimizer(&loaded->params(), AdamWConfig{}); }, {"inference"});
  expect_error_containing([&] { loaded->params().grad(0); }, {"model.embed_tokens.weight", "inference"});
  EXPECT_EQ(loaded->forward_loss(ids.data(), targets.data(), 1, 4).sum,
            original->forward_loss(ids.data(), targets.data(), 1, 4).sum);
}

// forge fp32 -> HF fp32 -> forge: bitwise, through both directory kinds.
TEST_F(PretrainedTest, Fp32RoundTripThroughBothKindsIsBitwise) {
  auto original = tiny_model(false, 7);
  CheckpointState state;
  state.step = 12;
  state.model_config = original->config().to_json();
  AdamW optimizer(&original->params(), AdamWConfig{});
  save_checkpoint(path("forge_in").string(), original->params(), &optimizer.moments(), state);

  PretrainedDir forge_dir = open_pretrained(path("forge_in"));
  EXPECT_EQ(forge_dir.kind, PretrainedDir::Kind::forge_checkpoint);
  EXPECT_TRUE(forge_dir.config->same_as(original->config()));
  auto from_forge = load_pretrained_model(path("forge_in"), kFp32);
  EXPECT_TRUE(bitwise_equal(from_forge->params(), original->params()));

  export_hugging_face(from_forge->params(), forge_dir.config_json, path("hf"), {});
  EXPECT_TRUE(fs::exists(path("hf") / "model.safetensors"));
  EXPECT_FALSE(fs::exists(path("hf") / "model.safetensors.index.json"));
  const json config = read_json(path("hf") / "config.json");
  EXPECT_EQ(config["torch_dtype"], "float32");
  EXPECT_EQ(LlamaConfig::from_json(config, "exported"), original->config());
  SafetensorsFile exported = SafetensorsFile::open((path("hf") / "model.safetensors").string());
  EXPECT_EQ(exported.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(static_cast<int>(exported.entries().size()), original->params().count());
  for (const auto& entry : exported.entries()) EXPECT_EQ(entry.dtype, DType::f32) << entry.name;

  PretrainedDir hf_dir = open_pretrained(path("hf"));
  EXPECT_EQ(hf_dir.kind, PretrainedDir::Kind::hugging_face);
  auto from_hf = load_pretrained_model(path("hf"), kFp32);
  EXPECT_TRUE(bitwise_equal(from_hf->params(), original->params()));

  export_forge_checkpoint(from_hf->params(), hf_dir.config_json, path("forge_out"), false);
  const CheckpointState written = read_checkpoint_manifest(path("forge_out").string());
  EXPECT_EQ(written.step, 0);
  for (const std::string& name : checkpoint_tensor_names(path("forge_out").string()))
    EXPECT_FALSE(name.starts_with("exp_avg")) << name;  // weights only
  auto back = load_pretrained_model(path("forge_out"), kFp32);
  EXPECT_TRUE(bitwise_equal(back->params(), original->params()));
  EXPECT_TRUE(leftovers().empty()) << leftovers()[0];
}

// HF bf16/fp16 -> fp32 -> the same dtype: the files come out byte for byte identical, and the export
// rounds exactly as the dtype.h converters (round to nearest, ties to even).
TEST_F(PretrainedTest, HalfPrecisionRoundTripsAreByteIdentical) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const std::string tag(dtype_name(dtype));
    auto model = tiny_model(false, 3);
    fill_with_wide_values(model->params(), 99);
    export_hugging_face(model->params(), tiny_config_json(false), path(tag + "_a"), with_dtype(dtype));
    EXPECT_EQ(read_json(path(tag + "_a") / "config.json")["torch_dtype"],
              dtype == DType::bf16 ? "bfloat16" : "float16");

    SafetensorsFile first = SafetensorsFile::open((path(tag + "_a") / "model.safetensors").string());
    const float* w = model->params().params().f32();
    int64_t offset = 0;
    int64_t ties = 0, subnormal_or_overflow = 0;
    for (const auto& info : model->params().infos()) {
      Tensor stored = first.read(info.name);
      ASSERT_EQ(stored.dtype(), dtype) << info.name;
      for (int64_t i = 0; i < stored.numel(); ++i) {
        const float x = w[offset + i];
        const uint16_t want = dtype == DType::bf16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
        ASSERT_EQ(stored.data<uint16_t>()[i], want) << info.name << "[" << i << "] = " << x;
        ties += dtype == DType::bf16 && (std::bit_cast<uint32_t>(x) & 0xffffu) == 0x8000u;
        subnormal_or_overflow += dtype == DType::f16 && (std::abs(x) < 6.1e-5f || std::abs(x) > 65504.0f);
      }
      offset += stored.numel();
    }
    EXPECT_GT(ties + subnormal_or_overflow, 100) << "the values should exercise the rounding edge cases";

    if (dtype == DType::f16) {
      // Weights past fp16's range were written as infinities, which loading refuses; the round trip below
      // runs on the weights clamped to the largest finite fp16 value.
      expect_error_containing([&] { load_pretrained_model(path(tag + "_a"), kFp32); },
                              {(path(tag + "_a") / "model.safetensors").string(), "non-finite"});
      float* weights = model->params().params().f32();
      for (int64_t i = 0; i < model->params().numel(); ++i)
        weights[i] = std::clamp(weights[i], -65504.0f, 65504.0f);
      HfExportOptions again = with_dtype(dtype);
      again.overwrite = true;
      export_hugging_face(model->params(), tiny_config_json(false), path(tag + "_a"), again);
      first = SafetensorsFile::open((path(tag + "_a") / "model.safetensors").string());
    }

    auto loaded = load_pretrained_model(path(tag + "_a"), kFp32);
    offset = 0;
    for (const auto& info : loaded->params().infos()) {
      Tensor stored = first.read(info.name);
      for (int64_t i = 0; i < stored.numel(); ++i) {
        const uint16_t bits = stored.data<uint16_t>()[i];
        const float want = dtype == DType::bf16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits);
        ASSERT_EQ(std::bit_cast<uint32_t>(loaded->params().params().f32()[offset + i]),
                  std::bit_cast<uint32_t>(want))
            << info.name << "[" << i << "]";
      }
      offset += stored.numel();
    }
    export_hugging_face(loaded->params(), read_json(path(tag + "_a") / "config.json"), path(tag + "_b"),
                        with_dtype(dtype));
    for (const char* file : {"model.safetensors", "config.json"})
      EXPECT_EQ(read_file(path(tag + "_a") / file), read_file(path(tag + "_b") / file)) << file;
  }
}

TEST_F(PretrainedTest, ShardsGreedilyWithACorrectIndexAndLoadsBack) {
  auto model = tiny_model(false, 5);
  // Embedding and head are 32x16 fp32 = 2048 bytes, the largest tensors; 3000 bytes forces many shards.
  HfExportOptions options;
  options.max_shard_bytes = 3000;
  export_hugging_face(model->params(), tiny_config_json(false), path("sharded"), options);
  EXPECT_FALSE(fs::exists(path("sharded") / "model.safetensors"));
  const json index = read_json(path("sharded") / "model.safetensors.index.json");
  const json& map = index["weight_map"];
  ASSERT_EQ(static_cast<int>(map.size()), model->params().count());

  // Recompute the greedy plan independently and compare.
  std::vector<std::vector<std::string>> plan;
  uint64_t current = 0, total = 0;
  for (const auto& info : model->params().infos()) {
    const uint64_t bytes = 4 * static_cast<uint64_t>(shape_numel(info.shape));
    if (plan.empty() || current + bytes > options.max_shard_bytes) plan.emplace_back(), current = 0;
    plan.back().push_back(info.name);
    current += bytes, total += bytes;
  }
  ASSERT_GT(plan.size(), 3u);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  const size_t n = plan.size();
  uint64_t file_tensor_bytes = 0;
  for (size_t k = 0; k < n; ++k) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
    SafetensorsFile shard = SafetensorsFile::open((path("sharded") / name).string());
    EXPECT_EQ(shard.metadata().at("format"), "pt");
    ASSERT_EQ(shard.entries().size(), plan[k].size()) << name;
    uint64_t bytes = 0;
    for (const auto& tensor : plan[k]) {
      EXPECT_EQ(map[tensor], name) << tensor;
      ASSERT_NE(shard.find(tensor), nullptr) << tensor;
      bytes += shard.find(tensor)->end - shard.find(tensor)->begin;
    }
    EXPECT_LE(bytes, options.max_shard_bytes) << name;
    file_tensor_bytes += bytes;
  }
  EXPECT_EQ(file_tensor_bytes, total);
  EXPECT_FALSE(fs::exists(path("sharded") / fmt::format("model-{:05d}-of-{:05d}.safetensors", n + 1, n)));
  auto back = load_pretrained_model(path("sharded"), kFp32);
  EXPECT_TRUE(bitwise_equal(back->params(), model->params()));

  // A limit below every tensor: one tensor per shard (a tensor is never split), bf16 sizes in the index.
  options.max_shard_bytes = 1;
  options.dtype = DType::bf16;
  export_hugging_face(model->params(), tiny_config_json(false), path("one_each"), options);
  const json one_each = read_json(path("one_each") / "model.safetensors.index.json");
  EXPECT_EQ(one_each["metadata"]["total_size"].get<uint64_t>(), total / 2);
  std::set<std::string> files;
  for (const auto& [tensor, file] : one_each["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_EQ(static_cast<int>(files.size()), model->params().count());
  load_pretrained_model(path("one_each"), kFp32);

  // A limit of the whole model: a single file, no index.
  options.max_shard_bytes = total / 2;
  export_hugging_face(model->params(), tiny_config_json(false), path("exact"), options);
  EXPECT_TRUE(fs::exists(path("exact") / "model.safetensors"));
  EXPECT_FALSE(fs::exists(path("exact") / "model.safetensors.index.json"));
}

// Parity with the PyTorch twin: a sharded bf16 folder whose golden logits and loss were computed in fp32
// from the bf16-rounded weights. The weights widen exactly, so only summation order differs: logits to
// 1e-5 of their largest magnitude (the golden-test tolerance), loss to 1e-5 absolute.
TEST_F(PretrainedTest, ShardedBf16FixtureMatchesThePyTorchTwin) {
  const fs::path folder = fixture("hf_llama_tiny_bf16");
  PretrainedDir source = open_pretrained(folder);
  EXPECT_EQ(source.kind, PretrainedDir::Kind::hugging_face);
  EXPECT_EQ(source.config_json["torch_dtype"], "bfloat16");
  auto model = load_pretrained_model(folder, kFp32);

  SafetensorsFile golden = SafetensorsFile::open(fixture("hf_llama_tiny_bf16.golden.safetensors"));
  Tensor ids = golden.read("input_ids"), labels = golden.read("labels"), want = golden.read("logits");
  const int64_t batch = ids.dim(0), seq = ids.dim(1);
  Tensor logits = model->logits(ids.i32(), batch, seq);
  ASSERT_EQ(logits.numel(), want.numel());
  std::vector<double> reference(want.f32(), want.f32() + want.numel());
  EXPECT_LT(testing::relative_error(logits.f32(), reference.data(), reference.size()), 1e-5);
  LossSum loss = model->forward_loss(ids.i32(), labels.i32(), batch, seq);
  EXPECT_NEAR(loss.mean(), golden.read("loss").f32()[0], 1e-5);

  // Exporting bf16 again (in three shards or one) reproduces every stored tensor's bytes.
  for (uint64_t limit : {uint64_t{6000}, uint64_t{1} << 30}) {
    HfExportOptions options;
    options.dtype = DType::bf16;
    options.max_shard_bytes = limit;
    const fs::path out = path("reexport_" + std::to_string(limit));
    export_hugging_face(model->params(), source.config_json, out, options);
    auto reloaded = load_pretrained_model(out, kFp32);
    EXPECT_TRUE(bitwise_equal(reloaded->params(), model->params()));
    const json index = read_json(folder / "model.safetensors.index.json");
    for (const auto& info : model->params().infos()) {
      SafetensorsFile original =
          SafetensorsFile::open((folder / index["weight_map"][info.name].get<std::string>()).string());
      const std::string file =
          limit < 10000
              ? read_json(out / "model.safetensors.index.json")["weight_map"][info.name].get<std::string>()
              : std::string("model.safetensors");
      SafetensorsFile copy = SafetensorsFile::open((out / file).string());
      Tensor a = original.read(info.name), b = copy.read(info.name);
      ASSERT_EQ(b.dtype(), DType::bf16);
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.bytes()), 0) << info.name;
    }
  }
}

// The fp32 single-file twin fixture (tests/fixtures/llama_tiny.*) as a Hugging Face folder.
TEST_F(PretrainedTest, SingleFileFp32FolderMatchesTheTwin) {
  for (const std::string name : {"llama_tiny", "llama_tiny_tied_llama3"}) {
    SCOPED_TRACE(name);
    SafetensorsFile twin = SafetensorsFile::open(fixture(name + ".safetensors"));
    const json config = json::parse(read_file(fixture(name + ".config.json")));
    std::vector<std::pair<std::string, Tensor>> weights;
    for (const auto& [tensor, shape] : LlamaConfig::from_json(config, name).tensor_shapes())
      weights.emplace_back(tensor, twin.read(tensor));
    const fs::path folder = hf_folder(name, config, weights);
    auto model = load_pretrained_model(folder, kFp32);
    Tensor ids = twin.read("input_ids"), want = twin.read("logits");
    Tensor logits = model->logits(ids.i32(), ids.dim(0), ids.dim(1));
    std::vector<double> reference(want.f32(), want.f32() + want.numel());
    EXPECT_LT(testing::relative_error(logits.f32(), reference.data(), reference.size()), 1e-5);
  }
}

TEST_F(PretrainedTest, RefreshesTheBf16Shadow) {
  auto source = tiny_model(false, 11);
  export_hugging_face(source->params(), tiny_config_json(false), path("hf"), {});
  auto model = load_pretrained_model(path("hf"), {DType::bf16, nn::Recompute::none});
  ASSERT_TRUE(model->params().has_bf16());
  const auto& params = model->params();
  for (int64_t i = 0; i < params.numel(); ++i)
    ASSERT_EQ(params.params_bf16().bf16()[i], f32_to_bf16_bits(source->params().params().f32()[i])) << i;
}

TEST_F(PretrainedTest, TiedEmbeddingsAcceptOnlyAnIdenticalHead) {
  auto model = tiny_model(true, 13);
  export_hugging_face(model->params(), tiny_config_json(true), path("tied"), {});
  SafetensorsFile exported = SafetensorsFile::open((path("tied") / "model.safetensors").string());
  EXPECT_EQ(exported.find("lm_head.weight"), nullptr);
  EXPECT_TRUE(bitwise_equal(load_pretrained_model(path("tied"), kFp32)->params(), model->params()));

  Tensor embedding = model->params().param(model->params().find("model.embed_tokens.weight"));
  auto with_head = tensors_of(*model);
  with_head.emplace_back("lm_head.weight", embedding.clone());
  hf_folder("tied_same_head", tiny_config_json(true), with_head);
  EXPECT_TRUE(bitwise_equal(load_pretrained_model(path("tied_same_head"), kFp32)->params(), model->params()));

  Tensor other = embedding.clone();
  other.f32()[5] += 1.0f;
  with_head.back().second = other;
  hf_folder("tied_other_head", tiny_config_json(true), with_head);
  expect_error_containing([&] { load_pretrained_model(path("tied_other_head"), kFp32); },
                          {"'lm_head.weight'", "tied_other_head/model.safetensors", "tie_word_embeddings"});

  // An untied model needs the head.
  auto untied = tiny_model(false, 13);
  auto without_head = tensors_of(*untied);
  without_head.pop_back();
  hf_folder("untied_no_head", tiny_config_json(false), without_head);
  expect_error_containing([&] { load_pretrained_model(path("untied_no_head"), kFp32); },
                          {"'lm_head.weight'", "missing", "untied_no_head/model.safetensors"});
}

TEST_F(PretrainedTest, ToleratesRotaryBuffersOfExistingLayersOnly) {
  auto model = tiny_model(false, 17);
  auto tensors = tensors_of(*model);
  Tensor inv_freq = Tensor::zeros({4}, DType::f32);
  tensors.emplace_back("model.layers.1.self_attn.rotary_emb.inv_freq", inv_freq);
  hf_folder("rotary_ok", tiny_config_json(false), tensors);
  EXPECT_TRUE(bitwise_equal(load_pretrained_model(path("rotary_ok"), kFp32)->params(), model->params()));

  tensors.back().first = "model.layers.2.self_attn.rotary_emb.inv_freq";  // the model has layers 0 and 1
  hf_folder("rotary_bad", tiny_config_json(false), tensors);
  expect_error_containing([&] { load_pretrained_model(path("rotary_bad"), kFp32); },
                          {"unexpected tensor", "'model.layers.2.self_attn.rotary_emb.inv_freq'",
                           "rotary_bad/model.safetensors"});
}

// ---- Export: the folder appears complete or not at all. ----

TEST_F(PretrainedTest, ExportRefusesToClobberAndCleansUp) {
  auto model = tiny_model(false, 53);
  const json config = tiny_config_json(false);

  fs::create_directories(path("busy"));
  std::ofstream(path("busy") / "notes.txt") << "keep me";
  expect_error_containing([&] { export_hugging_face(model->params(), config, path("busy"), {}); },
                          {"busy", "not empty"});
  HfExportOptions overwrite;
  overwrite.overwrite = true;
  expect_error_containing([&] { export_hugging_face(model->params(), config, path("busy"), overwrite); },
                          {"busy", "holds no model"});
  EXPECT_EQ(read_file(path("busy") / "notes.txt"), "keep me");

  std::ofstream(path("plain_file")) << "x";
  expect_error_containing([&] { export_hugging_face(model->params(), config, path("plain_file"), {}); },
                          {"plain_file", "not a directory"});

  // An empty directory is fine; a trailing slash names the same folder.
  fs::create_directories(path("empty"));
  export_hugging_face(model->params(), config, path("empty").string() + "/", {});
  EXPECT_TRUE(fs::exists(path("empty") / "model.safetensors"));

  // Overwriting a model folder replaces it whole: stale shards do not survive.
  HfExportOptions sharded;
  sharded.max_shard_bytes = 4000;
  export_hugging_face(model->params(), config, path("model"), sharded);
  EXPECT_TRUE(fs::exists(path("model") / "model.safetensors.index.json"));
  auto other = tiny_model(false, 59);
  expect_error_containing([&] { export_hugging_face(other->params(), config, path("model"), {}); },
                          {"model", "not empty"});
  export_hugging_face(other->params(), config, path("model"), overwrite);
  EXPECT_FALSE(fs::exists(path("model") / "model.safetensors.index.json"));
  EXPECT_TRUE(bitwise_equal(load_pretrained_model(path("model"), kFp32)->params(), other->params()));

  // Errors after staging began leave nothing behind.
  HfExportOptions fp8;
  fp8.dtype = DType::e4m3;
  expect_error_containing([&] { export_hugging_face(model->params(), config, path("fp8"), fp8); },
                          {"fp8_e4m3"});
  json tied = tiny_config_json(true);
  expect_error_containing([&] { export_hugging_face(model->params(), tied, path("mismatch"), {}); },
                          {"mismatch", "'lm_head.weight'"});
  HfExportOptions missing_extra;
  missing_extra.extra_files = {path("no_such_tokenizer.json")};
  expect_error_containing([&] { export_hugging_face(model->params(), config, path("extra"), missing_extra); },
                          {"no_such_tokenizer.json"});
  EXPECT_FALSE(fs::exists(path("fp8")));
  EXPECT_FALSE(fs::exists(path("mismatch")));
  EXPECT_FALSE(fs::exists(path("extra")));
  EXPECT_TRUE(leftovers().empty()) << leftovers()[0];
}

TEST_F(PretrainedTest, ExportCopiesExtraFilesAndFillsHfKeys) {
  auto model = tiny_model(false, 61);
  std::ofstream(path("tokenizer.json")) << R"({"model": {}})";
  HfExportOptions options;
  options.extra_files = {path("tokenizer.json")};
  json config = tiny_config_json(false);
  config.erase("architectures");
  config.erase("model_type");
  export_hugging_face(model->params(), config, path("out"), options);
  EXPECT_EQ(read_file(path("out") / "tokenizer.json"), R"({"model": {}})");
  const json written = read_json(path("out") / "config.json");
  EXPECT_EQ(written["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(written["model_type"], "llama");
  EXPECT_EQ(written["bos_token_id"], 1);  // the caller's keys are kept
}

TEST(ParseByteSize, AcceptsHuggingFaceSizes) {
  EXPECT_EQ(parse_byte_size("5GB"), 5'000'000'000ull);
  EXPECT_EQ(parse_byte_size("500MB"), 500'000'000ull);
  EXPECT_EQ(parse_byte_size("1024"), 1024ull);
  EXPECT_EQ(parse_byte_size("10kb"), 10'000ull);
  EXPECT_EQ(parse_byte_size("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("3mib"), 3ull << 20);
  EXPECT_EQ(parse_byte_size("7B"), 7ull);
  EXPECT_EQ(parse_byte_size("1TB"), 1'000'000'000'000ull);
  for (const char* bad :
       {"", "GB", "5 GB", "5XB", "-5GB", "1.5GB", "0", "0GB", "99999999999999999999", "20000000TiB", "5GBs"})
    expect_error_containing([&] { parse_byte_size(bad); }, {fmt::format("'{}'", bad)});
}

}  // namespace
}  // namespace forge::pretrained_test
