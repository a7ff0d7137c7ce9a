// forge generate: continue a prompt with a pretrained model (a Hugging Face folder or a forge checkpoint),
// decoding with a KV cache (src/forge/models/sampling.h): greedy or temperature / top-k / top-p sampling,
// seeded. The prompt and its continuation go to stdout as they are produced; stderr gets the speeds.
//
// Text: --tokenizer FILE, else DIR/tokenizer.json, else, for a 256-token vocabulary, bytes (token = byte).
// The prompt is encoded with the tokenizer's special tokens (BOS). Generation stops at max-new-tokens, at an
// end-of-sequence token (the tokenizer's and generation_config.json's eos_token_id), or when the context
// (max_position_embeddings) is full.
//
// Chat: --messages FILE renders a conversation with the model's chat template (or --chat-template) and its
// generation prompt, as transformers' apply_chat_template(add_generation_prompt=True), encodes it without
// adding special tokens (the template writes them) and stops at the template's eos_token too.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/tokenizer/chat_template.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "forge/models/pretrained.h"
#include "forge/models/sampling.h"

namespace forge::cli {
using namespace forge::models;
using namespace forge::data;
namespace {
namespace fs = std::filesystem;

struct GenerateOptions {
  std::string model, tokenizer, prompt, dtype = "fp32", device = "cpu", image, image_processor, messages,
                                        chat_template;
  bool prompt_given = false, greedy = false, no_stream = false;
  int64_t max_new_tokens = 128, top_k = 40;
  double temperature = 0.8, top_p = 1.0;
  uint64_t seed = 7;
  models::SeriesReading reading;
  fs::path model_dir;  // the folder the model was read from (a series' step folder)
};

// Text <-> tokens: a Hugging Face tokenizer, or bytes for a byte-level model.
class TextCodec {
 public:
  TextCodec(const GenerateOptions& o, const fs::path& model_dir, int64_t vocab) {
    fs::path file = o.tokenizer == "bytes" ? fs::path() : fs::path(o.tokenizer);
    if (file.empty() && o.tokenizer.empty() && fs::exists(model_dir / "tokenizer.json"))
      file = model_dir / "tokenizer.json";
    if (o.tokenizer == "bytes") {
      if (vocab < 256)
        fail("--tokenizer bytes: the model's vocabulary holds {} tokens, fewer than 256", vocab);
    } else if (!file.empty()) {
      tokenizer_.emplace(Tokenizer::from_file(file));
      if (tokenizer_->vocab_size() > vocab)
        fail("tokenizer '{}' has {} tokens but the model's vocabulary holds {}", file.string(),
             tokenizer_->vocab_size(), vocab);
    } else if (vocab != 256) {
      fail(
          "{} has no tokenizer.json and its vocabulary ({} tokens) is not byte-level (256): pass --tokenizer "
          "FILE (or --tokenizer bytes)",
          model_dir.string(), vocab);
    }
  }
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens = true) const {
    if (tokenizer_) return tokenizer_->encode(text, add_special_tokens);
    return {reinterpret_cast<const uint8_t*>(text.data()),
            reinterpret_cast<const uint8_t*>(text.data()) + text.size()};
  }
  // Text of generated tokens (special tokens left out), with ill-formed UTF-8 shown as U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const {
    if (tokenizer_) return tokenizer_->decode(ids, /*skip_special_tokens=*/true);
    std::string bytes;
    for (int32_t id : ids) bytes.push_back(static_cast<char>(id));
    return tokenizer_text::utf8_lossy(bytes);
  }
  std::optional<int32_t> eos_id() const { return tokenizer_ ? tokenizer_->eos_id() : std::nullopt; }
  std::optional<int32_t> token_id(const std::string& token) const {
    return tokenizer_ ? tokenizer_->token_to_id(token) : std::nullopt;
  }
  int64_t vocab_size() const { return tokenizer_ ? tokenizer_->vocab_size() : 256; }

 private:
  std::optional<Tokenizer> tokenizer_;
};

