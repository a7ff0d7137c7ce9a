// Byte-level BPE on the King James Bible (4.3 MB): single-thread encode throughput in MB/s of input
// text with a 4096-token GPT-2-style tokenizer trained by forge, with the word cache warm (steady state)
// and cold (a freshly loaded tokenizer), and the training time itself. bench/run_all.sh sets these
// beside Hugging Face tokenizers (the Rust library, through its Node binding) on the same text.
// The text comes from data/kjv.txt under the working directory (written by `make run`), or from the
// `bible` program if that cache is missing; FORGE_BENCH_TOKENIZER names a tokenizer.json to use instead
// of training one.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <memory>

#include "forge/data/tokenizer/bpe_trainer.h"
#include "forge/data/text/text_corpus.h"
#include "forge/data/tokenizer/tokenizer.h"

namespace forge {
using namespace forge::data;
namespace {

struct Kjv {
  std::string text, error;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string tokenizer_json;
};

const Kjv& kjv() {
  static const Kjv data = [] {
    Kjv k;
    try {
      k.text = load_kjv_text("data");
      if (const char* path = std::getenv("FORGE_BENCH_TOKENIZER")) {
        k.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_file(path));  // the one run_all.sh shares
      } else {
        BpeTrainerOptions options;
        options.vocab_size = 4096;
        options.special_tokens = {"<|endoftext|>"};
        k.tokenizer = std::make_unique<Tokenizer>(train_bpe(k.text, options));
      }
      k.tokenizer_json = k.tokenizer->to_json().dump();
    } catch (const std::exception& e) {
      k.error = e.what();
    }
    return k;
  }();
  return data;
}

void BM_TokenizerEncodeKjv(benchmark::State& state) {
  const Kjv& k = kjv();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  k.tokenizer->encode(k.text);  // warm the word cache
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = k.tokenizer->encode(k.text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(k.text.size()) * state.iterations());
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["bytes_per_token"] = static_cast<double>(k.text.size()) / static_cast<double>(tokens);
}
BENCHMARK(BM_TokenizerEncodeKjv)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TokenizerEncodeKjvColdCache(benchmark::State& state) {
  const Kjv& k = kjv();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  for (auto _ : state) {
    state.PauseTiming();
    const Tokenizer fresh = Tokenizer::from_json_text(k.tokenizer_json, "kjv-4096");
    state.ResumeTiming();
    auto ids = fresh.encode(k.text);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(k.text.size()) * state.iterations());
}
BENCHMARK(BM_TokenizerEncodeKjvColdCache)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TokenizerTrainKjv4096(benchmark::State& state) {
  const Kjv& k = kjv();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  BpeTrainerOptions options;
  options.vocab_size = 4096;
  options.special_tokens = {"<|endoftext|>"};
  for (auto _ : state) {
    auto t = train_bpe(k.text, options);
    benchmark::DoNotOptimize(&t);
  }
  state.SetBytesProcessed(static_cast<int64_t>(k.text.size()) * state.iterations());
}
BENCHMARK(BM_TokenizerTrainKjv4096)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

}  // namespace
}  // namespace forge
