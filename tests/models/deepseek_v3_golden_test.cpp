// Golden tests of DeepseekV3Model against the PyTorch twin (tests/reference/deepseek_v3_twin.py): logits,
// the main, MTP and balance losses, every gradient, and three AdamW steps with clipping and the bias update,
// within the fp32 tolerances stated below; cached inference against the full forward. Also: MTP at weight 0
// leaves the base model's gradients bitwise unchanged, a checkpoint without the MTP modules loads into the
// base model, and two stages run in sequence equal the whole model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "forge/ckpt/safetensors.h"
#include "forge/models/deepseek_v3/deepseek_v3_model.h"
#include "forge/models/pretrained.h"
#include "forge/optim/adamw.h"
#include "op_harness.h"
#include "test_files.h"

namespace forge::deepseek_v3_golden_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::ckpt;
namespace {

using testing::fixture;

// Largest |got - want| over want's largest magnitude.
using testing::rel_error;

bool is_bias(const std::string& name) { return name.ends_with(".mlp.gate.e_score_correction_bias"); }

int64_t valid_targets(const Tensor& labels) {
  int64_t valid = 0;
  for (int64_t i = 0; i < labels.numel(); ++i) valid += labels.i32()[i] >= 0;
  return valid;
}

class DeepseekV3Golden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    file_ = std::make_unique<SafetensorsFile>(SafetensorsFile::open(fixture(GetParam() + ".safetensors")));
    config_ = DeepseekV3Config::from_json_file(fixture(GetParam() + ".config.json"));
  }
  double meta(const std::string& key) const { return std::stod(file_->metadata().at(key)); }
  float scalar(const std::string& name) const { return file_->read(name).f32()[0]; }
  std::unique_ptr<DeepseekV3Model> load_model(DeepseekV3Options model_options = {},
                                              StageSpec stage = StageSpec::whole(),
                                              nn::ComputeOptions options = {DType::f32,
                                                                            nn::Recompute::none}) {
    model_options.mtp_weight = static_cast<float>(meta("mtp_weight"));
    auto model =
        std::make_unique<DeepseekV3Model>(config_, nn::ComputeOptions{DType::f32, nn::Recompute::none}, 0.02f,
                                          true, stage, nullptr, model_options);
    auto& params = model->params();
    for (int i = 0; i < params.count(); ++i) file_->read_into(params.info(i).name, params.param(i));
    params.refresh_bf16();
    return model;
  }
  // d(total) / d(balance loss of one sequence) for a batch of `sequences`.
  float balance_scale(int64_t sequences) const {
    return static_cast<float>(meta("seq_aux_loss_coeff") / static_cast<double>(sequences));
  }
  std::unique_ptr<SafetensorsFile> file_;
  DeepseekV3Config config_;
};

