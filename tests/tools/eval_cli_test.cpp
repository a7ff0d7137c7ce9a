// forge eval, run as the real binary on a tiny model saved as a forge checkpoint and as a Hugging Face
// folder: its loss, perplexity and token count equal a direct computation from LlamaModel's logits over the
// same windows; --max-sequences, and bad input answered with one "forge: error:" line.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/image/image_text.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/models/captions.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "tools/cli_harness.h"
#include "train/toy_run.h"

namespace forge::eval_cli_test {
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace {
namespace fs = std::filesystem;
using testing::cli::expect_one_line_error;
using testing::cli::Outcome;
using testing::cli::run_forge;

nlohmann::json last_json_line(const std::string& output) {
  std::string text = output;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return nlohmann::json::parse(text.substr(text.find_last_of('\n') + 1));
}

class EvalCli : public testing::cli::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    std::ifstream in(fs::path(FORGE_FIXTURE_DIR) / "llama_tiny.config.json");
    config_json_ = nlohmann::json::parse(in);
    config_ = LlamaConfig::from_json(config_json_, "llama_tiny.config.json");
    // A large init scale makes the predictions far from uniform, so a model whose weights did not load
    // (loss ln 64) cannot pass for the real one.
    model_ = std::make_unique<LlamaModel>(config_, nn::ComputeOptions{DType::f32, nn::Recompute::none}, 0.5f);
    model_->initialize(17);
    save_checkpoint((dir_ / "ckpt").string(), model_->params(), nullptr, {0, config_json_, {}});

    // 50 tokens in documents of uneven lengths (one of a single token).
    std::mt19937 gen(3);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config_.vocab_size) - 1);
    IndexedDatasetWriter writer((dir_ / "eval").string(), IndexedDType::u16);
    for (int length : {13, 7, 20, 1, 9}) {
      std::vector<int32_t> d(static_cast<size_t>(length));
      for (auto& t : d) t = token(gen);
      stream_.insert(stream_.end(), d.begin(), d.end());
      writer.add_document(d);
    }
    writer.finalize();
  }

  // Mean loss over sequences k < max_sequences of T tokens, each from its own logits, in double.
  std::pair<double, int64_t> direct_loss(int64_t T, int64_t max_sequences) {
    double sum = 0;
    int64_t count = 0;
    const int64_t predictions = static_cast<int64_t>(stream_.size()) - 1;
    for (int64_t k = 0; k * T < predictions && k < max_sequences; ++k) {
      const int64_t length = std::min(T, predictions - k * T);
      std::vector<int32_t> ids(stream_.begin() + k * T, stream_.begin() + k * T + length);
      Tensor logits = model_->logits(ids.data(), 1, length);
      const float* z = logits.data<float>();
      for (int64_t t = 0; t < length; ++t) {
        const float* row = z + t * config_.vocab_size;
        double max = row[0], total = 0;
        for (int64_t v = 1; v < config_.vocab_size; ++v) max = std::max(max, static_cast<double>(row[v]));
        for (int64_t v = 0; v < config_.vocab_size; ++v) total += std::exp(static_cast<double>(row[v]) - max);
        const int32_t target = stream_[static_cast<size_t>(k * T + t + 1)];
        sum += std::log(total) + max - static_cast<double>(row[target]);
        ++count;
      }
    }
    return {sum / static_cast<double>(count), count};
  }

  std::string base_args(const std::string& model) const {
    return "eval --model " + (dir_ / model).string() + " --data " + (dir_ / "eval").string();
  }

  nlohmann::json config_json_;
  LlamaConfig config_;
  std::unique_ptr<LlamaModel> model_;
  std::vector<int32_t> stream_;
};

TEST_F(EvalCli, MatchesDirectComputation) {
  // T = 8: 49 predictions = 6 full sequences + one of 1 target; batches of 3 leave a last batch of 1.
  Outcome o = run_forge(base_args("ckpt") + " --seq-len 8 --batch-size 3 --json --dtype fp32");
  ASSERT_EQ(o.status, 0) << o.output;
  const nlohmann::json result = last_json_line(o.output);
  const auto [loss, tokens] = direct_loss(8, 1000);
  EXPECT_EQ(tokens, 49);
  EXPECT_EQ(result["tokens"].get<int64_t>(), 49);
  EXPECT_EQ(result["sequences"].get<int64_t>(), 7);
  EXPECT_NEAR(result["loss"].get<double>(), loss, 1e-5 * loss);
  EXPECT_NEAR(result["perplexity"].get<double>(), std::exp(loss), 1e-5 * std::exp(loss));
  EXPECT_GT(std::abs(loss - std::log(64.0)), 0.2) << "predictions should be far from uniform";
  EXPECT_NE(o.output.find("perplexity"), std::string::npos);

  // Batching does not change the numbers.
  Outcome one = run_forge(base_args("ckpt") + " --seq-len 8 --batch-size 1 --json");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NEAR(last_json_line(one.output)["loss"].get<double>(), result["loss"].get<double>(), 1e-6);

  // --max-sequences counts whole sequences from the start.
  Outcome two = run_forge(base_args("ckpt") + " --seq-len 8 --batch-size 4 --max-sequences 2 --json");
  ASSERT_EQ(two.status, 0) << two.output;
  const auto [loss2, tokens2] = direct_loss(8, 2);
  EXPECT_EQ(last_json_line(two.output)["tokens"].get<int64_t>(), 16);
  EXPECT_EQ(tokens2, 16);
  EXPECT_NEAR(last_json_line(two.output)["loss"].get<double>(), loss2, 1e-5 * loss2);
}

