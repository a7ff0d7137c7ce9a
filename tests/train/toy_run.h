// The toy training run shared by the trainer tests: a 300-line corpus, a 2-layer LLaMA of hidden 32
// (4 heads, 2 kv heads, byte vocabulary) and a short fp32-friendly config, all under one folder.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/data/image/synthetic_images.h"
#include "forge/models/pretrained.h"
#include "forge/train/config.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"

namespace forge::toy {
using namespace forge::optim;
using namespace forge::ckpt;
using namespace forge::train;

// An empty directory for the running test: <tmp>/<prefix>_<pid>_<test name>, removed first if present.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    (prefix + "_" + std::to_string(::getpid()) + "_" +
                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Multi-process tests: one directory for the job and the running test (rank 0's pid in its name), made
// fresh by rank 0, which also writes the toy inputs and whatever `also_write` adds, while the others wait.
inline std::filesystem::path make_shared_test_dir(
    comm::Communicator& world, const std::string& prefix,
    const std::function<void(const std::filesystem::path&)>& also_write = {});
// Removes it once every rank is done with it.
inline void remove_shared_test_dir(comm::Communicator& world, const std::filesystem::path& dir) {
  world.barrier().wait();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

// Writes dir/corpus.txt and dir/config.json.
inline void write_toy_run_inputs(const std::filesystem::path& dir) {
  std::ofstream corpus(dir / "corpus.txt");
  for (int i = 0; i < 300; ++i)
    corpus << "In the beginning was the word " << i % 17 << ", and the word was with the light.\n";
  std::ofstream model(dir / "config.json");
  model << R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256,
               "max_position_embeddings": 64})";
}

// Writes dir/deepseek.json: a 3-layer DeepSeek-V3 of hidden 32 for the byte vocabulary (MLA without a query
// LoRA, the first layer dense, then DeepSeekMoE of 8 experts in 4 groups, top-2 of 2 groups, 2 shared
// experts), with one MTP depth.
inline void write_toy_deepseek_config(const std::filesystem::path& dir) {
  std::ofstream model(dir / "deepseek.json");
  model << R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": null,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
    "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_interleave": true, "vocab_size": 256, "max_position_embeddings": 64,
    "tie_word_embeddings": false})";
}

inline std::filesystem::path make_shared_test_dir(
    comm::Communicator& world, const std::string& prefix,
    const std::function<void(const std::filesystem::path&)>& also_write) {
  int64_t pid = ::getpid();
  world.broadcast(&pid, 1, comm::Type::i64, 0).wait();
  std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(test.begin(), test.end(), '/', '_');
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(pid) + "_" + test);
  if (world.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    write_toy_run_inputs(dir);
    if (also_write) also_write(dir);
  }
  world.barrier().wait();
  return dir;
}

// 6 steps of 2 x 2 sequences of 32 bytes, logging into dir/run; no evaluation, sample or peak measurement.
// Whether every rank of `world` has a GPU of its own (the fewest GPUs any rank sees is at least the world's
// size; always under the device emulation): the multi-rank GPU tests skip otherwise. Collective.
inline bool every_rank_has_a_gpu(comm::Communicator& world) {
  const int usable = device_usable(Device::cuda) ? device_memory(Device::cuda).device_count() : 0;
  return -comm::all_reduce_max(world, -static_cast<double>(usable)) >= world.size();
}

inline TrainConfig toy_run_config(const std::filesystem::path& dir, const std::string& run) {
  TrainConfig c;
  c.model.config = (dir / "config.json").string();
  c.data.corpus = (dir / "corpus.txt").string();
  c.data.tokenizer = "bytes";
  c.data.cache_dir = dir.string();
  c.data.seq_len = 32;
  c.data.heldout_fraction = 0.1;
  // The corpus's tail: the layout tests' tolerances were set on this split (MoE routing and FP8 codes near a
  // tie make a few runs sensitive to the exact data).
  c.data.heldout_parts = 1;
  c.train.micro_batch = 2;
  c.train.grad_accum = 2;
  c.train.steps = 6;
  c.train.warmup = 2;
  c.train.lr = 1e-2;
  c.train.min_lr = 1e-3;
  c.eval.every = 0;
  c.log.every = 100;
  c.log.peak_gflops = 100;  // skip the peak measurement
  c.log.run_dir = (dir / run).string();
  c.sample.tokens = 0;
  return c;
}