TEST_P(DeepseekV3Golden, LogitsLossesAndGradients) {
  auto model = load_model();
  Tensor ids = file_->read("input_ids"), labels = file_->read("labels");
  const int64_t batch = ids.dim(0), seq = ids.dim(1), depth = config_.num_nextn_predict_layers;
  ASSERT_EQ(model->mtp_depth(), depth);

  // fp32 end to end; differences come from summation order only: 1e-5 relative (the README's expectation).
  Tensor logits = model->logits(ids.i32(), batch, seq);
  const double logits_error = rel_error(logits, file_->read("logits"));
  EXPECT_LT(logits_error, 1e-5);

  const int64_t valid = valid_targets(labels);
  const double coefficient = meta("seq_aux_loss_coeff");
  model->set_balance_scale(balance_scale(batch));
  model->params().zero_grads();
  LossSum loss =
      model->forward_backward(ids.i32(), labels.i32(), batch, seq, 1.0f / static_cast<float>(valid));
  EXPECT_EQ(loss.tokens, valid);
  EXPECT_NEAR(loss.mean(), scalar("loss.main"), 1e-5);
  double total = loss.mean(), max_loss_error = std::abs(loss.mean() - scalar("loss.main"));
  ASSERT_EQ(static_cast<int64_t>(model->mtp_stats().size()), depth);
  for (int64_t k = 1; k <= depth; ++k) {
    const double got = model->mtp_stats()[static_cast<size_t>(k - 1)].loss.mean();
    const double want = scalar("loss.mtp" + std::to_string(k));
    EXPECT_NEAR(got, want, 1e-5) << "depth " << k;
    max_loss_error = std::max(max_loss_error, std::abs(got - want));
    total += meta("mtp_weight") / static_cast<double>(depth) * got;
  }
  const double balance = model->balance_loss(coefficient);
  EXPECT_NEAR(balance, scalar("loss.balance"), 1e-7);
  total += balance;
  EXPECT_NEAR(total, scalar("loss.total"), 1e-5);

  // Gradients: 1e-4 relative per tensor (they pass through more reductions than the logits).
  auto& params = model->params();
  double max_grad_error = 0;
  for (int i = 0; i < params.count(); ++i) {
    const std::string& name = params.info(i).name;
    if (is_bias(name)) {
      for (int64_t e = 0; e < params.grad(i).numel(); ++e) EXPECT_EQ(params.grad(i).f32()[e], 0.0f) << name;
      continue;
    }
    const double error = rel_error(params.grad(i), file_->read("grad." + name));
    EXPECT_LT(error, 1e-4) << name;
    max_grad_error = std::max(max_grad_error, error);
  }
  std::printf("%s: logits %.2e rel, losses %.2e abs, balance %.2e abs, total %.2e abs, gradients %.2e rel\n",
              GetParam().c_str(), logits_error, max_loss_error, std::abs(balance - scalar("loss.balance")),
              std::abs(total - scalar("loss.total")), max_grad_error);
}

TEST_P(DeepseekV3Golden, AdamWStepsWithBiasUpdates) {
  auto model = load_model();
  const auto& meta_map = file_->metadata();
  AdamWConfig adam{std::stof(meta_map.at("beta1")), std::stof(meta_map.at("beta2")),
                   std::stof(meta_map.at("eps")), std::stof(meta_map.at("weight_decay"))};
  const float lr = std::stof(meta_map.at("lr")), max_norm = std::stof(meta_map.at("max_grad_norm"));
  const float rate = static_cast<float>(meta("bias_update_rate"));
  const double coefficient = meta("seq_aux_loss_coeff"), weight = meta("mtp_weight");
  AdamW optimizer(&model->params(), adam);
  Tensor want_losses = file_->read("adamw.losses"), want_main = file_->read("adamw.main_losses");
  Tensor want_norms = file_->read("adamw.grad_norms");
  double max_loss_error = 0;
  for (int step = 0; step < 3; ++step) {
    const std::string s = "step" + std::to_string(step);
    Tensor ids = file_->read(s + ".input_ids"), labels = file_->read(s + ".labels");
    model->params().zero_grads();
    model->set_balance_scale(balance_scale(ids.dim(0)));
    LossSum loss = model->forward_backward(ids.i32(), labels.i32(), ids.dim(0), ids.dim(1),
                                           1.0f / static_cast<float>(valid_targets(labels)));
    double total = loss.mean() + model->balance_loss(coefficient);
    for (const MtpDepthStats& d : model->mtp_stats())
      total += weight / static_cast<double>(model->mtp_depth()) * d.loss.mean();
    const double norm = global_grad_norm(model->params());
    EXPECT_NEAR(loss.mean(), want_main.f32()[step], 2e-5) << s;
    EXPECT_NEAR(total, want_losses.f32()[step], 2e-5) << s;
    max_loss_error = std::max(max_loss_error, std::abs(total - want_losses.f32()[step]));
    EXPECT_NEAR(norm, want_norms.f32()[step], 1e-4 * want_norms.f32()[step]) << s;
    // Each MoE layer's load (main layers, then the MTP modules' layers) is the twin's.
    const auto& stats = model->moe_stats();
    for (size_t j = 0; j < stats.size(); ++j) {
      const std::string tag =
          "layer" + std::to_string(config_.first_k_dense_replace + static_cast<int64_t>(j));
      Tensor load = file_->read(s + ".load." + tag);
      for (int64_t e = 0; e < load.numel(); ++e)
        EXPECT_EQ(stats[j].load[static_cast<size_t>(e)], load.i32()[e]) << s << " " << tag << " expert " << e;
    }
    optimizer.step(lr, clip_coefficient(norm, max_norm));
    model->apply_bias_updates(rate, false);
  }
  // Weights after three updates: 3e-4 of each tensor's largest weight (llama's golden tolerance: Adam's
  // normalisation magnifies rounding in near-zero gradients). Biases move by exact +-rate steps: 1e-6.
  auto& params = model->params();
  double max_weight_error = 0;
  for (int i = 0; i < params.count(); ++i) {
    const std::string& name = params.info(i).name;
    Tensor want = file_->read("final." + name);
    if (is_bias(name)) {
      for (int64_t e = 0; e < want.numel(); ++e)
        EXPECT_NEAR(params.param(i).f32()[e], want.f32()[e], 1e-6) << name;
      continue;
    }
    const double error = rel_error(params.param(i), want);
    EXPECT_LT(error, 3e-4) << name;
    max_weight_error = std::max(max_weight_error, error);
  }
  std::printf("%s: AdamW losses %.2e abs, final weights %.2e rel\n", GetParam().c_str(), max_loss_error,
              max_weight_error);
}

