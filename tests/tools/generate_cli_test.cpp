// forge generate, run as the real binary on tiny models written in the test: a byte-level forge checkpoint
// and a Hugging Face folder with a tokenizer.json and a generation_config.json. Its text equals the library's
// generation (greedy and seeded sampling), streaming prints what --no-stream prints (never a split UTF-8
// character), the prompt may come from stdin, end-of-sequence ids stop it, a full context stops it with a
// note, and bad input gets one "forge: error:" line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/safetensors.h"
#include "forge/core/device.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "forge/models/sampling.h"
#include "tools/cli_harness.h"
#include "train/toy_run.h"

namespace forge::generate_cli_test {
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace {
namespace fs = std::filesystem;
using testing::cli::Outcome;
using testing::cli::RunOptions;
using testing::cli::Stderr;

class GenerateCli : public testing::cli::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    // Byte-level model (vocab 256), saved as a forge checkpoint. A large init scale spreads the logits so
    // that sampling has real choices and greedy decoding has clear winners.
    nlohmann::json config = small_config(256, 64);
    LlamaModel bytes(LlamaConfig::from_json(config, "bytes"), {DType::f32, nn::Recompute::none}, 0.5f);
    bytes.initialize(21);
    save_checkpoint((dir_ / "bytes").string(), bytes.params(), nullptr, {0, config, {}});

    // A Hugging Face folder with the LLaMA-3-style test tokenizer.
    const fs::path tokenizer_file = fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "llama3_style.tokenizer.json";
    const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_file);
    const fs::path hf = dir_ / "hf";
    fs::create_directories(hf);
    config = small_config(tokenizer.vocab_size(), 64);
    LlamaModel model(LlamaConfig::from_json(config, "hf"), {DType::f32, nn::Recompute::none}, 0.5f);
    model.initialize(22);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (int i = 0; i < model.params().count(); ++i)
      tensors.push_back({model.params().info(i).name, model.params().param(i)});
    write_safetensors((hf / "model.safetensors").string(), tensors);
    std::ofstream(hf / "config.json") << config.dump(2);
    fs::copy_file(tokenizer_file, hf / "tokenizer.json");
  }

  static nlohmann::json small_config(int64_t vocab, int64_t positions) {
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_size", 32},
            {"intermediate_size", 64},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"rms_norm_eps", 1e-5},
            {"vocab_size", vocab},
            {"max_position_embeddings", positions},
            {"tie_word_embeddings", false}};
  }

  // How these tests run the binary: stdout and stderr apart, `input` (if any) piped to stdin. One thread:
  // the models are toys, and a loaded machine makes OpenMP barriers the slowest part.
  RunOptions options(std::optional<std::string> input = std::nullopt) const {
    return {.stderr_to = Stderr::apart,
            .input = std::move(input),
            .environment = "OMP_NUM_THREADS=1",
            .scratch_dir = dir_};
  }
  Outcome run(const std::string& args, std::optional<std::string> input = std::nullopt) const {
    return testing::cli::run_forge(args, options(std::move(input)));
  }
  // stdin is empty, so that a command missing its prompt cannot wait on the terminal.
  void expect_one_line_error(const std::string& args, const std::string& culprit) const {
    testing::cli::expect_one_line_error(args, culprit, options(""));
  }
  std::string model(const std::string& name) const { return " --model " + (dir_ / name).string(); }

  // The library's continuation of `prompt` by the byte model, as text.
  std::string byte_continuation(const std::string& prompt, SamplingOptions options) {
    auto model = load_pretrained_model(dir_ / "bytes", {DType::f32, nn::Recompute::none});
    std::vector<int32_t> ids(prompt.begin(), prompt.end());
    for (auto& id : ids) id &= 0xff;
    std::string bytes;
    for (int32_t t : generate_sequence(*model, ids, options).tokens) bytes.push_back(static_cast<char>(t));
    return tokenizer_text::utf8_lossy(bytes);
  }
};

std::string with_newline(std::string text) {
  return text.empty() || text.back() != '\n' ? text + "\n" : text;
}