// An FP8 run under a layout follows the one-rank FP8 run. Step 1 (same weights; delayed scales all 1, current
// ones reduced over tp): only the GEMMs' summation order differs. Steps 2-3 run on scales reduced from step
// 1's amaxes: a rank casting with its own amaxes would be off by ~1e-3-1e-2 there. Later steps drift apart
// chaotically (a value moved across an FP8 rounding boundary is amplified; measured on the LLaMA toy: 1e-6 ..
// 1e-4 by step 5, up to a few 1e-2 by step 20), so they and the held-out loss are checked loosely.
inline void expect_follows_fp8_run(const std::vector<double>& got, double got_heldout,
                                   const std::vector<double>& want, double want_heldout) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_GE(want.size(), 1u);
  EXPECT_NEAR(got[0], want[0], 2e-5 * want[0]) << "step 1";
  for (size_t s = 1; s < std::min<size_t>(3, want.size()); ++s)
    EXPECT_NEAR(got[s], want[s], 1e-3 * want[s]) << "step " << s + 1;
  for (size_t s = 3; s < want.size(); ++s) EXPECT_NEAR(got[s], want[s], 6e-2 * want[s]) << "step " << s + 1;
  EXPECT_NEAR(got_heldout, want_heldout, 4e-2 * want_heldout);
}

// Two checkpoints read whole (any layout wrote them) hold the same weights: every tensor of `a` is in `b`,
// within `tolerance` x the largest magnitude of the tensor.
// absolute_floor: the bound for tensors whose values are all near zero (a bias whose true gradient is zero,
// moved by rounding noise alone).
// A bf16 run under a parallel layout (got) against the one-rank bf16 run (want) and the one-rank fp32 run
// (exact) of the same config. Not bitwise: a layout sums in another order and so rounds other values to bf16.
// The tolerance comes from the one-rank runs: the bf16 run is the fp32 run perturbed by its roundings,
// d_s = |want - exact| at step s, d the largest up to that step (trajectories only drift apart) and at least
// fp32's own reordering (1e-5 of a loss, 1e-4 of a gradient norm). A layout draws roundings of the same kinds
// and sizes, and up to as many again where it sums partial results in bf16 (a tensor-parallel reduction
// rounds each rank's partial sum and then their sum): within 2 d of the fp32 run, so within 3 d of the
// one-rank bf16 run (triangle inequality). FP8 runs with bf16 activations pass factor 5: a bf16 rounding that
// moves a value across an FP8 rounding boundary changes its code by a whole FP8 step, so the same count of
// roundings moves an FP8 run by unequal amounts (measured, delayed scaling under tp 4 with sequence
// parallelism: up to 3.3 d on an AVX-512 Xeon, 4.3 d on a Xeon with AMX, whose bf16 GEMMs round otherwise).
// Not for the block recipe under tp: its 1x128 tiles along a split dimension cover other elements on a shard
// than on one rank at toy widths, which is another quantisation, not a rounding.
inline void expect_follows_bf16_run(const TrainResult& got, const TrainResult& want, const TrainResult& exact,
                                    double factor = 3) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  ASSERT_EQ(exact.losses.size(), want.losses.size());
  double loss_d = 0, norm_d = 0;
  for (size_t s = 0; s < want.losses.size(); ++s) {
    loss_d = std::max({loss_d, std::abs(want.losses[s] - exact.losses[s]), 1e-5 * want.losses[s]});
    norm_d =
        std::max({norm_d, std::abs(want.grad_norms[s] - exact.grad_norms[s]), 1e-4 * want.grad_norms[s]});
    EXPECT_NEAR(got.losses[s], want.losses[s], factor * loss_d) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], factor * norm_d) << "step " << s + 1;
  }
  EXPECT_GT(std::abs(want.losses.back() - exact.losses.back()), 0) << "the bf16 run is the fp32 run";
  // The held-out loss of the final weights: a point on the same trajectories, whose distance may happen to be
  // small there; bounded by the trajectory's.
  const double heldout_d = std::max(std::abs(want.heldout_loss - exact.heldout_loss), loss_d);
  EXPECT_NEAR(got.heldout_loss, want.heldout_loss, factor * heldout_d);
}