// Two stages built apart and run in sequence give the whole model's loss and gradients (the last stage holds
// its own copy of the embedding for MTP: the two copies' gradients add up to the whole model's).
TEST_P(DeepseekV3Golden, TwoStagesEqualTheWholeModel) {
  Tensor ids = file_->read("input_ids"), labels = file_->read("labels");
  const int64_t batch = ids.dim(0), seq = ids.dim(1);
  const float scale = 1.0f / static_cast<float>(valid_targets(labels));
  auto whole = load_model();
  whole->set_balance_scale(balance_scale(batch));
  whole->params().zero_grads();
  const LossSum want = whole->forward_backward(ids.i32(), labels.i32(), batch, seq, scale);

  const int64_t layers = config_.num_hidden_layers;
  auto first = load_model({}, StageSpec::split(layers, 2, 0));
  auto last = load_model({}, StageSpec::split(layers, 2, 1));
  for (auto* m : {first.get(), last.get()})
    m->set_balance_scale(balance_scale(batch)), m->params().zero_grads();
  const MicroBatch mb{ids.i32(), labels.i32(), batch, seq, scale};
  std::unique_ptr<StageActivations> saved_first, saved_last;
  const StageOutput hidden = first->forward(mb, Tensor(), &saved_first);
  const StageOutput out = last->forward(mb, hidden.hidden, &saved_last);
  const Tensor dhidden = last->backward_input(Tensor(), *saved_last);
  last->backward_weight(*saved_last);
  first->backward(dhidden, *saved_first);
  EXPECT_EQ(out.loss.sum, want.sum);
  for (size_t k = 0; k < whole->mtp_stats().size(); ++k)
    EXPECT_EQ(last->mtp_stats()[k].loss.sum, whole->mtp_stats()[k].loss.sum) << "depth " << k + 1;

  auto& params = whole->params();
  for (int i = 0; i < params.count(); ++i) {
    const std::string& name = params.info(i).name;
    Tensor sum = Tensor::zeros(params.grad(i).shape(), DType::f32);
    int holders = 0;
    for (auto* m : {first.get(), last.get()}) {
      const int id = m->params().find(name);
      if (id < 0) continue;
      ++holders;
      for (int64_t e = 0; e < sum.numel(); ++e) sum.f32()[e] += m->params().grad(id).f32()[e];
    }
    ASSERT_GE(holders, 1) << name;
    if (holders == 1) {
      EXPECT_EQ(rel_error(sum, params.grad(i)), 0.0) << name;  // the same computation
    } else {
      EXPECT_LT(rel_error(sum, params.grad(i)), 1e-6) << name;  // the embedding: another summation order
    }
  }
}