// eos_token_id (an id or a list of ids) from DIR/generation_config.json, if the file exists.
std::vector<int32_t> generation_config_eos(const fs::path& dir, int64_t vocab) {
  const fs::path file = dir / "generation_config.json";
  if (!fs::exists(file)) return {};
  // Strict: a key given twice (two eos_token_id) is refused rather than resolved to the last.
  nlohmann::json json = parse_json_strict(read_file(file, "generation config"), file.string());
  if (!json.is_object()) fail("{}: not a JSON object", file.string());
  if (!json.contains("eos_token_id") || json["eos_token_id"].is_null()) return {};
  const nlohmann::json& eos = json["eos_token_id"];
  std::vector<int32_t> ids;
  for (const auto& id : eos.is_array() ? eos : nlohmann::json::array({eos})) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab)
      fail("{}: eos_token_id {} is not a token id of the model's vocabulary [0, {})", file.string(),
           id.dump(), vocab);
    ids.push_back(id.get<int32_t>());
  }
  return ids;
}

// A multimodal prompt: the image preprocessed as the model's image processor does, and the prompt's ids with
// the image's tokens where "<image>" stands (or, without one, before the text: "<image>\n" + prompt).
struct ImagePrompt {
  Tensor pixels;  // [3, height, width]
  std::vector<int32_t> ids;
};

ImagePrompt image_prompt(const GenerateOptions& o, Model& model, const TextCodec& codec,
                         const std::string& prompt) {
  const std::optional<ImageInput> image = model.config().image_input();
  if (!image)
    fail("generate: --image needs a multimodal model (LlavaForConditionalGeneration); {} is {}", o.model,
         model.config().architecture());
  fs::path processor = o.image_processor;
  if (processor.empty()) processor = o.model_dir / "preprocessor_config.json";
  if (!fs::exists(processor))
    fail("generate: --image: no image processor at {}; pass --image-processor preprocessor_config.json",
         processor.string());
  const ImageProcessor images(ImageProcessorConfig::from_json_file(processor));
  ImagePrompt out;
  out.pixels = images.preprocess(read_image(o.image));
  if (out.pixels.numel() != image->channels * image->height * image->width)
    fail("generate: {} makes {} values of the image; the encoder takes {}x{}x{}", processor.string(),
         out.pixels.numel(), image->channels, image->height, image->width);
  const std::string text = prompt.find("<image>") == std::string::npos ? "<image>\n" + prompt : prompt;
  const size_t at = text.find("<image>");
  if (text.find("<image>", at + 1) != std::string::npos)
    fail("generate: the prompt holds more than one <image>");
  out.ids = codec.encode(text.substr(0, at));
  out.ids.insert(out.ids.end(), static_cast<size_t>(image->tokens_per_image), image->image_token);
  const std::string after = text.substr(at + 7);
  if (!after.empty()) {
    std::vector<int32_t> rest = codec.encode(after);
    out.ids.insert(out.ids.end(), rest.begin(), rest.end());
  }
  return out;
}

std::string read_prompt(const GenerateOptions& o) {
  if (o.prompt_given) return o.prompt;
  if (!o.image.empty() && ::isatty(STDIN_FILENO)) return "";  // an image alone: describe it
  if (::isatty(STDIN_FILENO)) fail("generate: no prompt: pass --prompt TEXT or pipe the text on stdin");
  std::ostringstream buffer;
  buffer << std::cin.rdbuf();
  std::string text = buffer.str();
  // `echo text | forge generate` continues "text", not the newline echo adds.
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  return text;
}

// stdout, flushed at every write, remembering whether the text so far ends a line.
class Output {
 public:
  void write(std::string_view text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    ends_line_ = text.back() == '\n';
  }
  bool ends_line() const { return ends_line_; }

 private:
  bool ends_line_ = true;
};

// Streams the continuation as tokens arrive: each time, the text of all generated tokens is decoded and the
// part not yet printed goes out, except a trailing U+FFFD, which may be a multi-byte character whose
// remaining bytes are still to come (it is printed once more tokens settle it, or at the end).
class Streamer {
 public:
  Streamer(const TextCodec& codec, const std::vector<int32_t>& stop, Output& out)
      : codec_(codec), stop_(stop), out_(out) {}
  void add(int32_t token) {
    if (std::find(stop_.begin(), stop_.end(), token) == stop_.end()) tokens_.push_back(token);
  }
  void flush(bool final) {
    std::string text = codec_.decode(tokens_);
    static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
    size_t end = text.size();
    if (!final)
      while (end >= printed_ + kReplacement.size() &&
             std::string_view(text).substr(end - kReplacement.size(), kReplacement.size()) == kReplacement)
        end -= kReplacement.size();
    if (end > printed_) out_.write(std::string_view(text).substr(printed_, end - printed_));
    printed_ = std::max(printed_, end);
  }

