// forge eval: mean next-token loss and perplexity of a pretrained model (a Hugging Face folder or a forge
// checkpoint) on a Megatron indexed dataset.
//
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
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/models/pretrained.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/data/gpt_dataset.h"
#include "forge/data/indexed_dataset.h"

namespace forge::cli {
using namespace forge::models; using namespace forge::data;
namespace {

struct EvalOptions {
  std::string model, data, dtype = "fp32";
  int64_t seq_len = 0, batch_size = 8, max_sequences = 0;
  bool json = false;
};

int run_eval(const EvalOptions& o) {
  if (o.model.empty()) fail("eval: --model DIR is required (a Hugging Face folder or a forge checkpoint)");
  if (o.data.empty()) fail("eval: --data PREFIX is required (a Megatron indexed dataset)");
  if (o.seq_len < 1) fail("eval: --seq-len must be at least 1, got {}", o.seq_len);
  if (o.batch_size < 1) fail("eval: --batch-size must be at least 1, got {}", o.batch_size);
  if (o.max_sequences < 0) fail("eval: --max-sequences must be >= 0, got {}", o.max_sequences);
  const DType dtype = dtype_from_name(o.dtype);
  if (dtype != DType::f32 && dtype != DType::bf16)
    fail("eval: --dtype must be fp32 or bf16, got '{}'", o.dtype);

  auto data = std::make_shared<const IndexedDataset>(o.data);
  const int64_t n = data->total_tokens();
  if (n < 2) fail("eval: dataset '{}' holds {} token(s); at least 2 are needed", o.data, n);
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Model> model = load_pretrained_model(o.model, {dtype, nn::Recompute::none});
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
      "eval", "Mean next-token loss and perplexity of a model on a Megatron indexed dataset (.bin/.idx)");
  eval->add_option("--model", o->model,
                   "Hugging Face folder (config.json + safetensors) or forge checkpoint");
  eval->add_option("--data", o->data, "dataset prefix (without .bin/.idx)");
  eval->add_option("--seq-len", o->seq_len, "tokens per sequence (T)");
  eval->add_option("--batch-size", o->batch_size, "sequences per forward pass")->capture_default_str();
  eval->add_option("--max-sequences", o->max_sequences, "evaluate only the first N sequences (0: all)")
      ->capture_default_str();
  // The choices listed are exactly those accepted (dtype_from_name alone would list fp16 or int32).
  eval->add_option("--dtype", o->dtype, "GEMM operands: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  eval->add_flag("--json", o->json, "also print the results as one JSON object (the last line)");
  eval->footer(
      "The documents form one stream in order; sequence k reads tokens [k*T, k*T + T] (T inputs, T "
      "targets), so every token after the first is predicted once. A final partial sequence is padded "
      "and its padding is not counted.");
  commands.push_back({eval, [o] { return run_eval(*o); }});
}

}  // namespace forge::cli
