// forge eval: mean next-token loss and perplexity of a pretrained model (a Hugging Face folder or a forge
// checkpoint) on a Megatron indexed dataset; or, for a multimodal model, the answer loss on image-text data
// (--images) and how many of its answers the model gives exactly right (--captions).
//
// Text:
// The dataset's documents are read in order as one token stream of N tokens. Sequence k holds inputs
// stream[k*T, k*T + T) and targets stream[k*T + 1, k*T + T], so consecutive sequences overlap by one
// token and every token after the first is predicted exactly once. The last sequence may be partial
// (fewer than T targets): its missing positions are padded and excluded from the loss, so the N - 1
// predictions are all counted (unless --max-sequences stops earlier). Each sequence starts with an empty
// context: tokens are predicted from at most T - 1 tokens before them within their sequence.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/image/image_text.h"
#include "forge/data/text/gpt_dataset.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/data/tokenizer/tokenizer.h"
#include "forge/data/tokenizer/tokenizer_text.h"
#include "forge/models/captions.h"
#include "forge/models/pretrained.h"

namespace forge::cli {
using namespace forge::models;
using namespace forge::data;
namespace {

namespace fs = std::filesystem;

struct EvalOptions {
  std::string model, data, dtype = "fp32", images, image_processor, tokenizer;
  int64_t seq_len = 0, batch_size = 8, max_sequences = 0, captions = 0;
  bool json = false;
  models::SeriesReading reading;
};

// --images: the answer loss over the samples of a JSONL (captions or conversations) or packed image-text
// file, and with --captions N the first N samples answered greedily.
int run_image_eval(const EvalOptions& o, DType dtype) {
  const auto start = std::chrono::steady_clock::now();
  PretrainedDir source;
  std::unique_ptr<Model> model =
      load_pretrained_model(o.model, {dtype, nn::Recompute::none}, o.reading, &source);
  say_source("eval", source);
  const std::optional<ImageInput> image = model->config().image_input();
  if (!image)
    fail("eval: --images needs a multimodal model (LlavaForConditionalGeneration); {} is a {}", o.model,
         model->config().architecture());
  const ModelShape shape = model->config().shape();
  if (o.seq_len > shape.max_positions)
    fail("eval: --seq-len {} exceeds the model's max_position_embeddings {}", o.seq_len, shape.max_positions);
  const fs::path dir = source.dir, images = o.images;
  if (!fs::exists(images)) fail("eval: --images '{}' does not exist", o.images);
  // The image processor: given, else the model's (a trainer's checkpoint carries it), else the data's.
  fs::path processor_path = o.image_processor;
  if (processor_path.empty())
    for (const fs::path& candidate :
         {dir / "preprocessor_config.json", images.parent_path() / "preprocessor_config.json"})
      if (fs::exists(candidate)) {
        processor_path = candidate;
        break;
      }
  if (processor_path.empty())
    fail(
        "eval: --images: no preprocessor_config.json beside the model ({}) or the data; pass "
        "--image-processor",
        dir.string());
  const ImageProcessor processor(ImageProcessorConfig::from_json_file(processor_path));
  // The text: --tokenizer FILE or bytes, else the model's tokenizer.json (as forge generate).
  std::optional<Tokenizer> tokenizer;
  if (o.tokenizer != "bytes") {
    const fs::path file = !o.tokenizer.empty() ? fs::path(o.tokenizer) : dir / "tokenizer.json";
    if (o.tokenizer.empty() && !fs::exists(file))
      fail(
          "eval: {} has no tokenizer.json: pass --tokenizer FILE (or --tokenizer bytes for a byte-level "
          "model)",
          dir.string());
    tokenizer.emplace(Tokenizer::from_file(file));
    if (tokenizer->vocab_size() > shape.vocab)
      fail("eval: tokenizer '{}' has {} tokens but the model's vocabulary holds {}", file.string(),
           tokenizer->vocab_size(), shape.vocab);
  } else if (shape.vocab < 256) {
    fail("eval: --tokenizer bytes: the model's vocabulary holds {} tokens, fewer than 256", shape.vocab);
  }
  const TextEncoder encoder = tokenizer ? TextEncoder::from_tokenizer(*tokenizer) : TextEncoder::bytes();
  const CaptionDecode decode = [&](std::span<const int32_t> ids) {
    if (tokenizer) return tokenizer->decode(ids);
    std::string text;
    for (int32_t id : ids) text.push_back(static_cast<char>(id));
    return tokenizer_text::utf8_lossy(text);  // a byte model may answer bytes that are no UTF-8
  };
  ImageTextOptions options;
  options.seq_len = o.seq_len, options.image_token_id = image->image_token;
  options.tokens_per_image = image->tokens_per_image;
  const ImageTextDataset data = [&] {
    if (!is_packed_image_text(images))
      return ImageTextDataset::from_jsonl(images, encoder, processor, options);
    PackedImageTextExpectation expect;
    expect.seq_len = options.seq_len, expect.image_token_id = options.image_token_id;
    expect.tokens_per_image = options.tokens_per_image, expect.text_fingerprint = encoder.fingerprint;
    return ImageTextDataset::from_packed(images, processor, expect);
  }();
  const auto [channels, height, width] = data.image_shape();
  if (channels != image->channels || height != image->height || width != image->width)
    fail("eval: {} makes {}x{}x{} images but the model's encoder takes {}x{}x{}", processor_path.string(),
         channels, height, width, image->channels, image->height, image->width);
  int64_t samples = data.num_samples();
  if (o.max_sequences > 0) samples = std::min(samples, o.max_sequences);

  LossSum total;
  const int64_t T = o.seq_len;
  for (int64_t first = 0; first < samples; first += o.batch_size) {
    const int64_t rows = std::min(o.batch_size, samples - first);
    std::vector<int64_t> indices(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) indices[static_cast<size_t>(r)] = first + r;
    const ImageTextDataset::Batch batch = data.batch(indices);
    const MicroBatch mb{batch.ids.i32(),
                        batch.targets.i32(),
                        rows,
                        T,
                        0.0f,
                        batch.pixels.numel() ? batch.pixels.f32() : nullptr,
                        data.count_images(indices)};
    const LossSum part = model->forward(mb, Tensor(), nullptr).loss;
    total.sum += part.sum, total.tokens += part.tokens;
  }
  const double loss = total.mean();
  if (!std::isfinite(loss))
    fail("eval: the loss of model '{}' on '{}' is not finite ({}) over {} answer tokens", o.model, o.images,
         loss, total.tokens);
  const double loss_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "eval %s on %s: answer loss %.6f nats/token, perplexity %.4f over %lld tokens of %lld samples (%s) in "
      "%.2f s\n",
      o.model.c_str(), o.images.c_str(), loss, std::exp(loss), static_cast<long long>(total.tokens),
      static_cast<long long>(samples), o.dtype.c_str(), loss_seconds);