TEST_F(GenerateCli, GreedyTextEqualsTheLibrarysAndReportsSpeeds) {
  Outcome o = run("generate" + model("bytes") + " --prompt Hello --greedy --max-new-tokens 20");
  ASSERT_EQ(o.status, 0) << o.err;
  SamplingOptions greedy;
  greedy.temperature = 0, greedy.max_new_tokens = 20;
  EXPECT_EQ(o.output, with_newline("Hello" + byte_continuation("Hello", greedy)));
  // One final line: prompt tokens, prefill speed, generated tokens, decode speed.
  EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1) << o.err;
  EXPECT_NE(o.err.find("prompt 5 tokens, prefill "), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("generated 20 tokens, decode "), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("tokens/s"), std::string::npos) << o.err;
  // --top-k 1 is greedy too.
  EXPECT_EQ(
      run("generate" + model("bytes") + " --prompt Hello --top-k 1 --temperature 1.3 --max-new-tokens 20")
          .output,
      o.output);
}

// --image on a LLaVA checkpoint that carries its preprocessor_config.json (as the trainer's do): the caption
// equals the library's generation from the image preprocessed by that config; without the file, or with an
// image that does not decode, one line names what is missing.
TEST_F(GenerateCli, CaptionsAnImageWithTheCheckpointsImageProcessor) {
  toy::write_llava_toy_inputs(dir_);  // dir_/shapes (16x16 images, 2x2 patches) and dir_/llava.json
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(dir_ / "llava.json"));
  const fs::path llava = dir_ / "llava";
  {
    auto built = build_model(*read_model_config((dir_ / "llava.json").string()),
                             {DType::f32, nn::Recompute::none}, StageSpec::whole(), 0.5f);
    built->initialize(23);
    save_checkpoint(llava.string(), built->params(), nullptr, {0, config, {}});
  }
  fs::copy_file(dir_ / "shapes" / "preprocessor_config.json", llava / "preprocessor_config.json");
  const fs::path image = dir_ / "shapes" / "images" / "000000.png";
  const std::string args = "generate" + model("llava") + " --tokenizer bytes --greedy --max-new-tokens 12" +
                           " --no-stream --prompt '' --image " + image.string();
  const Outcome o = run(args);
  ASSERT_EQ(o.status, 0) << o.err;

  auto loaded = load_pretrained_model(llava, {DType::f32, nn::Recompute::none});
  const ImageProcessor processor(ImageProcessorConfig::from_json_file(llava / "preprocessor_config.json"));
  const Tensor pixels = processor.preprocess(read_image(image));
  std::vector<int32_t> ids(4, 256);  // 2x2 patches of 8x8
  ids.push_back('\n');
  SamplingOptions greedy;
  greedy.temperature = 0, greedy.max_new_tokens = 12, greedy.pixels = pixels.f32(), greedy.images = 1;
  std::string bytes;
  for (int32_t t : generate_sequence(*loaded, ids, greedy).tokens) bytes.push_back(static_cast<char>(t));
  EXPECT_EQ(o.output, with_newline(tokenizer_text::utf8_lossy(bytes)));

  // A corrupt image and a checkpoint without its image processor are refused with one line.
  std::ofstream(dir_ / "broken.png") << "\x89PNG\r\n\x1a\n not really";
  expect_one_line_error("generate" + model("llava") + " --tokenizer bytes --prompt '' --image " +
                            (dir_ / "broken.png").string(),
                        "broken.png");
  fs::remove(llava / "preprocessor_config.json");
  expect_one_line_error(args, "--image-processor");
}

// Sampling at a high temperature emits bytes >= 0x80, some of which form multi-byte characters: streaming
// must print exactly what --no-stream prints, as valid UTF-8, and a seed must reproduce it.
// --device cuda on the host under FORGE_EMULATE_DEVICE=1 (kernels/emulated_device.h: the CPU kernels, device
// memory closed to host code): the GPU path (weights staged to the device, the KV cache there, logits copied
// back) prints the CPU's text.
TEST_F(GenerateCli, DevicePathUnderEmulationPrintsTheCpusText) {
  RunOptions emulated = options();
  emulated.environment += " FORGE_EMULATE_DEVICE=1";
  const std::string args =
      "generate" + model("bytes") + " --prompt Hello --greedy --max-new-tokens 12 --dtype fp32";
  const Outcome cpu = run(args), device = testing::cli::run_forge(args + " --device cuda", emulated);
  ASSERT_EQ(cpu.status, 0) << cpu.err;
  ASSERT_EQ(device.status, 0) << device.err;
  EXPECT_NE(device.err.find("cuda is emulated on the host"), std::string::npos) << device.err;
  EXPECT_EQ(device.output, cpu.output);
}