// backward_input then backward_weight gives bitwise the gradients of the fused backward (MTP included).
TEST_P(DeepseekV3Golden, BackwardSplitEqualsFusedBitwise) {
  Tensor ids = file_->read("input_ids"), labels = file_->read("labels");
  const int64_t batch = ids.dim(0), seq = ids.dim(1);
  const MicroBatch mb{ids.i32(), labels.i32(), batch, seq, 1.0f / static_cast<float>(valid_targets(labels))};
  auto fused = load_model(), split = load_model();
  for (auto* m : {fused.get(), split.get()})
    m->set_balance_scale(balance_scale(batch)), m->params().zero_grads();
  std::unique_ptr<StageActivations> a, b;
  fused->forward(mb, Tensor(), &a);
  fused->backward(Tensor(), *a);
  split->forward(mb, Tensor(), &b);
  split->backward_input(Tensor(), *b);
  split->backward_weight(*b);
  const Tensor ga = fused->params().grads(), gb = split->params().grads();
  ASSERT_EQ(ga.bytes(), gb.bytes());
  EXPECT_EQ(0, std::memcmp(ga.raw(), gb.raw(), ga.bytes()));
}

// Selective and full recomputation train bitwise like keeping every activation, and so does selective
// recompute of chosen modules: MLA's up-projections alone, the norms' outputs alone (the router's and the
// shared experts' inputs rebuilt), every module; in fp32 and with bf16 activations.
TEST_P(DeepseekV3Golden, RecomputeTrainsBitwiseLikeKeepingEverything) {
  Tensor ids = file_->read("input_ids"), labels = file_->read("labels");
  const int64_t batch = ids.dim(0), seq = ids.dim(1);
  const float scale = 1.0f / static_cast<float>(valid_targets(labels));
  for (DType dtype : {DType::f32, DType::bf16}) {
    Tensor want;
    for (const char* policy :
         {"none", "selective", "full", "mla_up_proj", "norm", "core_attn,mlp_act,moe_act,norm,mla_up_proj"}) {
      const std::string name = policy;
      const bool modules = name != "none" && name != "selective" && name != "full";
      nn::ComputeOptions o{dtype, modules ? nn::Recompute::selective : nn::recompute_from_name(name)};
      if (modules) o.recompute_modules = nn::recompute_modules_from_names(name);
      o.activation_dtype = dtype;
      auto model = load_model({}, StageSpec::whole(), o);
      model->set_balance_scale(balance_scale(batch));
      model->params().zero_grads();
      model->forward_backward(ids.i32(), labels.i32(), batch, seq, scale);
      const Tensor grads = model->params().grads();
      if (name == "none") {
        want = grads.to(Device::cpu);
        continue;
      }
      ASSERT_EQ(grads.bytes(), want.bytes());
      EXPECT_EQ(0, std::memcmp(grads.raw(), want.raw(), want.bytes())) << name << " " << dtype_name(dtype);
    }
  }
}

// bf16 GEMM operands stay close to the fp32 twin (the scale-free similarity of DESIGN.md, llama's threshold).
TEST_P(DeepseekV3Golden, Bf16ComputeStaysCloseToFp32Twin) {
  auto model = load_model({}, StageSpec::whole(), {DType::bf16, nn::Recompute::none});
  Tensor ids = file_->read("input_ids");
  Tensor logits = model->logits(ids.i32(), ids.dim(0), ids.dim(1));
  Tensor want = file_->read("logits");
  std::vector<double> ref(want.f32(), want.f32() + want.numel());
  const double d = testing::dissimilarity(logits.f32(), ref.data(), ref.size());
  EXPECT_LT(d, 1e-4);
  std::printf("%s: bf16 logits dissimilarity %.2e\n", GetParam().c_str(), d);
}

