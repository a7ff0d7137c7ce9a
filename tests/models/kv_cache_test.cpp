// Inference with a KV cache against the full forward: logits of a prompt run at once, token by token and in
// uneven chunks agree with LlamaModel::logits within fp32 tolerance (batch 2, the GQA and MQA fixtures),
// greedy cached generation reproduces the uncached argmax sequence exactly, and misuse is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "forge/ckpt/safetensors.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/sampling.h"
#include "op_harness.h"
#include "test_files.h"

namespace forge::kv_cache_test {
using namespace forge::models;
using namespace forge::ckpt;
namespace {

using testing::fixture;

// The fixture's weights (the PyTorch twin's, or transformers' for the other families), under the given GEMM
// dtype; the family (and so the model built) comes from the config's `architectures`.
std::unique_ptr<Model> fixture_model(const std::string& name, DType gemm_dtype) {
  const auto config = read_model_config(fixture(name + ".config.json"));
  auto model = build_model(*config, nn::ComputeOptions{gemm_dtype, nn::Recompute::none});
  SafetensorsFile file = SafetensorsFile::open(fixture(name + ".safetensors"));
  auto& params = model->params();
  for (int i = 0; i < params.count(); ++i) file.read_into(params.info(i).name, params.param(i));
  params.refresh_bf16();
  return model;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids;
  for (float x : testing::random_floats(n, seed, 0.0f, 1.0f))
    ids.push_back(std::min<int32_t>(static_cast<int32_t>(x * static_cast<float>(vocab)), vocab - 1));
  return ids;
}

// max |got - want| over rows of `want` [rows, vocab] picked by want_row(r), relative to want's largest value.
template <typename RowOf>
double logits_error(const Tensor& got, const Tensor& want, int64_t vocab, RowOf want_row) {
  double diff = 0, scale = 0;
  for (int64_t r = 0; r < got.dim(0); ++r)
    for (int64_t v = 0; v < vocab; ++v) {
      const double w = want.f32()[want_row(r) * vocab + v];
      diff = std::max(diff, std::abs(got.f32()[r * vocab + v] - w));
      scale = std::max(scale, std::abs(w));
    }
  return diff / scale;
}

struct Case {
  std::string fixture;
  DType gemm_dtype;
};

class KvCacheLogits : public ::testing::TestWithParam<Case> {};

TEST_P(KvCacheLogits, MatchFullForward) {
  auto model = fixture_model(GetParam().fixture, GetParam().gemm_dtype);
  const int64_t batch = 2, seq = 45, vocab = model->config().shape().vocab;
  const std::vector<int32_t> ids = random_ids(batch * seq, vocab, 7);
  const Tensor full = model->logits(ids.data(), batch, seq);
  // fp32: the same GEMMs; only the attention's summation order differs (~1e-6). bf16: that difference can
  // flip the bf16 rounding of a GEMM operand element (2^-9 relative of one term), so the bound is looser.
  const double tolerance = GetParam().gemm_dtype == DType::f32 ? 1e-5 : 1e-3;

  // The whole prompt at once, every position's logits.
  KvCache once = model->make_cache(batch);
  Tensor all = model->forward_cached(ids.data(), batch, seq, once, true);
  EXPECT_EQ(once.length(), seq);
  EXPECT_LT(logits_error(all, full, vocab, [](int64_t r) { return r; }), tolerance);

  // Uneven chunks: 3 tokens, then 17 (the flash tiles at an offset), then one at a time (the decode kernel);
  // each step returns only each sequence's last position.
  KvCache chunked = model->make_cache(batch, seq);
  for (int64_t begin = 0; begin < seq;) {
    const int64_t n = begin == 0 ? 3 : begin == 3 ? 17 : 1;
    std::vector<int32_t> step;
    for (int64_t b = 0; b < batch; ++b)
      step.insert(step.end(), ids.begin() + b * seq + begin, ids.begin() + b * seq + begin + n);
    Tensor last = model->forward_cached(step.data(), batch, n, chunked);
    ASSERT_EQ(last.dim(0), batch);
    const int64_t position = begin + n - 1;
    EXPECT_LT(logits_error(last, full, vocab, [&](int64_t b) { return b * seq + position; }), tolerance)
        << "position " << position;
    begin += n;
  }
  EXPECT_EQ(chunked.length(), seq);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, KvCacheLogits,
    ::testing::Values(Case{"llama_tiny", DType::f32},              // GQA 4/2
                      Case{"llama_tiny_tied_llama3", DType::f32},  // MQA, llama3 RoPE, tied
                      Case{"llama_tiny", DType::bf16},
                      // Mistral: a window of 5 over 45 positions, the cache's decode
                      // and prefill kernels cut at each query's window; Qwen3: QK-norm
                      Case{"mistral_tiny_window", DType::f32}, Case{"qwen3_tiny", DType::f32},
                      // Gemma 2: soft caps in the decode kernel and the logits; Gemma 3: local RoPE
                      Case{"gemma2_tiny", DType::f32}, Case{"gemma3_tiny", DType::f32},
                      // StarCoder2: LayerNorms, biases, the GELU MLP; a window with a tied head
                      Case{"starcoder2_tiny", DType::f32}, Case{"starcoder2_tiny_tied_window", DType::f32},
                      // Mixtral: the experts decode a token at a time, with the window
                      Case{"mixtral_tiny_window", DType::f32},
                      // Qwen3-MoE: a dense layer, then experts, with QK-norm
                      Case{"qwen3_moe_tiny", DType::f32}),
    [](const auto& info) {
      return info.param.fixture + (info.param.gemm_dtype == DType::bf16 ? "_bf16" : "_fp32");
    });

// Greedy decoding with the cache equals recomputing the whole sequence for every token and taking the
// argmax of its last row: exactly the same tokens.
TEST(KvCacheGeneration, GreedyEqualsUncachedArgmax) {
  for (const char* name : {"llama_tiny", "llama_tiny_tied_llama3"}) {
    auto model = fixture_model(name, DType::f32);
    const int64_t vocab = model->config().shape().vocab;
    const std::vector<int32_t> prompt = random_ids(6, vocab, 11);
    std::vector<int32_t> sequence = prompt;
    for (int n = 0; n < 40; ++n) {
      Tensor logits = model->logits(sequence.data(), 1, static_cast<int64_t>(sequence.size()));
      const float* last = logits.f32() + (sequence.size() - 1) * vocab;
      sequence.push_back(static_cast<int32_t>(std::max_element(last, last + vocab) - last));
    }
    SamplingOptions options;
    options.temperature = 0, options.max_new_tokens = 40;
    GenerationResult result = generate_sequence(*model, prompt, options);
    EXPECT_EQ(result.tokens, std::vector<int32_t>(sequence.begin() + 6, sequence.end())) << name;
    EXPECT_EQ(result.stop, StopReason::max_new_tokens);
    EXPECT_EQ(result.note(), "");
  }
}

// forge's greedy generation (its KV cache, as forge generate --greedy runs it) equals transformers' own
// model.generate(do_sample=False) on the same weights and prompt, token for token, for every family whose
// fixtures come from transformers (greedy.prompt, greedy.tokens: written by tests/reference/qwen2_golden.py's
// procedure).
TEST(KvCacheGeneration, GreedyEqualsTransformersGenerate) {
  for (const char* name :
       {"qwen2_tiny", "qwen2_tiny_tied", "qwen3_tiny", "qwen3_tiny_tied", "mistral_tiny_window",
        "mistral_tiny", "gemma2_tiny", "gemma3_tiny", "starcoder2_tiny", "starcoder2_tiny_tied_window",
        "mixtral_tiny_window", "mixtral_tiny_tied", "qwen3_moe_tiny", "qwen3_moe_tiny_tied"}) {
    auto model = fixture_model(name, DType::f32);
    SafetensorsFile file = SafetensorsFile::open(fixture(std::string(name) + ".safetensors"));
    const Tensor prompt = file.read("greedy.prompt"), want = file.read("greedy.tokens");
    SamplingOptions options;
    options.temperature = 0, options.max_new_tokens = want.numel();
    const GenerationResult got =
        generate_sequence(*model, std::vector<int32_t>(prompt.i32(), prompt.i32() + prompt.numel()), options);
    EXPECT_EQ(got.tokens, std::vector<int32_t>(want.i32(), want.i32() + want.numel())) << name;
  }
}

TEST(KvCacheErrors, CapacityPositionsAndShape) {
  auto model = fixture_model("llama_tiny", DType::f32);  // max_position_embeddings 64
  const std::vector<int32_t> ids = random_ids(70, model->config().shape().vocab, 3);
  KvCache small = model->make_cache(1, 10);
  model->forward_cached(ids.data(), 1, 8, small);
  testing::expect_error_containing([&] { model->forward_cached(ids.data(), 1, 3, small); },
                                   {"KV cache full", "8 cached + 3 new", "10 positions"});
  EXPECT_EQ(small.length(), 8);  // unchanged by the refused step
  model->forward_cached(ids.data(), 1, 2, small);
  EXPECT_EQ(small.length(), 10);

  KvCache full = model->make_cache(1);
  EXPECT_EQ(full.capacity(), 64);
  model->forward_cached(ids.data(), 1, 60, full);
  testing::expect_error_containing([&] { model->forward_cached(ids.data(), 1, 5, full); },
                                   {"max_position_embeddings 64"});
  testing::expect_error_containing([&] { model->make_cache(1, 65); }, {"65", "max_position_embeddings"});
  testing::expect_error_containing([&] { model->forward_cached(ids.data(), 2, 1, full); }, {"batch 2"});
  std::vector<int32_t> bad = {1, 64};
  KvCache fresh = model->make_cache(1);
  testing::expect_error_containing([&] { model->forward_cached(bad.data(), 1, 2, fresh); }, {"token id 64"});
  EXPECT_EQ(fresh.length(), 0);
  fresh.reset();
}

// A cache can be reset and reused for a new sequence with identical results.
TEST(KvCacheReuse, ResetGivesTheSameLogits) {
  auto model = fixture_model("llama_tiny", DType::f32);
  const std::vector<int32_t> ids = random_ids(12, model->config().shape().vocab, 5);
  KvCache cache = model->make_cache(1, 12);
  Tensor first = model->forward_cached(ids.data(), 1, 12, cache);
  cache.reset();
  Tensor second = model->forward_cached(ids.data(), 1, 12, cache);
  EXPECT_EQ(0, std::memcmp(first.raw(), second.raw(), first.bytes()));
}

}  // namespace
}  // namespace forge::kv_cache_test