TEST_F(GenerateCli, StreamingPrintsWhatNoStreamPrintsAndSeedsReproduce) {
  const std::string prompt = "na\xC3\xAFve \xE2\x9C\x93";  // "naïve ✓"
  const std::string args = "generate" + model("bytes") + " --prompt '" + prompt +
                           "' --temperature 1.5 --top-k 0 --top-p 0.98 --max-new-tokens 50 --seed 11";
  Outcome streamed = run(args), whole = run(args + " --no-stream");
  ASSERT_EQ(streamed.status, 0) << streamed.err;
  EXPECT_EQ(streamed.output, whole.output);
  EXPECT_EQ(streamed.output.rfind(prompt, 0), 0u);
  EXPECT_EQ(tokenizer_text::find_invalid_utf8(streamed.output), std::string::npos);
  SamplingOptions o;
  o.temperature = 1.5, o.top_k = 0, o.top_p = 0.98, o.max_new_tokens = 50, o.seed = 11;
  EXPECT_EQ(streamed.output, with_newline(prompt + byte_continuation(prompt, o)));
  EXPECT_NE(run(args + " --seed 12").output, streamed.output);
}

TEST_F(GenerateCli, ReadsThePromptFromStdin) {
  const std::string input = "Hello\n";  // echo's newline is not part of the prompt
  Outcome piped = run("generate" + model("bytes") + " --greedy --max-new-tokens 12", input);
  ASSERT_EQ(piped.status, 0) << piped.err;
  EXPECT_EQ(piped.output,
            run("generate" + model("bytes") + " --prompt Hello --greedy --max-new-tokens 12").output);
}

TEST_F(GenerateCli, StopsWithANoteWhenTheContextIsFull) {
  const std::string prompt(60, 'a');  // 64 positions: room for 4 more
  Outcome o = run("generate" + model("bytes") + " --prompt " + prompt + " --greedy --max-new-tokens 30");
  ASSERT_EQ(o.status, 0) << o.err;
  EXPECT_NE(o.err.find("forge: note: generation stopped after 4 tokens: the context of 64 positions is full"),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("generated 4 tokens"), std::string::npos) << o.err;
}

// The Hugging Face folder: the prompt is encoded with BOS, the text decoded without special tokens, and an
// eos_token_id from generation_config.json ends generation.
TEST_F(GenerateCli, TokenizerBosAndEndOfSequence) {
  const Tokenizer tokenizer = Tokenizer::from_file(dir_ / "hf" / "tokenizer.json");
  auto lm = load_pretrained_model(dir_ / "hf", {DType::f32, nn::Recompute::none});
  const std::string prompt = "the quick brown fox";
  const std::vector<int32_t> ids = tokenizer.encode(prompt, true);
  ASSERT_EQ(ids.front(), *tokenizer.bos_id());
  SamplingOptions greedy;
  greedy.temperature = 0, greedy.max_new_tokens = 8;
  if (auto eos = tokenizer.eos_id()) greedy.stop_tokens = {*eos};
  const GenerationResult free_run = generate_sequence(*lm, ids, greedy);

  const std::string args =
      "generate" + model("hf") + " --prompt '" + prompt + "' --greedy --max-new-tokens 8";
  Outcome o = run(args);
  ASSERT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(o.output, with_newline(prompt + tokenizer.decode(free_run.tokens, true)));
  EXPECT_NE(o.err.find("prompt " + std::to_string(ids.size()) + " tokens"), std::string::npos) << o.err;

  // Make the third greedy token an end-of-sequence id: generation stops there, and the id is not printed.
  ASSERT_GE(free_run.tokens.size(), 3u);
  const int32_t stop = free_run.tokens[2];
  std::ofstream(dir_ / "hf" / "generation_config.json")
      << nlohmann::json{{"eos_token_id", {999, stop}}}.dump();
  greedy.stop_tokens.push_back(999);
  greedy.stop_tokens.push_back(stop);
  const GenerationResult stopped = generate_sequence(*lm, ids, greedy);
  ASSERT_EQ(stopped.stop, StopReason::stop_token);
  o = run(args);
  ASSERT_EQ(o.status, 0) << o.err;
  std::vector<int32_t> shown = stopped.tokens;
  shown.pop_back();
  EXPECT_EQ(o.output, with_newline(prompt + tokenizer.decode(shown, true)));
  EXPECT_NE(o.err.find("generated " + std::to_string(stopped.tokens.size()) + " tokens"), std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("stopped at end-of-sequence"), std::string::npos) << o.err;

  std::ofstream(dir_ / "hf" / "generation_config.json") << R"({"eos_token_id": 5000})";
  expect_one_line_error(args, "generation_config.json: eos_token_id 5000");
  std::ofstream(dir_ / "hf" / "generation_config.json") << R"({"eos_token_id": 1, "eos_token_id": 2})";
  expect_one_line_error(args, "generation_config.json: key 'eos_token_id' appears twice");
}