// Cached inference over MLA's compressed cache (a prompt at once, then one token per step with the absorbed
// projections) gives the full forward's logits at every position: within 1e-5 of the largest logit (fp32,
// another summation order).
TEST_P(DeepseekV3Golden, CachedLogitsEqualTheFullForward) {
  auto model = load_model();
  Tensor ids = file_->read("input_ids");
  const int64_t batch = ids.dim(0), seq = ids.dim(1), vocab = config_.vocab_size, prompt = 4;
  const Tensor full = model->logits(ids.i32(), batch, seq);
  nn::KvCache cache = model->make_cache(batch, seq);
  double max_diff = 0, max_ref = 0;
  auto compare = [&](const Tensor& got, int64_t b, int64_t t, int64_t row) {
    for (int64_t v = 0; v < vocab; ++v) {
      const double want = full.f32()[(b * seq + t) * vocab + v];
      max_diff = std::max(max_diff, std::abs(double(got.f32()[row * vocab + v]) - want));
      max_ref = std::max(max_ref, std::abs(want));
    }
  };
  std::vector<int32_t> step(static_cast<size_t>(batch * prompt));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < prompt; ++t) step[static_cast<size_t>(b * prompt + t)] = ids.i32()[b * seq + t];
  const Tensor first = model->forward_cached(step.data(), batch, prompt, cache, /*all_logits=*/true);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < prompt; ++t) compare(first, b, t, b * prompt + t);
  for (int64_t t = prompt; t < seq; ++t) {
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) next[static_cast<size_t>(b)] = ids.i32()[b * seq + t];
    const Tensor got = model->forward_cached(next.data(), batch, 1, cache);
    for (int64_t b = 0; b < batch; ++b) compare(got, b, t, b);
  }
  EXPECT_EQ(cache.length(), seq);
  EXPECT_LT(max_diff / max_ref, 1e-5);
  std::printf("%s: cached logits %.2e rel\n", GetParam().c_str(), max_diff / max_ref);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepseekV3Golden,
                         ::testing::Values("deepseek_v3_tiny", "deepseek_v3_yarn_mtp", "deepseek_v3_mtp2"));

// MTP at weight 0 (and no balance loss, whose gradient in the MTP layers would reach h_0) leaves the main
// model's gradients bitwise those of a model built without the MTP modules.
TEST(DeepseekV3Mtp, WeightZeroGivesTheBaseModelsGradients) {
  for (const std::string name : {"deepseek_v3_yarn_mtp", "deepseek_v3_mtp2"}) {
    SafetensorsFile file = SafetensorsFile::open(fixture(name + ".safetensors"));
    const DeepseekV3Config config = DeepseekV3Config::from_json_file(fixture(name + ".config.json"));
    auto build = [&](bool with_mtp) {
      DeepseekV3Options o;
      o.with_mtp = with_mtp, o.mtp_weight = 0.0f;
      auto model =
          std::make_unique<DeepseekV3Model>(config, nn::ComputeOptions{DType::f32, nn::Recompute::none},
                                            0.02f, true, StageSpec::whole(), nullptr, o);
      for (int i = 0; i < model->params().count(); ++i)
        file.read_into(model->params().info(i).name, model->params().param(i));
      return model;
    };
    auto base = build(false), with = build(true);
    ASSERT_EQ(base->mtp_depth(), 0);
    ASSERT_EQ(with->mtp_depth(), config.num_nextn_predict_layers);
    Tensor ids = file.read("input_ids"), labels = file.read("labels");
    const float scale = 1.0f / static_cast<float>(valid_targets(labels));
    for (auto* m : {base.get(), with.get()}) m->params().zero_grads();
    const LossSum a = base->forward_backward(ids.i32(), labels.i32(), ids.dim(0), ids.dim(1), scale);
    const LossSum b = with->forward_backward(ids.i32(), labels.i32(), ids.dim(0), ids.dim(1), scale);
    EXPECT_EQ(a.sum, b.sum) << name;
    for (int i = 0; i < base->params().count(); ++i) {
      const std::string& param = base->params().info(i).name;
      const Tensor ga = base->params().grad(i), gb = with->params().grad(with->params().find(param));
      int64_t differ = 0;
      for (int64_t e = 0; e < ga.numel(); ++e) differ += ga.f32()[e] != gb.f32()[e];
      EXPECT_EQ(differ, 0) << name << " " << param;
    }
  }
}