TEST_F(EvalCli, HuggingFaceFolderAndBf16) {
  export_hugging_face(model_->params(), config_json_, dir_ / "hf", {});
  Outcome o = run_forge(base_args("hf") + " --seq-len 7 --batch-size 2 --json");
  ASSERT_EQ(o.status, 0) << o.output;
  const auto [loss, tokens] = direct_loss(7, 1000);
  EXPECT_EQ(last_json_line(o.output)["tokens"].get<int64_t>(), 49);
  EXPECT_NEAR(last_json_line(o.output)["loss"].get<double>(), loss, 1e-5 * loss);
  // bf16 GEMM operands: close to the fp32 result, not equal.
  Outcome bf16 = run_forge(base_args("hf") + " --seq-len 7 --batch-size 2 --json --dtype bf16");
  ASSERT_EQ(bf16.status, 0) << bf16.output;
  const double bf16_loss = last_json_line(bf16.output)["loss"].get<double>();
  EXPECT_NEAR(bf16_loss, loss, 2e-2 * loss);
  EXPECT_NE(bf16_loss, last_json_line(o.output)["loss"].get<double>());
}

TEST_F(EvalCli, TokensOutsideTheVocabulary) {
  IndexedDatasetWriter writer((dir_ / "big").string(), IndexedDType::u16);
  std::vector<int32_t> d = {1, 2, 3, static_cast<int32_t>(config_.vocab_size), 4};
  writer.add_document(d);
  writer.finalize();
  // The culprit: the .bin file, the document and the position in it, the id and the vocabulary.
  expect_one_line_error(
      "eval --model " + (dir_ / "ckpt").string() + " --data " + (dir_ / "big").string() + " --seq-len 4",
      fmt::format("{}: document 0, position 3: token id {} is outside the model's vocabulary [0, {})",
                  (dir_ / "big.bin").string(), config_.vocab_size, config_.vocab_size));
}

// A model with NaN or infinite weights is refused when it loads, naming the tensor and where it came from.
TEST_F(EvalCli, NonFiniteWeightsAreRefused) {
  ParameterStore& params = model_->params();
  const int id = params.find("model.layers.1.self_attn.v_proj.weight");
  ASSERT_GE(id, 0);
  params.param(id).f32()[5] = std::numeric_limits<float>::quiet_NaN();
  save_checkpoint((dir_ / "nan_ckpt").string(), params, nullptr, {0, config_json_, {}});
  expect_one_line_error(base_args("nan_ckpt") + " --seq-len 8",
                        "tensor 'model.layers.1.self_attn.v_proj.weight' holds 1 non-finite value (NaN or "
                        "infinity) of " +
                            std::to_string(shape_numel(params.info(id).shape)) +
                            ", the first at index 5 (nan)");
  params.param(id).f32()[5] = std::numeric_limits<float>::infinity();
  export_hugging_face(params, config_json_, dir_ / "inf_hf", {});
  expect_one_line_error(base_args("inf_hf") + " --seq-len 8",
                        (dir_ / "inf_hf" / "model.safetensors").string() +
                            ": tensor 'model.layers.1.self_attn.v_proj.weight' holds 1 non-finite value");
}

// Finite weights whose logits overflow fp32: the loss is not finite, which eval reports as an error (it
// used to print "loss nan" and exit 0).
TEST_F(EvalCli, NonFiniteLossIsAnError) {
  ParameterStore& params = model_->params();
  for (const char* name : {"model.norm.weight", "lm_head.weight"}) {
    Tensor w = params.param(params.find(name));
    std::fill(w.f32(), w.f32() + w.numel(), 1e30f);
  }
  save_checkpoint((dir_ / "huge").string(), params, nullptr, {0, config_json_, {}});
  expect_one_line_error(base_args("huge") + " --seq-len 8 --json", "is not finite");
}

