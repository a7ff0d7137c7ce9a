// Image-text batches on forge's synthetic shapes set (`forge data synth-images`, 64x64 PNGs, SigLIP
// normalisation): images/s of ImageTextDataset::fill_batch from the packed file (a table lookup per byte) and
// from the JSONL (PNG decode + Hugging Face preprocessing per image), 32 samples of 128 tokens a batch, in
// a shuffled order. Threads: OpenMP's (set OMP_NUM_THREADS). The set is rendered once under the system's
// temporary folder (FORGE_BENCH_SYNTH names another), 2048 images, seed 0.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <numeric>

#include "forge/data/image/image_processor.h"
#include "forge/data/image/image_text.h"
#include "forge/data/image/synthetic_images.h"

namespace forge {
using namespace forge::data;
namespace {

struct SynthSet {
  std::unique_ptr<ImageProcessor> processor;
  std::unique_ptr<ImageTextDataset> jsonl, packed;
  std::string error;
};

ImageTextOptions bench_options() {
  ImageTextOptions o;
  o.seq_len = 128;
  o.image_token_id = 256;
  o.tokens_per_image = 16;
  return o;
}

const SynthSet& synth_set() {
  static const SynthSet set = [] {
    SynthSet s;
    try {
      const char* env = std::getenv("FORGE_BENCH_SYNTH");
      const std::filesystem::path dir =
          env ? std::filesystem::path(env)
              : std::filesystem::temp_directory_path() / fmt::format("forge_bench_synth_{}", ::getpid());
      if (!std::filesystem::exists(dir / "train.jsonl")) {
        SynthImagesOptions o;
        o.out = dir;
        o.count = 2048;
        o.size = 64;
        o.heldout = 0;
        write_synth_images(o);
      }
      s.processor = std::make_unique<ImageProcessor>(
          ImageProcessorConfig::from_json_file(dir / "preprocessor_config.json"));
      const TextEncoder bytes = TextEncoder::bytes();
      s.jsonl = std::make_unique<ImageTextDataset>(
          ImageTextDataset::from_jsonl(dir / "train.jsonl", bytes, *s.processor, bench_options()));
      write_packed_image_text(*s.jsonl, dir / "train.packed", bytes.fingerprint);
      PackedImageTextExpectation expect;
      expect.seq_len = 128;
      expect.image_token_id = 256;
      expect.tokens_per_image = 16;
      s.packed = std::make_unique<ImageTextDataset>(
          ImageTextDataset::from_packed(dir / "train.packed", *s.processor, expect));
    } catch (const std::exception& e) {
      s.error = e.what();
    }
    return s;
  }();
  return set;
}

void run_batches(benchmark::State& state, const ImageTextDataset& d) {
  constexpr int64_t batch = 32;
  const auto shape = d.image_shape();
  std::vector<int32_t> ids(batch * d.seq_len()), targets(ids.size());
  std::vector<float> pixels(static_cast<size_t>(batch * shape[0] * shape[1] * shape[2]));
  std::vector<int64_t> order(static_cast<size_t>(d.num_samples()));
  std::iota(order.begin(), order.end(), 0);
  for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[(i * 2654435761u) % (i + 1)]);
  int64_t next = 0, images = 0;
  for (auto _ : state) {
    if (next + batch > d.num_samples()) next = 0;
    images += d.fill_batch(std::span(order).subspan(static_cast<size_t>(next), batch), ids.data(),
                           targets.data(), pixels.data(), batch);
    next += batch;
    benchmark::DoNotOptimize(pixels.data());
  }
  state.counters["images/s"] = benchmark::Counter(static_cast<double>(images), benchmark::Counter::kIsRate);
}

void BM_ImageTextBatchPacked(benchmark::State& state) {
  const SynthSet& s = synth_set();
  if (!s.error.empty()) return state.SkipWithError(s.error.c_str());
  run_batches(state, *s.packed);
}

void BM_ImageTextBatchJsonl(benchmark::State& state) {
  const SynthSet& s = synth_set();
  if (!s.error.empty()) return state.SkipWithError(s.error.c_str());
  run_batches(state, *s.jsonl);
}

BENCHMARK(BM_ImageTextBatchPacked)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ImageTextBatchJsonl)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace forge