// A Hugging Face checkpoint of the main model (the MTP modules removed, num_nextn_predict_layers 0) loads
// into the base model and gives the twin's logits.
TEST(DeepseekV3Mtp, CheckpointWithoutMtpLoadsIntoTheBaseModel) {
  const std::string name = "deepseek_v3_mtp2";
  SafetensorsFile file = SafetensorsFile::open(fixture(name + ".safetensors"));
  nlohmann::json json;
  std::ifstream(fixture(name + ".config.json")) >> json;
  const int64_t layers = json.at("num_hidden_layers").get<int64_t>();
  json["num_nextn_predict_layers"] = 0;
  const DeepseekV3Config base_config = DeepseekV3Config::from_json(json, "base config");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [tensor, shape] : base_config.tensor_shapes())
    tensors.emplace_back(tensor, file.read(tensor));
  for (const auto& [tensor, shape] : tensors)
    ASSERT_FALSE(tensor.starts_with("model.layers." + std::to_string(layers) + ".")) << tensor;
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("deepseek_v3_base_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << json.dump(2);
  write_safetensors((dir / "model.safetensors").string(), tensors, {});
  auto model = load_pretrained_model(dir, nn::ComputeOptions{DType::f32, nn::Recompute::none});
  Tensor ids = file.read("input_ids");
  Tensor logits = model->logits(ids.i32(), ids.dim(0), ids.dim(1));
  EXPECT_LT(rel_error(logits, file.read("logits")), 1e-5);
  std::filesystem::remove_all(dir);
}

// DeepSeek's release layout: every tensor, MTP modules included, plus each MTP module's copies of the
// embedding and the head (is_ignored_duplicate), which loading accepts and skips.
TEST(DeepseekV3Mtp, ReleaseCheckpointWithDuplicatesLoads) {
  const std::string name = "deepseek_v3_yarn_mtp";
  SafetensorsFile file = SafetensorsFile::open(fixture(name + ".safetensors"));
  const DeepseekV3Config config = DeepseekV3Config::from_json_file(fixture(name + ".config.json"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [tensor, shape] : config.tensor_shapes()) tensors.emplace_back(tensor, file.read(tensor));
  const std::string mtp = "model.layers." + std::to_string(config.num_hidden_layers) + ".";
  tensors.emplace_back(mtp + "embed_tokens.weight", file.read("model.embed_tokens.weight"));
  tensors.emplace_back(mtp + "shared_head.head.weight", file.read("lm_head.weight"));
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("deepseek_v3_release_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(fixture(name + ".config.json"), dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  write_safetensors((dir / "model.safetensors").string(), tensors, {});
  auto model = load_pretrained_model(dir, nn::ComputeOptions{DType::f32, nn::Recompute::none});
  Tensor ids = file.read("input_ids");
  Tensor logits = model->logits(ids.i32(), ids.dim(0), ids.dim(1));
  EXPECT_LT(rel_error(logits, file.read("logits")), 1e-5);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace forge::deepseek_v3_golden_test