// --messages: the conversation rendered with the folder's chat template and its generation prompt, encoded
// without added special tokens, answered greedily as the library answers those ids; the template's
// eos_token stops it.
TEST_F(GenerateCli, AnswersAConversationThroughTheChatTemplate) {
  const Tokenizer tokenizer = Tokenizer::from_file(dir_ / "hf" / "tokenizer.json");
  std::ofstream(dir_ / "hf" / "tokenizer_config.json")
      << R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"})";
  std::ofstream(dir_ / "chat.json")
      << R"({"messages": [{"role": "user", "content": "the quick brown fox"}]})";
  const std::string rendered = "<|begin_of_text|>user: the quick brown fox\nassistant:";
  const std::vector<int32_t> ids = tokenizer.encode(rendered, false);
  ASSERT_EQ(ids.front(), *tokenizer.bos_id());  // the template's BOS, not one added by the tokenizer
  auto lm = load_pretrained_model(dir_ / "hf", {DType::f32, nn::Recompute::none});
  SamplingOptions greedy;
  greedy.temperature = 0, greedy.max_new_tokens = 6;
  if (auto eos = tokenizer.eos_id()) greedy.stop_tokens = {*eos};
  const GenerationResult answer = generate_sequence(*lm, ids, greedy);
  const std::string args = "generate" + model("hf") + " --messages " + (dir_ / "chat.json").string() +
                           " --greedy --max-new-tokens 6";
  Outcome o = run(args);
  ASSERT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(o.output, with_newline(rendered + tokenizer.decode(answer.tokens, true)));
  EXPECT_NE(o.err.find("prompt " + std::to_string(ids.size()) + " tokens"), std::string::npos) << o.err;
  expect_one_line_error(args + " --prompt x", "--messages");
  std::ofstream(dir_ / "bad.json") << "[{";
  expect_one_line_error("generate" + model("hf") + " --messages " + (dir_ / "bad.json").string(), "bad.json");
}

TEST_F(GenerateCli, BadInputGetsOneErrorLine) {
  const std::string bytes = "generate" + model("bytes");
  expect_one_line_error("generate --model " + (dir_ / "missing").string() + " --prompt hi", "missing");
  expect_one_line_error(bytes + " --prompt ''", "prompt is empty");
  const std::string empty;
  Outcome o = run(bytes, empty);  // nothing on stdin
  EXPECT_EQ(o.status, 1);
  EXPECT_NE(o.err.find("prompt is empty"), std::string::npos) << o.err;
  expect_one_line_error(bytes + " --prompt " + std::string(70, 'a'),
                        "does not fit the context of 64 positions");
  expect_one_line_error(bytes + " --prompt hi --top-p 1.5", "top-p must be in (0, 1]");
  expect_one_line_error(bytes + " --prompt hi --top-p 0", "top-p");
  expect_one_line_error(bytes + " --prompt hi --temperature -1", "temperature");
  expect_one_line_error(bytes + " --prompt hi --top-k -2", "top-k");
  expect_one_line_error(bytes + " --prompt hi --max-new-tokens 0", "--max-new-tokens");
  if (!device_usable(Device::cuda))
    expect_one_line_error(bytes + " --prompt hi --device cuda", "--device cuda, but no usable GPU");
  // The error lists exactly the dtypes the option accepts (it used to list fp16, fp8_e4m3, int32, ...).
  expect_one_line_error(bytes + " --prompt hi --dtype fp8", "--dtype: fp8 not in {fp32,bf16}");
  expect_one_line_error(bytes + " --prompt hi --dtype fp16", "--dtype: fp16 not in {fp32,bf16}");
  expect_one_line_error(bytes + " --prompt hi --tokenizer " + (dir_ / "none.json").string(), "none.json");
  // --image: a text model has no encoder.
  expect_one_line_error(bytes + " --prompt hi --image " + (dir_ / "cat.png").string(),
                        "--image needs a multimodal model");
  // A 1000-token vocabulary without a tokenizer.json cannot fall back to bytes.
  fs::remove(dir_ / "hf" / "tokenizer.json");
  expect_one_line_error("generate" + model("hf") + " --prompt hi", "pass --tokenizer");
}

}  // namespace
}  // namespace forge::generate_cli_test