 private:
  const TextCodec& codec_;
  const std::vector<int32_t>& stop_;
  Output& out_;
  std::vector<int32_t> tokens_;
  size_t printed_ = 0;
};

int run_generate(GenerateOptions o) {
  if (o.model.empty())
    fail("generate: --model DIR is required (a Hugging Face folder or a forge checkpoint)");
  if (o.max_new_tokens < 1) fail("generate: --max-new-tokens must be at least 1, got {}", o.max_new_tokens);
  SamplingOptions sampling;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.temperature = o.greedy ? 0.0 : o.temperature;
  sampling.top_k = o.top_k, sampling.top_p = o.top_p, sampling.seed = o.seed;
  validate_sampling_options(sampling);
  const DType dtype = dtype_from_name(o.dtype);
  if (dtype != DType::f32 && dtype != DType::bf16)
    fail("generate: --dtype must be fp32 or bf16, got '{}'", o.dtype);
  if (!o.messages.empty() && (o.prompt_given || !o.image.empty()))
    fail("generate: --messages renders the prompt from a conversation; leave out --prompt and --image");
  std::string prompt = o.messages.empty() ? read_prompt(o) : std::string();
  if (prompt.empty() && o.image.empty() && o.messages.empty()) fail("generate: the prompt is empty");

  nn::ComputeOptions compute{dtype, nn::Recompute::none};
  compute.device = device_from_name(o.device);
  if (compute.device != Device::cpu && !device_usable(compute.device))
    fail("generate: --device {}, but no usable GPU (or no CUDA backend)", o.device);
  PretrainedDir source;
  std::unique_ptr<Model> model = load_pretrained_model(o.model, compute, o.reading, &source);
  say_source("generate", source);
  o.model_dir = source.dir;
  const int64_t vocab = model->config().shape().vocab;
  const TextCodec codec(o, o.model_dir, vocab);
  std::vector<int32_t> stop = generation_config_eos(o.model_dir, vocab);
  if (auto eos = codec.eos_id(); eos && std::find(stop.begin(), stop.end(), *eos) == stop.end())
    stop.push_back(*eos);
  std::vector<int32_t> ids;
  if (!o.messages.empty()) {
    const ChatTemplate chat =
        ChatTemplate::from_path(o.chat_template.empty() ? o.model_dir : fs::path(o.chat_template));
    nlohmann::ordered_json conversation;
    try {
      conversation = nlohmann::ordered_json::parse(read_file(o.messages, "--messages"));
    } catch (const nlohmann::ordered_json::parse_error& e) {
      fail("generate: --messages {} is not valid JSON: {}", o.messages, e.what());
    }
    ChatOptions options;
    options.add_generation_prompt = true;
    if (conversation.is_object()) {  // {"messages": [...], "tools": [...]}
      if (!conversation.contains("messages")) fail("generate: --messages {} has no 'messages'", o.messages);
      if (conversation.contains("tools")) options.tools = conversation["tools"];
      conversation = nlohmann::ordered_json(conversation["messages"]);
    }
    prompt = chat.render(conversation, options).text;
    ids = codec.encode(prompt, /*add_special_tokens=*/false);
    const auto& special = chat.special_tokens();
    if (special.contains("eos_token"))
      if (const auto id = codec.token_id(special["eos_token"].get<std::string>());
          id && std::find(stop.begin(), stop.end(), *id) == stop.end())
        stop.push_back(*id);
  }
  sampling.stop_tokens = stop;
  sampling.vocab_limit = codec.vocab_size();
  Tensor pixels;
  if (o.messages.empty() && o.image.empty()) {
    ids = codec.encode(prompt);
  } else if (o.messages.empty()) {
    ImagePrompt p = image_prompt(o, *model, codec, prompt);
    ids = std::move(p.ids), pixels = std::move(p.pixels);
    sampling.pixels = pixels.f32(), sampling.images = 1;
  }

  // The prompt is echoed with the first token (or at the end), so that a refused prompt prints nothing.
  Output out;
  Streamer streamer(codec, stop, out);
  bool prompt_written = false;
  sampling.on_token = [&](int32_t token) {
    streamer.add(token);
    if (o.no_stream) return;
    if (!prompt_written) out.write(prompt), prompt_written = true;
    streamer.flush(false);
  };
  const GenerationResult result = generate_sequence(*model, ids, sampling);
  if (!prompt_written) out.write(prompt);
  streamer.flush(true);
  if (!out.ends_line()) out.write("\n");

  if (!result.note().empty()) std::fprintf(stderr, "forge: note: %s\n", result.note().c_str());
  const auto rate = [](double tokens, double seconds) { return seconds > 0 ? tokens / seconds : 0.0; };
  const auto generated = static_cast<double>(result.tokens.size());
  std::fprintf(
      stderr,
      "prompt %lld tokens, prefill %.1f tokens/s | generated %lld tokens, decode %.1f tokens/s (%s%s)\n",
      static_cast<long long>(result.prompt_tokens),
      rate(static_cast<double>(result.prompt_tokens), result.prefill_seconds),
      static_cast<long long>(result.tokens.size()), rate(generated, result.decode_seconds), o.dtype.c_str(),
      result.stop == StopReason::stop_token ? ", stopped at end-of-sequence" : "");
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<GenerateOptions>();
  auto* generate =
      app.add_subcommand("generate", "Continue a prompt with a pretrained model (" + models::family_names() +
                                         "; KV-cache decoding; greedy, temperature, top-k, top-p)");
  generate->add_option("--model", o->model,
                       "Hugging Face folder (config.json + safetensors) or forge checkpoint");
  generate->add_option(
      "--tokenizer", o->tokenizer,
      "tokenizer.json, or bytes (default: DIR/tokenizer.json; bytes for a 256-token vocabulary)");
  generate->add_option(
      "--image", o->image,
      "an image (JPEG or PNG) for a multimodal model: its tokens go where the prompt says "
      "<image>, else before the prompt (\"<image>\\n\" + prompt); the prompt may then be empty");
  generate->add_option("--image-processor", o->image_processor,
                       "with --image: the preprocessor_config.json (default: DIR/preprocessor_config.json)");
  auto* prompt = generate->add_option("--prompt", o->prompt, "text to continue (default: read from stdin)");
  generate->add_option(
      "--messages", o->messages,
      "a conversation (JSON: the messages' array, or an object with 'messages' and 'tools') to "
      "answer: rendered with the model's chat template and its generation prompt");
  generate->add_option(
      "--chat-template", o->chat_template,
      "with --messages: a folder, tokenizer_config.json or .jinja file (default: the model's)");
  generate->add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate at most")
      ->capture_default_str();
  generate->add_option("--temperature", o->temperature, "softmax temperature (0 = greedy)")
      ->capture_default_str();
  generate->add_option("--top-k", o->top_k, "sample among the k most likely tokens (0 = all)")
      ->capture_default_str();
  generate
      ->add_option("--top-p", o->top_p, "nucleus: the most likely tokens holding this much mass, in (0, 1]")
      ->capture_default_str();
  generate->add_option("--seed", o->seed, "sampling seed (the same seed gives the same text)")
      ->capture_default_str();
  generate->add_flag("--greedy", o->greedy, "always take the most likely token (temperature 0)");
  add_series_reading_flag(generate, o->reading);
  // The choices listed are exactly those accepted (dtype_from_name alone would list fp16 or int32).
  generate->add_option("--dtype", o->dtype, "GEMM operands: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  generate->add_option("--device", o->device, "where the model runs: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  generate->add_flag("--no-stream", o->no_stream,
                     "print the text once generation ends instead of as it goes");
  generate->footer(
      "Sampling applies temperature, then top-k, then top-p (Hugging Face's order). Generation stops after "
      "--max-new-tokens, at an end-of-sequence token (the tokenizer's, and generation_config.json's "
      "eos_token_id), or when the context (max_position_embeddings) is full. stderr gets the prompt and "
      "generated token counts with prefill and decode speeds.");
  commands.push_back({generate, [o, prompt] {
                        o->prompt_given = prompt->count() > 0;
                        return run_generate(*o);
                      }});
}

}  // namespace forge::cli