  CaptionScore score;
  const auto caption_start = std::chrono::steady_clock::now();
  const int64_t to_caption = std::min(o.captions, data.num_samples());
  for (int64_t i = 0; i < to_caption; ++i) {
    const std::vector<int64_t> one = {i};
    const ImageTextDataset::Batch batch = data.batch(one);
    score.add(*model, i, batch.ids.i32(), batch.targets.i32(), T,
              batch.pixels.numel() ? batch.pixels.f32() : nullptr, data.count_images(one));
  }
  const double caption_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - caption_start).count();
  if (to_caption > 0) {
    std::printf("%s\n", caption_summary("captions", score, caption_seconds).c_str());
    for (const std::string& line : caption_lines(score, decode, 4)) std::printf("%s\n", line.c_str());
  }
  if (o.json) {
    nlohmann::ordered_json out = {{"loss", loss},           {"perplexity", std::exp(loss)},
                                  {"tokens", total.tokens}, {"samples", samples},
                                  {"seq_len", T},           {"dtype", o.dtype},
                                  {"seconds", loss_seconds}};
    if (to_caption > 0)
      out["captions"] = {{"count", score.count()},
                         {"exact", score.exact()},
                         {"token_accuracy", score.token_accuracy()},
                         {"seconds", caption_seconds},
                         {"examples", caption_examples_json(score, decode)}};
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  return 0;
}

int run_eval(const EvalOptions& o) {
  if (o.model.empty()) fail("eval: --model DIR is required (a Hugging Face folder or a forge checkpoint)");
  if (!o.data.empty() && !o.images.empty())
    fail("eval: pass --data (text) or --images (image-text), not both");
  if (o.data.empty() && o.images.empty())
    fail("eval: --data PREFIX (a Megatron indexed dataset) or --images FILE (image-text data) is required");
  if (o.captions < 0) fail("eval: --captions must be >= 0, got {}", o.captions);
  if (o.captions > 0 && o.images.empty()) fail("eval: --captions needs image-text data (--images)");
  if (o.seq_len < 1) fail("eval: --seq-len must be at least 1, got {}", o.seq_len);
  if (o.batch_size < 1) fail("eval: --batch-size must be at least 1, got {}", o.batch_size);
  if (o.max_sequences < 0) fail("eval: --max-sequences must be >= 0, got {}", o.max_sequences);
  const DType dtype = dtype_from_name(o.dtype);
  if (dtype != DType::f32 && dtype != DType::bf16)
    fail("eval: --dtype must be fp32 or bf16, got '{}'", o.dtype);
  if (!o.images.empty()) return run_image_eval(o, dtype);

  auto data = std::make_shared<const IndexedDataset>(o.data);
  const int64_t n = data->total_tokens();
  if (n < 2) fail("eval: dataset '{}' holds {} token(s); at least 2 are needed", o.data, n);
  const auto start = std::chrono::steady_clock::now();
  PretrainedDir source;
  std::unique_ptr<Model> model =
      load_pretrained_model(o.model, {dtype, nn::Recompute::none}, o.reading, &source);
  say_source("eval", source);
  const ModelShape config = model->config().shape();
  // The stream: every sequence of the dataset in order (GptDataset without shuffling reads epoch 0 in order);
  // a token outside the model's vocabulary is an error naming the .bin file, the document and the position.
  const GptDataset stream(data, {0, data->num_sequences()},
                          {.seq_len = o.seq_len,
                           .shuffle = false,
                           .vocab_size = config.vocab,
                           .vocab_name = "the model's vocabulary"});
  if (o.seq_len > config.max_positions)
    fail("eval: --seq-len {} exceeds the model's max_position_embeddings {}", o.seq_len,
         config.max_positions);

  const int64_t T = o.seq_len, predictions = n - 1;
  const int64_t full = predictions / T, tail = predictions % T;
  int64_t sequences = full + (tail > 0 ? 1 : 0);
  if (o.max_sequences > 0) sequences = std::min(sequences, o.max_sequences);

  LossSum total;
  std::vector<int32_t> window(static_cast<size_t>(T + 1));
  std::vector<int32_t> inputs, targets;
  for (int64_t first = 0; first < sequences; first += o.batch_size) {
    const int64_t rows = std::min(o.batch_size, sequences - first);
    inputs.assign(static_cast<size_t>(rows * T), 0);    // padding input: id 0 (its targets are ignored)
    targets.assign(static_cast<size_t>(rows * T), -1);  // -1: not counted
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t k = first + r, begin = k * T;
      const int64_t length = std::min(T, predictions - begin);  // targets in this sequence
      stream.read_stream(begin, length + 1, window.data());
      std::copy(window.begin(), window.begin() + length, inputs.begin() + r * T);
      std::copy(window.begin() + 1, window.begin() + length + 1, targets.begin() + r * T);
    }
    const LossSum part = model->forward_loss(inputs.data(), targets.data(), rows, T);
    total.sum += part.sum;
    total.tokens += part.tokens;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double loss = total.mean(), perplexity = std::exp(loss);
  // Finite weights can still overflow (huge values, an fp32 range exceeded in a matmul): a NaN or infinite
  // loss is no measurement, and a script reading the exit status must not take it for one.
  if (!std::isfinite(loss))
    fail(
        "eval: the loss of model '{}' on '{}' is not finite ({}) over {} tokens (its weights are finite, so "
        "the forward pass overflowed)",
        o.model, o.data, loss, total.tokens);
  const double tokens_per_s = seconds > 0 ? static_cast<double>(total.tokens) / seconds : 0.0;

  std::printf(
      "eval %s on %s: loss %.6f nats/token, perplexity %.4f over %lld tokens in %lld sequences of %lld "
      "(%s, batch %lld) in %.2f s, %.0f tokens/s\n",
      o.model.c_str(), o.data.c_str(), loss, perplexity, static_cast<long long>(total.tokens),
      static_cast<long long>(sequences), static_cast<long long>(T), o.dtype.c_str(),
      static_cast<long long>(o.batch_size), seconds, tokens_per_s);
  if (o.json) {
    const nlohmann::ordered_json out = {{"loss", loss},
                                        {"perplexity", perplexity},
                                        {"tokens", total.tokens},
                                        {"sequences", sequences},
                                        {"seq_len", T},
                                        {"batch_size", o.batch_size},
                                        {"dtype", o.dtype},
                                        {"seconds", seconds},
                                        {"tokens_per_s", tokens_per_s}};
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

}  // namespace

void add_eval_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<EvalOptions>();
  auto* eval = app.add_subcommand(
      "eval",
      "Mean next-token loss and perplexity of a model on a Megatron indexed dataset (.bin/.idx), or of a "
      "multimodal model's answers on image-text data (--images), with greedy answers scored (--captions)");
  eval->add_option("--model", o->model,
                   "Hugging Face folder (config.json + safetensors) or forge checkpoint");
  eval->add_option("--data", o->data, "dataset prefix (without .bin/.idx)");
  eval->add_option("--images", o->images,
                   "image-text data for a multimodal model: a JSONL of captions or conversations beside its "
                   "images, or a packed file (forge data preprocess-images); the loss is over the answers");
  eval->add_option("--image-processor", o->image_processor,
                   "with --images: the preprocessor_config.json (default: the model's, else the data's)");
  eval->add_option(
      "--tokenizer", o->tokenizer,
      "with --images: tokenizer.json or bytes (default: the model's tokenizer.json, else bytes)");
  eval->add_option("--captions", o->captions,
                   "with --images: answer the first N samples greedily and count the answers equal to their "
                   "reference")
      ->capture_default_str();
  eval->add_option("--seq-len", o->seq_len, "tokens per sequence (T)");
  eval->add_option("--batch-size", o->batch_size, "sequences per forward pass")->capture_default_str();
  eval->add_option("--max-sequences", o->max_sequences,
                   "evaluate only the first N sequences (with --images: samples; 0: all)")
      ->capture_default_str();
  // The choices listed are exactly those accepted (dtype_from_name alone would list fp16 or int32).
  eval->add_option("--dtype", o->dtype, "GEMM operands: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  eval->add_flag("--json", o->json, "also print the results as one JSON object (the last line)");
  add_series_reading_flag(eval, o->reading);
  eval->footer(
      "Text: the documents form one stream in order; sequence k reads tokens [k*T, k*T + T] (T inputs, T "
      "targets), so every token after the first is predicted once. A final partial sequence is padded "
      "and its padding is not counted. Image-text: each sample is one sequence of T tokens, its image "
      "tokens and prompt not counted.");
  commands.push_back({eval, [o] { return run_eval(*o); }});
}

}  // namespace forge::cli