inline void expect_weights_close(const std::filesystem::path& a_dir, const std::filesystem::path& b_dir,
                                 double tolerance, double absolute_floor = 0) {
  nn::ComputeOptions fp32;
  fp32.gemm_dtype = DType::f32;
  auto a = models::load_pretrained_model(a_dir, fp32);
  auto b = models::load_pretrained_model(b_dir, fp32);
  const ParameterStore& pa = a->params();
  const ParameterStore& pb = b->params();
  ASSERT_EQ(pa.count(), pb.count());
  for (int i = 0; i < pa.count(); ++i) {
    const int j = pb.find(pa.info(i).name);
    ASSERT_GE(j, 0) << pa.info(i).name;
    const int64_t n = shape_numel(pa.info(i).shape);
    const float* x = pa.param(i).f32();
    const float* y = pb.param(j).f32();
    double scale = 0, worst = 0;
    for (int64_t k = 0; k < n; ++k) scale = std::max(scale, std::abs(double(x[k])));
    for (int64_t k = 0; k < n; ++k) worst = std::max(worst, std::abs(double(x[k]) - y[k]));
    EXPECT_LE(worst, std::max(tolerance * scale, absolute_floor)) << pa.info(i).name;
  }
}

// The step records of a run's metrics.jsonl (those with a training loss), in order.
inline std::vector<nlohmann::json> step_records(const TrainConfig& c) {
  std::vector<nlohmann::json> out;
  std::ifstream in(std::filesystem::path(c.log.run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(std::move(j));
  }
  return out;
}

// The checkpoint folder a run's checkpoint directory resolves to (its `latest`).
inline std::filesystem::path latest_checkpoint(const TrainConfig& c) {
  return resolve_checkpoint(c.checkpoint_dir().string()).dir;
}

// The multimodal toy run: 240 synthetic 16x16 images of shapes with captions (dir/shapes: 216 to train on, 24
// held out) and a tiny LLaVA (dir/llava.json: a SigLIP-style encoder of width 32 over 2x2 patches, the
// projector, a 2-layer LLaMA of width 32 over bytes with image token 256).
inline void write_llava_toy_inputs(const std::filesystem::path& dir) {
  data::SynthImagesOptions o;
  o.out = dir / "shapes", o.count = 240, o.size = 16, o.seed = 3, o.heldout = 0.1, o.workers = 1;
  data::write_synth_images(o);
  std::ofstream(dir / "llava.json") << R"({
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 256,
    "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 16, "patch_size": 8,
                      "vision_use_head": false},
    "text_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "vocab_size": 260, "max_position_embeddings": 128}})";
}

inline TrainConfig llava_toy_config(const std::filesystem::path& dir, const std::string& run) {
  TrainConfig c;
  c.model.config = (dir / "llava.json").string();
  c.data.images = (dir / "shapes" / "train.jsonl").string();
  c.data.heldout_images = (dir / "shapes" / "heldout.jsonl").string();
  c.data.tokenizer = "bytes";
  c.data.seq_len = 88;  // 4 image tokens, "\n", captions of up to 79 bytes
  c.train.micro_batch = 4, c.train.grad_accum = 2, c.train.steps = 6;
  c.train.warmup = 2, c.train.lr = 3e-3, c.train.min_lr = 3e-4;
  c.eval.every = 0, c.eval.batches = 4;
  c.log.every = 100, c.log.peak_gflops = 100;
  c.log.run_dir = (dir / run).string();
  c.sample.tokens = 0;
  return c;
}

// The store's fp32 weights, on the host.
inline std::vector<float> host_weights(const TrainState& s) {
  const Tensor host = s.params->params().to(Device::cpu);
  return std::vector<float>(host.f32(), host.f32() + host.numel());
}

}  // namespace forge::toy