// --images on a multimodal checkpoint: the answer loss equals the library's forward over the same samples,
// in any batching; --captions equals CaptionScore over the same samples (itself checked against greedy
// decoding written out in trainer_multimodal_test); misuse gets one line.
TEST_F(EvalCli, ImageTextAnswersAndCaptions) {
  toy::write_llava_toy_inputs(dir_);  // dir_/shapes: 24 held-out 16x16 images; dir_/llava.json
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(dir_ / "llava.json"));
  auto llava = build_model(*read_model_config((dir_ / "llava.json").string()),
                           {DType::f32, nn::Recompute::none}, StageSpec::whole(), 0.5f);
  llava->initialize(29);
  save_checkpoint((dir_ / "llava").string(), llava->params(), nullptr, {0, config, {}});
  const fs::path heldout = dir_ / "shapes" / "heldout.jsonl";
  const std::string args = "eval --model " + (dir_ / "llava").string() + " --images " + heldout.string() +
                           " --tokenizer bytes --seq-len 88 --json";
  const Outcome o = run_forge(args + " --batch-size 5 --captions 4");
  ASSERT_EQ(o.status, 0) << o.output;
  const nlohmann::json result = last_json_line(o.output);

  const ImageProcessor processor(
      ImageProcessorConfig::from_json_file(dir_ / "shapes" / "preprocessor_config.json"));
  ImageTextOptions options;
  options.seq_len = 88, options.image_token_id = 256, options.tokens_per_image = 4;
  const ImageTextDataset data =
      ImageTextDataset::from_jsonl(heldout, TextEncoder::bytes(), processor, options);
  ASSERT_EQ(data.num_samples(), 24);
  std::vector<int64_t> all(24);
  for (int64_t i = 0; i < 24; ++i) all[static_cast<size_t>(i)] = i;
  const ImageTextDataset::Batch batch = data.batch(all);
  const MicroBatch mb{batch.ids.i32(), batch.targets.i32(), 24, 88, 0.0f, batch.pixels.f32(), 24};
  const LossSum want = llava->forward(mb, Tensor(), nullptr).loss;
  EXPECT_EQ(result["samples"].get<int64_t>(), 24);
  EXPECT_EQ(result["tokens"].get<int64_t>(), want.tokens);
  EXPECT_NEAR(result["loss"].get<double>(), want.mean(), 1e-5 * want.mean());
  CaptionScore score;
  for (int64_t i = 0; i < 4; ++i) {
    const std::vector<int64_t> one = {i};
    const ImageTextDataset::Batch b = data.batch(one);
    score.add(*llava, i, b.ids.i32(), b.targets.i32(), 88, b.pixels.f32(), 1);
  }
  EXPECT_EQ(result["captions"]["count"].get<int64_t>(), 4);
  EXPECT_EQ(result["captions"]["exact"].get<int64_t>(), score.exact());
  EXPECT_DOUBLE_EQ(result["captions"]["token_accuracy"].get<double>(), score.token_accuracy());
  EXPECT_NE(o.output.find("captions (greedy, 4 samples"), std::string::npos) << o.output;
  // Batching does not change the loss.
  const Outcome one = run_forge(args + " --batch-size 1");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NEAR(last_json_line(one.output)["loss"].get<double>(), result["loss"].get<double>(), 1e-6);

  expect_one_line_error(args + " --data " + (dir_ / "eval").string(), "not both");
  expect_one_line_error(base_args("ckpt") + " --seq-len 8 --captions 2", "--captions needs image-text data");
  expect_one_line_error(
      "eval --model " + (dir_ / "ckpt").string() + " --images " + heldout.string() + " --seq-len 8",
      "needs a multimodal model");
  expect_one_line_error("eval --model " + (dir_ / "llava").string() + " --images " +
                            (dir_ / "none.jsonl").string() + " --seq-len 88",
                        "none.jsonl");
  expect_one_line_error(
      "eval --model " + (dir_ / "llava").string() + " --images " + heldout.string() + " --seq-len 88",
      "has no tokenizer.json");
}

TEST_F(EvalCli, BadArguments) {
  expect_one_line_error(base_args("ckpt") + " --seq-len 0", "--seq-len");
  expect_one_line_error(base_args("ckpt") + " --seq-len 8 --batch-size 0", "--batch-size");
  // The error lists exactly the dtypes the option accepts (it used to list fp16, fp8_e4m3, int32, ...).
  expect_one_line_error(base_args("ckpt") + " --seq-len 8 --dtype fp8", "--dtype: fp8 not in {fp32,bf16}");
  expect_one_line_error(base_args("ckpt") + " --seq-len 8 --dtype fp16", "--dtype: fp16 not in {fp32,bf16}");
  expect_one_line_error(base_args("ckpt") + " --seq-len 100000", "max_position_embeddings");
  expect_one_line_error(base_args("missing") + " --seq-len 8", "missing");
  expect_one_line_error(
      "eval --model " + (dir_ / "ckpt").string() + " --data " + (dir_ / "nothing").string() + " --seq-len 8",
      "nothing.idx");
  expect_one_line_error("eval --data " + (dir_ / "eval").string() + " --seq-len 8", "--model");
}

}  // namespace
}  // namespace forge::eval_cli_test
