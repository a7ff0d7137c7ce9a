// Layout equivalence of whole training runs: 20 steps under (tp, dp) in {(2,1), (1,2), (2,2), (4,1)}, with
// and without sequence parallelism and the ZeRO-1 distributed optimizer, against the same run on one rank
// (comm::make_self) with dp x grad_accum micro-batches per step. Run by mpirun with 2 and 4 ranks: the
// layouts whose size is the world's run; each rank also runs the one-rank reference itself.
//
// Tolerances (fp32 compute): the layouts sum the same products in different orders (split GEMMs, all-
// reduces, a vocabulary-parallel log-sum-exp), so results differ from one rank by rounding, which 20 Adam
// steps amplify a little: every step's loss within 2e-5 relative and gradient norm within 1e-3 relative,
// every final weight within 2e-4 x the largest magnitude of its tensor (on weights of size ~0.02-1).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

#include "forge/ckpt/checkpoint.h"
#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/kernels/emulated_device.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "forge/parallel/distributed_optimizer.h"
#include "forge/train/device_emulation.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"
#include "op_harness.h"
#include "train/toy_run.h"

namespace forge::trainer_mpi_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
namespace fs = std::filesystem;

struct Layout {
  int tp, dp;
  bool sequence_parallel, zero;
  int cp = 1;
  const char* cp_comm = "p2p";
  double dropout = 0.0;  // train.hidden_dropout (the same masks under every layout)
};

std::string name_of(const Layout& l) {
  return "tp" + std::to_string(l.tp) + "_dp" + std::to_string(l.dp) +
         (l.cp > 1 ? "_cp" + std::to_string(l.cp) + "_" + l.cp_comm : "") +
         (l.sequence_parallel ? "_sp" : "") + (l.zero ? "_zero1" : "") + (l.dropout > 0 ? "_dropout" : "");
}

class TrainerRuns : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = toy::make_shared_test_dir(comm::world(), "forge_trainer_mpi"); }
  void TearDown() override { toy::remove_shared_test_dir(comm::world(), dir_); }

 public:
  // The toy run of trainer_test.cpp, 20 steps of 16 bytes, with clipping and several gradient buckets.
  TrainConfig config(const std::string& run) const {
    TrainConfig c = toy::toy_run_config(dir_, run);
    c.data.seq_len = 16;
    c.train.dtype = "fp32";
    c.train.steps = 20;
    c.train.warmup = 3;
    c.train.grad_clip = 0.5;                       // clipping is active: the global norm must be right
    c.parallel.bucket_mb = 0.01;                   // several buckets even for this toy model
    c.parallel.make_vocab_size_divisible_by = 48;  // 256 pads to 288 (tp 2) or 384 (tp 4): padding is live
    c.parallel.timeout_s = 60;  // a rank that fails leaves the others in a collective: end the job soon
    return c;
  }
  fs::path dir_;
};

class TrainerLayouts : public TrainerRuns, public ::testing::WithParamInterface<Layout> {};

TEST_P(TrainerLayouts, ReproduceTheOneRankRun) {
  comm::Communicator& world = comm::world();
  const Layout l = GetParam();
  if (l.tp * l.dp * l.cp != world.size()) GTEST_SKIP() << "needs " << l.tp * l.dp * l.cp << " ranks";

  // The reference: one rank, dp x accum micro-batches.
  TrainConfig ref = config("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * l.dp;
  ref.train.hidden_dropout = l.dropout;
  auto self = comm::make_self();
  TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig par = config("parallel");
  par.train.hidden_dropout = l.dropout;
  par.parallel.tp = l.tp;
  par.parallel.dp = l.dp;
  par.parallel.sequence_parallel = l.sequence_parallel;
  par.parallel.distributed_optimizer = l.zero;
  par.parallel.cp = l.cp;
  par.parallel.cp_comm = l.cp_comm;
  TrainResult got = Trainer(par, &world).run();

  ASSERT_EQ(got.losses.size(), want.losses.size());
  // Gradient norms too: Adam's update barely depends on the gradient's scale, so a wrongly scaled
  // (e.g. summed instead of averaged) gradient would leave the losses almost unchanged, but not the norms.
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size());
  // Context parallelism splits only attention's sums (and the gradients' reduction): tighter, as the issue
  // asks of it, losses within 1e-5 and gradient norms within 1e-4.
  const double loss_rtol = l.cp > 1 ? 1e-5 : 2e-5, norm_rtol = l.cp > 1 ? 1e-4 : 1e-3;
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], loss_rtol * want.losses[s]) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], norm_rtol * want.grad_norms[s]) << "step " << s + 1;
  }
  EXPECT_NEAR(got.heldout_loss, want.heldout_loss, 2e-5 * want.heldout_loss);

  // Final weights: the parallel run's checkpoint (written in shards) read whole, against the reference's.
  toy::expect_weights_close(fs::path(ref.log.run_dir) / "checkpoint",
                            fs::path(par.log.run_dir) / "checkpoint", 2e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainerLayouts,
    ::testing::Values(Layout{2, 1, false, false}, Layout{2, 1, true, false}, Layout{1, 2, false, false},
                      Layout{1, 2, false, true}, Layout{2, 2, false, false}, Layout{2, 2, true, true},
                      Layout{4, 1, false, false}, Layout{4, 1, true, false},
                      // Context parallelism: every sequence's 16 tokens over 2 or 4
                      // ranks, alone and beside tp (with sp) and dp (with ZeRO-1).
                      Layout{1, 1, false, false, 2, "p2p"}, Layout{1, 1, false, false, 2, "a2a"},
                      Layout{1, 1, false, false, 4, "p2p"}, Layout{2, 1, true, false, 2, "p2p"},
                      Layout{1, 2, false, true, 2, "p2p"}, Layout{1, 2, false, true, 2, "a2a"},
                      // Hidden dropout: each element's mask follows its sample and position, so sequence
                      // shards, replicas, accumulation and context slices drop what one rank drops.
                      Layout{2, 1, true, false, 1, "p2p", 0.2}, Layout{1, 2, false, true, 1, "p2p", 0.2},
                      Layout{2, 2, true, true, 1, "p2p", 0.2}, Layout{1, 1, false, false, 2, "p2p", 0.2},
                      Layout{1, 1, false, false, 2, "a2a", 0.2}, Layout{2, 1, true, false, 2, "p2p", 0.2}),
    [](const auto& info) { return name_of(info.param); });

// bf16 runs (bf16 GEMMs, activations, residual stream and messages) under every layout against the one-rank
// bf16 run, within the distance of that run from the one-rank fp32 run (toy::expect_follows_bf16_run).
struct Bf16Layout {
  const char* name;
  int tp = 1, dp = 1, cp = 1, pp = 1;
  bool sequence_parallel = false, zero = false;
  const char* cp_comm = "p2p";
  const char* schedule = "1f1b";
  bool fp32_residual = false;
  int64_t accum = 2;  // micro-batches per step per replica (DualPipeV needs 2 pp)
  int layers = 2;     // the toy LLaMA's (DualPipeV needs 2 pp stages of at least one layer)
  // Gradients reduced over dp in bf16: one more rounding of each gradient per reduction, of the same unit
  // roundoff as the activations' and GEMM operands' that set the bound.
  bool grad_reduce_in_bf16 = false;
};

class TrainerBf16Layouts : public TrainerRuns, public ::testing::WithParamInterface<Bf16Layout> {};

TEST_P(TrainerBf16Layouts, FollowTheOneRankBf16Run) {
  comm::Communicator& world = comm::world();
  const Bf16Layout l = GetParam();
  if (l.tp * l.dp * l.cp * l.pp != world.size())
    GTEST_SKIP() << "needs " << l.tp * l.dp * l.cp * l.pp << " ranks";
  const fs::path model = dir_ / ("llama" + std::to_string(l.layers) + ".json");
  if (world.rank() == 0) {
    nlohmann::json json = nlohmann::json::parse(std::ifstream(dir_ / "config.json"));
    json["num_hidden_layers"] = l.layers;
    std::ofstream(model) << json.dump();
  }
  world.barrier().wait();
  auto make = [&](const std::string& run, const char* dtype) {
    TrainConfig c = config(run);
    c.model.config = model.string();
    c.train.dtype = dtype;
    c.train.steps = 12;
    c.train.fp32_residual = l.fp32_residual;
    return c;
  };
  auto self = comm::make_self();
  const std::string me = std::to_string(world.rank());
  TrainConfig fp32 = make("fp32-" + me, "fp32"), ref = make("reference-" + me, "bf16");
  fp32.train.grad_accum = ref.train.grad_accum = l.accum * l.dp;
  const TrainResult exact = Trainer(fp32, self.get()).run();
  const TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig par = make("parallel", "bf16");
  par.parallel.tp = l.tp, par.parallel.dp = l.dp, par.parallel.cp = l.cp, par.parallel.pp = l.pp;
  par.parallel.sequence_parallel = l.sequence_parallel;
  par.parallel.distributed_optimizer = l.zero;
  par.parallel.cp_comm = l.cp_comm;
  par.parallel.schedule = l.schedule;
  par.train.grad_accum = l.accum;
  par.parallel.grad_reduce_in_bf16 = l.grad_reduce_in_bf16;
  const TrainResult got = Trainer(par, &world).run();
  toy::expect_follows_bf16_run(got, want, exact);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainerBf16Layouts,
    ::testing::Values(Bf16Layout{"tp2", 2}, Bf16Layout{"tp2_sp", 2, 1, 1, 1, true},
                      Bf16Layout{"dp2_zero1", 1, 2, 1, 1, false, true}, Bf16Layout{"cp2_p2p", 1, 1, 2},
                      Bf16Layout{"cp2_a2a", 1, 1, 2, 1, false, false, "a2a"}, Bf16Layout{"pp2", 1, 1, 1, 2},
                      Bf16Layout{"pp2_dualpipev", 1, 1, 1, 2, false, false, "p2p", "dualpipev", false, 4, 4},
                      Bf16Layout{"pp2_fp32_residual", 1, 1, 1, 2, false, false, "p2p", "1f1b", true},
                      Bf16Layout{"tp2_sp_dp2_zero1", 2, 2, 1, 1, true, true},
                      Bf16Layout{"tp2_sp_pp2", 2, 1, 1, 2, true},
                      Bf16Layout{"dp2_grad_reduce_in_bf16", 1, 2, 1, 1, false, false, "p2p", "1f1b", false, 2,
                                 2, true},
                      Bf16Layout{"dp2_zero1_grad_reduce_in_bf16", 1, 2, 1, 1, false, true, "p2p", "1f1b",
                                 false, 2, 2, true}),
    [](const auto& info) { return std::string(info.param.name); });

// The families beside LLaMA, each under tp 2 with sequence parallelism, dp 2 with ZeRO-1, cp 2 and pp 2:
// each follows its own one-rank run as the LLaMA does above. Their toy configs keep what sets each apart:
// Qwen2's q/k/v biases, Qwen3's QK-norm, Mistral's window, Gemma 2's soft caps, sandwich norms and GeGLU,
// Gemma 3's local RoPE and QK-norm (1 + w), StarCoder2's LayerNorms, GELU MLP and biases on every projection
// (the output projections' added after the tensor-parallel sum), Mixtral's softmax top-2 of 4 experts and
// Qwen3-MoE's (a dense layer, then experts; both also under ep 2), with windows of 5 over 16-token
// sequences; both MoE families with Hugging Face's load-balancing loss (output_router_logits) and under FP8.
struct FamilyLayout {
  const char* family;
  int tp, dp, cp, pp;
  double dropout = 0.0;  // train.hidden_dropout
  int ep = 1;
  // An FP8 recipe: bf16 GEMMs with fp32 activations (the FP8 machinery compared, as Fp8Case below explains),
  // following the one-rank FP8 run within toy::expect_follows_fp8_run's tolerances.
  const char* recipe = nullptr;
  const char* schedule = nullptr;  // with pp 2 (null: 1f1b)
  int accum = 2;                   // micro-batches per step per replica (DualPipeV needs 2 pp)
};

const char* family_config(const std::string& family) {
  static const std::string common = R"("hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
    "vocab_size": 256, "max_position_embeddings": 64)";
  static const std::string qwen2 =
      R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", )" + common + "}";
  static const std::string qwen3 =
      R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", )" + common + "}";
  static const std::string mistral =
      R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5, )" + common +
      "}";
  static const std::string gemma2 = R"({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
    "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 8,
    "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0, "tie_word_embeddings": false, )" +
                                    common + "}";
  static const std::string gemma3 = R"({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 8,
    "rope_local_base_freq": 100.0, )" +
                                    common + "}";
  if (family == "qwen2") return qwen2.c_str();
  if (family == "qwen3") return qwen3.c_str();
  if (family == "mistral") return mistral.c_str();
  static const std::string starcoder2 =
      R"({"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "sliding_window": 5,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "norm_epsilon": 1e-5, "vocab_size": 256,
    "max_position_embeddings": 64, "tie_word_embeddings": false})";
  static const std::string mixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "sliding_window": 5, "num_local_experts": 4, "num_experts_per_tok": 2, )" +
                                     common + "}";
  if (family == "gemma2") return gemma2.c_str();
  if (family == "starcoder2") return starcoder2.c_str();
  if (family == "mixtral") return mixtral.c_str();
  static const std::string qwen3_moe =
      R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0],
    "norm_topk_prob": true, )" +
      common + "}";
  if (family == "qwen3_moe") return qwen3_moe.c_str();
  // Hugging Face's load-balancing loss over both (resp. the one) MoE layers' routers at once.
  static const std::string router_aux = R"(, "output_router_logits": true, "router_aux_loss_coef": 0.2})";
  static const std::string mixtral_aux = mixtral.substr(0, mixtral.rfind('}')) + router_aux;
  static const std::string qwen3_moe_aux = qwen3_moe.substr(0, qwen3_moe.rfind('}')) + router_aux;
  if (family == "mixtral_aux") return mixtral_aux.c_str();
  // Four layers: four pipeline stages over two ranks (DualPipeV).
  static const std::string mixtral_aux4 = [] {
    std::string c = mixtral_aux;
    const std::string two = R"("num_hidden_layers": 2)";
    return c.replace(c.find(two), two.size(), R"("num_hidden_layers": 4)");
  }();
  if (family == "mixtral_aux4") return mixtral_aux4.c_str();
  if (family == "qwen3_moe_aux") return qwen3_moe_aux.c_str();
  return gemma3.c_str();
}

class TrainerFamilyLayouts : public TrainerRuns, public ::testing::WithParamInterface<FamilyLayout> {};

TEST_P(TrainerFamilyLayouts, FollowTheOneRankRun) {
  comm::Communicator& world = comm::world();
  const FamilyLayout l = GetParam();
  if (l.tp * l.dp * l.cp * l.pp != world.size())
    GTEST_SKIP() << "needs " << l.tp * l.dp * l.cp * l.pp << " ranks";
  const fs::path model = dir_ / (std::string(l.family) + ".json");
  if (world.rank() == 0) std::ofstream(model) << family_config(l.family);
  world.barrier().wait();
  auto make = [&](const std::string& run) {
    TrainConfig c = config(run);
    c.model.config = model.string();
    c.train.steps = 12;
    c.train.hidden_dropout = l.dropout;
    if (l.recipe) {
      c.train.dtype = "bf16";
      c.train.activation_dtype = "fp32";
      c.fp8.recipe = l.recipe;
      c.fp8.amax_history_len = 8;
    }
    return c;
  };
  TrainConfig ref = make("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = l.accum * l.dp;
  auto self = comm::make_self();
  const TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig par = make("parallel");
  par.parallel.tp = l.tp, par.parallel.dp = l.dp, par.parallel.cp = l.cp, par.parallel.pp = l.pp;
  par.parallel.ep = l.ep;
  if (l.schedule) par.parallel.schedule = l.schedule;
  par.parallel.sequence_parallel = l.tp > 1;
  par.parallel.distributed_optimizer = l.dp > 1;
  par.train.grad_accum = l.accum;
  const TrainResult got = Trainer(par, &world).run();
  if (l.recipe) {
    toy::expect_follows_fp8_run(got.losses, got.heldout_loss, want.losses, want.heldout_loss);
    return;
  }
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-5 * want.losses[s]) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-3 * want.grad_norms[s]) << "step " << s + 1;
  }
  EXPECT_NEAR(got.heldout_loss, want.heldout_loss, 2e-5 * want.heldout_loss);
  // Under dropout each kept element is scaled by 1 / (1 - p), and a few elements' rounding differences carry
  // a step's whole update where their neighbours were dropped: the weights drift from the one-rank run's by
  // up to twice as much (Gemma 2's sandwich norms under tp 2: 1.3x the plain bound, measured).
  toy::expect_weights_close(fs::path(ref.log.run_dir) / "checkpoint",
                            fs::path(par.log.run_dir) / "checkpoint", l.dropout > 0 ? 4e-4 : 2e-4);
}

// Fine-tuning on conversations averages the loss over the step's trained tokens (counted over dp, once per
// tp and pp group): under tp 2 with sequence parallelism, dp 2 with ZeRO-1 and pp 2 it follows the one-rank
// run, one conversation per sequence or packed (attention within each conversation, over the gathered rows
// under sequence parallelism, the documents handed to every stage).
class TrainerSftLayouts : public TrainerRuns, public ::testing::WithParamInterface<FamilyLayout> {};

TEST_P(TrainerSftLayouts, FollowTheOneRankRun) {
  comm::Communicator& world = comm::world();
  const FamilyLayout l = GetParam();
  if (l.tp * l.dp * l.cp * l.pp != world.size())
    GTEST_SKIP() << "needs " << l.tp * l.dp * l.cp * l.pp << " ranks";
  if (world.rank() == 0) {
    fs::create_directories(dir_ / "tok");
    fs::copy_file(fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "families" / "qwen3.tokenizer.json",
                  dir_ / "tok" / "tokenizer.json");
    std::ofstream(dir_ / "tok" / "tokenizer_config.json")
        << R"({"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"})";
    std::ofstream sft(dir_ / "sft.jsonl");
    for (int i = 0; i < 24; ++i)  // answers of different lengths: the trained tokens differ per micro-batch
      sft << R"({"messages": [{"role": "user", "content": "Say )" << i
          << R"("}, {"role": "assistant", "content": ")"
          << std::string(static_cast<size_t>(1 + i % 5), static_cast<char>('a' + i % 7)) << R"("}]})"
          << "\n";
    std::string model = family_config("qwen2");  // Qwen's 2026-token vocabulary
    model.replace(model.find(R"("vocab_size": 256)"), 17, R"("vocab_size": 2048)");
    std::ofstream(dir_ / "qwen2.json") << model;
  }
  world.barrier().wait();
  auto make = [&](const std::string& run) {
    TrainConfig c = config(run);
    c.model.config = (dir_ / "qwen2.json").string();
    c.data.tokenizer = (dir_ / "tok" / "tokenizer.json").string();
    c.data.sft = (dir_ / "sft.jsonl").string();
    c.data.sft_pack = std::string(l.family).find("packed") != std::string::npos;
    c.data.seq_len = c.data.sft_pack ? 64 : 24;  // packed: three or four conversations a sequence
    c.data.heldout_fraction = 0.2;
    c.train.steps = 8;
    return c;
  };
  TrainConfig ref = make("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * l.dp;
  auto self = comm::make_self();
  const TrainResult want = Trainer(ref, self.get()).run();
  TrainConfig par = make("parallel");
  par.parallel.tp = l.tp, par.parallel.dp = l.dp, par.parallel.pp = l.pp;
  par.parallel.sequence_parallel = l.tp > 1;
  par.parallel.distributed_optimizer = l.dp > 1;
  par.train.grad_accum = 2;
  const TrainResult got = Trainer(par, &world).run();
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-5 * want.losses[s]) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-3 * want.grad_norms[s]) << "step " << s + 1;
  }
  EXPECT_NEAR(got.heldout_loss, want.heldout_loss, 2e-5 * want.heldout_loss);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainerSftLayouts,
    ::testing::Values(FamilyLayout{"tp2_sp", 2, 1, 1, 1}, FamilyLayout{"dp2_zero1", 1, 2, 1, 1},
                      FamilyLayout{"pp2", 1, 1, 1, 2}, FamilyLayout{"tp2_sp_packed", 2, 1, 1, 1},
                      FamilyLayout{"dp2_zero1_packed", 1, 2, 1, 1}, FamilyLayout{"pp2_packed", 1, 1, 1, 2}),
    [](const auto& info) { return std::string(info.param.family); });

std::string test_name(std::string text) {
  std::replace(text.begin(), text.end(), '-', '_');
  return text;
}

std::vector<FamilyLayout> family_layouts() {
  std::vector<FamilyLayout> all;
  for (const char* family :
       {"qwen2", "qwen3", "mistral", "gemma2", "gemma3", "starcoder2", "mixtral", "qwen3_moe"})
    for (FamilyLayout l : {FamilyLayout{"", 2, 1, 1, 1}, FamilyLayout{"", 1, 2, 1, 1},
                           FamilyLayout{"", 1, 1, 2, 1}, FamilyLayout{"", 1, 1, 1, 2}})
      l.family = family, all.push_back(l);
  // Hidden dropout across pipeline stages (each layer's sites numbered by its index in the whole model) and
  // around Gemma 2's sandwich norms under sequence parallelism.
  all.push_back({"mistral", 1, 1, 1, 2, 0.2});
  all.push_back({"gemma2", 2, 1, 1, 1, 0.2});
  all.push_back({"mixtral", 1, 2, 1, 1, 0.0, 2});  // each rank two of the four experts
  all.push_back({"qwen3_moe", 1, 2, 1, 1, 0.0, 2});
  // Hugging Face's load-balancing loss, one loss over every layer's router: over the gathered rows under tp,
  // each rank's micro-batches under dp and ep (in overlapped pairs), the whole sequences' tokens under cp,
  // and under pp with the stages' routing handed on with the hidden states (Qwen3-MoE's first stage has no
  // MoE layer). With ZB-H1's split backward, and DualPipeV's four stages on two ranks (its overlapped
  // pairs).
  for (const char* family : {"mixtral_aux", "qwen3_moe_aux"})
    for (FamilyLayout l :
         {FamilyLayout{"", 2, 1, 1, 1}, FamilyLayout{"", 1, 2, 1, 1}, FamilyLayout{"", 1, 1, 2, 1},
          FamilyLayout{"", 1, 1, 1, 2}, FamilyLayout{"", 1, 2, 1, 1, 0.0, 2}})
      l.family = family, all.push_back(l);
  all.push_back({"mixtral_aux", 1, 1, 1, 2, 0.0, 1, nullptr, "zb-h1"});
  all.push_back({"mixtral_aux4", 1, 1, 1, 2, 0.0, 1, nullptr, "dualpipev", 4});
  // Under FP8 (every expert its own FP8 Linears, nn/moe.h): Mixtral with the block recipe under tp 2 and
  // delayed scaling under dp 2 with ep 2, Qwen3-MoE with current scaling under pp 2 and the block recipe
  // under dp 2 with ep 2.
  all.push_back({"mixtral", 2, 1, 1, 1, 0.0, 1, "block"});
  all.push_back({"mixtral", 1, 2, 1, 1, 0.0, 2, "delayed"});
  all.push_back({"qwen3_moe", 1, 1, 1, 2, 0.0, 1, "current"});
  all.push_back({"qwen3_moe", 1, 2, 1, 1, 0.0, 2, "block"});
  return all;
}

INSTANTIATE_TEST_SUITE_P(Families, TrainerFamilyLayouts, ::testing::ValuesIn(family_layouts()),
                         [](const auto& info) {
                           const FamilyLayout& l = info.param;
                           return std::string(l.family) +
                                  (l.tp > 1   ? "_tp2_sp"
                                   : l.ep > 1 ? "_dp2_ep2_zero1"
                                   : l.dp > 1 ? "_dp2_zero1"
                                   : l.cp > 1 ? "_cp2"
                                              : "_pp2") +
                                  (l.dropout > 0 ? "_dropout" : "") +
                                  (l.recipe ? std::string("_") + l.recipe : "") +
                                  (l.schedule ? "_" + test_name(l.schedule) : "");
                         });

// FP8 under a layout: the delayed recipe's amaxes are max-reduced over every rank each step and the current
// recipe's weight amaxes over the tensor-parallel group, so every rank casts with the scales one process
// would use, and the runs follow the one-rank FP8 run. Not bitwise: a GEMM summed in another order can move
// a value across an FP8 rounding boundary (one E4M3 step is 6-12% of the value), which the next steps
// amplify; so the first steps are checked tightly and the rest loosely. (The block recipe's 1x128 tiles
// along a split dimension also cover other elements on a shard than on one rank at these toy widths; with
// power-of-two scales that rarely changes a code.)
// These runs keep fp32 activations (train.activation_dtype = fp32), so that what they compare is the FP8
// machinery: with bf16 activations a layout also rounds other values to bf16 before they are cast, and the
// runs drift apart as bf16 runs do (the bf16_activations cases, checked as toy::expect_follows_bf16_run
// checks a bf16 layout: within three times the one-rank run's distance from its fp32-activation twin).
struct Fp8Case {
  const char* recipe;
  bool tensor_parallel;  // tp = world with sequence parallelism, else dp = world with ZeRO-1
  bool bf16_activations = false;
};

class TrainerFp8Layouts : public TrainerRuns, public ::testing::WithParamInterface<Fp8Case> {};

TEST_P(TrainerFp8Layouts, FollowTheOneRankFp8Run) {
  comm::Communicator& world = comm::world();
  const Fp8Case f = GetParam();
  const int n = world.size();
  auto fp8_config = [&](const std::string& run, const char* activations) {
    TrainConfig c = config(run);
    c.train.dtype = "bf16";
    c.train.activation_dtype = activations;
    c.fp8.recipe = f.recipe;
    c.fp8.amax_history_len = 8;
    return c;
  };
  const char* activations = f.bf16_activations ? "bf16" : "fp32";
  TrainConfig ref = fp8_config("reference-" + std::to_string(world.rank()), activations);
  ref.train.grad_accum = f.tensor_parallel ? 2 : 2 * n;
  auto self = comm::make_self();
  TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig par = fp8_config("parallel", activations);
  if (f.tensor_parallel) {
    par.parallel.tp = n;
    par.parallel.sequence_parallel = true;
  } else {
    par.parallel.dp = n;
    par.parallel.distributed_optimizer = true;
  }
  TrainResult got = Trainer(par, &world).run();
  if (f.bf16_activations) {
    TrainConfig twin = fp8_config("fp32-activations-" + std::to_string(world.rank()), "fp32");
    twin.train.grad_accum = ref.train.grad_accum;
    const TrainResult exact = Trainer(twin, self.get()).run();
    toy::expect_follows_bf16_run(got, want, exact, 5);
    return;
  }
  // dp layouts stay bitwise equal for the first 6-14 steps; the tolerances are toy_run.h's.
  toy::expect_follows_fp8_run(got.losses, got.heldout_loss, want.losses, want.heldout_loss);
}

// The delayed recipe's scales, reduced over every rank each step, are the same on all ranks and those of
// the one-rank run (after 3 steps the weights differ only by rounding, so the amaxes agree closely). A rank
// scaling by its own amaxes fails the first check (tested by disabling the reduction).
TEST_F(TrainerRuns, Fp8DelayedScalesAgreeAcrossRanksAndWithOneRank) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  for (const bool tensor_parallel : {true, false}) {
    SCOPED_TRACE(tensor_parallel ? "tp" : "dp");
    auto fp8_config = [&](const std::string& run) {
      TrainConfig c = config(run);
      c.train.dtype = "bf16";
      c.train.activation_dtype = "fp32";  // the scales' agreement, not bf16's drift (see Fp8Case)
      c.train.steps = 3;
      c.fp8.recipe = "delayed";
      return c;
    };
    TrainConfig ref = fp8_config(std::string("reference-") + (tensor_parallel ? "tp-" : "dp-") +
                                 std::to_string(world.rank()));
    ref.train.grad_accum = tensor_parallel ? 2 : 2 * n;
    auto self = comm::make_self();
    const TrainResult want = Trainer(ref, self.get()).run();
    TrainConfig par = fp8_config(tensor_parallel ? "tp" : "dp");
    (tensor_parallel ? par.parallel.tp : par.parallel.dp) = n;
    const TrainResult got = Trainer(par, &world).run();
    ASSERT_EQ(got.fp8_scales.size(), want.fp8_scales.size());
    ASSERT_EQ(got.fp8_scales.size(), 2u * 4 * 3);  // 2 layers x 4 Linears x (input, weight, gradient)
    std::vector<float> all(got.fp8_scales.size() * n);
    world
        .all_gather(got.fp8_scales.data(), all.data(), static_cast<int64_t>(got.fp8_scales.size()),
                    comm::Type::f32)
        .wait();
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], got.fp8_scales[i % got.fp8_scales.size()]) << i;
    // With tp beyond the 2 kv heads, each rank's q|k|v output gradient holds only its query heads' share of
    // the replicated kv heads' gradient: a different tensor with another amax than one rank's.
    if (tensor_parallel && n > 2) continue;
    for (size_t i = 0; i < want.fp8_scales.size(); ++i)
      EXPECT_NEAR(got.fp8_scales[i], want.fp8_scales[i], 1e-3 * want.fp8_scales[i]) << "scale " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, TrainerFp8Layouts,
                         ::testing::Values(Fp8Case{"delayed", true}, Fp8Case{"delayed", false},
                                           Fp8Case{"current", true}, Fp8Case{"current", false},
                                           Fp8Case{"block", true}, Fp8Case{"block", false},
                                           Fp8Case{"delayed", true, true}, Fp8Case{"block", false, true},
                                           Fp8Case{"current", false, true}),
                         [](const auto& info) {
                           return std::string(info.param.recipe) +
                                  (info.param.tensor_parallel ? "_tp_sp" : "_dp_zero1") +
                                  (info.param.bf16_activations ? "_bf16_activations" : "");
                         });

// A checkpoint saved under one layout resumes under another (tp-split weights and ZeRO-sharded Adam state
// are resharded on load) and continues the one-rank run's loss sequence: `first` runs 10 steps, `second`
// the other 10 from its checkpoint, each layout set on a config by its function.
void resume_under_another_layout(TrainerRuns& t, const std::string& name,
                                 const std::function<void(TrainConfig&)>& first_layout,
                                 const std::function<void(TrainConfig&)>& second_layout) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  TrainConfig ref = t.config("reference-" + name + "-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * n;
  auto self = comm::make_self();
  TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig first = t.config("switch-" + name);
  first_layout(first);
  Trainer a(first, &world);
  a.on_step([](int64_t step) {
    if (step == 10) Trainer::stop_flag().store(true);
  });
  TrainResult got_a = a.run();
  ASSERT_TRUE(got_a.interrupted);
  ASSERT_EQ(got_a.steps_done, 10);

  TrainConfig second = t.config("switch-" + name);
  second_layout(second);
  second.checkpoint.resume = "auto";
  TrainResult got_b = Trainer(second, &world).run();
  ASSERT_EQ(got_b.steps_done, 20);

  std::vector<double> losses = got_a.losses;
  losses.insert(losses.end(), got_b.losses.begin(), got_b.losses.end());
  ASSERT_EQ(losses.size(), want.losses.size());
  for (size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], want.losses[s], 2e-5 * want.losses[s]) << "step " << s + 1;
  EXPECT_NEAR(got_b.heldout_loss, want.heldout_loss, 2e-5 * want.heldout_loss);
}

// All ranks tensor-parallel (with sequence parallelism), then all data-parallel with ZeRO-1.
TEST_F(TrainerRuns, ResumesUnderAnotherLayout) {
  const int n = comm::world().size();
  resume_under_another_layout(
      *this, "tp-dp",
      [n](TrainConfig& c) {
        c.train.grad_accum = 2 * n, c.parallel.tp = n, c.parallel.dp = 1;
        c.parallel.sequence_parallel = true;
      },
      [n](TrainConfig& c) {
        c.train.grad_accum = 2, c.parallel.dp = n;
        c.parallel.distributed_optimizer = true;
      });
}

// All ranks context-parallel with ZeRO-1 (the Adam state sharded over dp x cp), then all tensor-parallel;
// and back from tensor-parallel to context-parallel all-to-all.
TEST_F(TrainerRuns, ResumesAcrossContextParallelism) {
  const int n = comm::world().size();
  const auto context = [n](const char* comm_type) {
    return [n, comm_type](TrainConfig& c) {
      c.train.grad_accum = 2 * n, c.parallel.cp = n, c.parallel.dp = 1, c.parallel.cp_comm = comm_type;
      c.parallel.distributed_optimizer = true;
    };
  };
  const auto tensor = [n](TrainConfig& c) {
    c.train.grad_accum = 2 * n, c.parallel.tp = n, c.parallel.dp = 1;
  };
  resume_under_another_layout(*this, "cp-tp", context("p2p"), tensor);
  if (n == 2) resume_under_another_layout(*this, "tp-cp", tensor, context("a2a"));
}

// Context parallelism's memory: each rank holds seq / cp tokens' activations, so the step's peak activation
// memory per rank falls as 1 / cp, plus at most the ring's working buffers of one layer's attention backward
// (its halves of q, out, dout, dq and the log-sum-exp, five key/value blocks in flight or gathering
// gradients, one block's gradients: measured, beside that bound); under a memory cap between the two runs'
// peaks (train.memory_limit_mb), the one-rank run ends with the out-of-memory line at its first step and
// the cp run trains.
TEST_F(TrainerRuns, ContextParallelHoldsASequenceOneRankCannot) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  const fs::path model = dir_ / ("long-" + std::to_string(world.rank()) + ".json");
  {
    std::ofstream out(model);
    out << R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256,
               "max_position_embeddings": 512})";
  }
  auto long_run = [&](const std::string& run, int cp, double limit_mb) {
    TrainConfig c = config(run + "-" + std::to_string(world.rank()));
    c.model.config = model.string();
    c.data.seq_len = 256, c.train.micro_batch = 4, c.train.grad_accum = 1, c.train.steps = 2;
    c.parallel.cp = cp;
    c.train.memory_limit_mb = limit_mb;
    return c;
  };
  auto self = comm::make_self();
  const TrainResult one = Trainer(long_run("one", 1, 0), self.get()).run();
  const double one_peak = static_cast<double>(memory_stats().peak_bytes);
  TrainConfig split = long_run("cp", n, 0);
  split.log.run_dir = (dir_ / "cp").string();
  const TrainResult got = Trainer(split, &world).run();
  const double split_peak = static_cast<double>(memory_stats().peak_bytes);
  const double one_bytes = static_cast<double>(one.peak_activation_bytes),
               split_bytes = static_cast<double>(got.peak_activation_bytes);
  // The ring's backward working set (parallel/context_parallel.cpp) for 4 sequences, 4 heads and 2 kv heads
  // of 8 dimensions: floats per local token, and per chunk token for one block's gradients.
  const double local = 256.0 / n, batch = 4, H = 4, KV = 2, d = 8;
  const double ring =
      4 * batch *
      (local * (2 * H * d + 2 * H * d + H) + 5 * local * KV * 2 * d + local / 2 * (H + 2 * KV) * d);
  if (world.rank() == 0)
    std::printf(
        "peak activation memory per rank: cp 1 %.2f MiB, cp %d %.2f MiB (%.3f of cp 1); 1/cp of cp 1 %.2f "
        "MiB, "
        "plus the ring's buffers %.2f MiB at most\n",
        one_bytes / 1048576.0, n, split_bytes / 1048576.0, split_bytes / one_bytes, one_bytes / n / 1048576.0,
        ring / 1048576.0);
  EXPECT_GT(split_bytes, one_bytes / n);
  EXPECT_LT(split_bytes, one_bytes / n + ring);

  // A cap between the two peaks: one rank cannot hold the step, cp ranks can.
  ASSERT_LT(split_peak, one_peak);
  const double limit_mb = (one_peak + split_peak) / 2 / 1048576.0;
  try {
    Trainer(long_run("one-capped", 1, limit_mb), self.get()).run();
    ADD_FAILURE() << "one rank trained under a cap below its peak";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 1: out of memory: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(train.memory_limit_mb = "), std::string::npos) << e.what();
  }
  TrainConfig capped = long_run("cp-capped", n, limit_mb);
  capped.log.run_dir = (dir_ / "cp-capped").string();
  EXPECT_EQ(Trainer(capped, &world).run().steps_done, 2);
  EXPECT_EQ(host_memory_limit(), 0);  // the cap ends with its run
}

// TrainState under tp x dp with ZeRO-1 (4 ranks): a snapshot at step 5, a restore at step 12 and the same
// steps again give bitwise the losses and each rank's weights of an uninterrupted run, and so does the same
// state through a disk checkpoint (stopped at step 10, resumed under the same layout). In fp32, and in bf16,
// where the distributed optimizer holds the sharded fp32 masters and the store the bf16 weights.
class TrainerZero1State : public TrainerRuns, public ::testing::WithParamInterface<const char*> {};

TEST_P(TrainerZero1State, SnapshotAndCheckpointAreBitwiseUnderTpDp) {
  comm::Communicator& world = comm::world();
  if (world.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  TrainConfig c = config(std::string("straight-") + GetParam());
  c.train.dtype = GetParam();
  c.parallel.tp = 2, c.parallel.dp = 2;
  c.parallel.sequence_parallel = true, c.parallel.distributed_optimizer = true;
  const bool masters = std::string(GetParam()) == "bf16";
  // The rank's fp32 weights, its masters and its bf16 weights, as floats.
  auto weights = [masters](const TrainState& s) {
    EXPECT_EQ(s.optimizer->holds_masters(), masters);
    EXPECT_EQ(s.params->fp32_released(), masters);
    std::vector<float> all;
    for (const Tensor* t : {&s.params->params(), &s.optimizer->masters()}) {
      if (!t->defined()) continue;
      const Tensor host = t->to(Device::cpu);
      all.insert(all.end(), host.f32(), host.f32() + host.numel());
    }
    if (masters) {
      const Tensor host = s.params->params_bf16().to(Device::cpu);
      for (int64_t i = 0; i < host.numel(); ++i) all.push_back(bf16_bits_to_f32(host.bf16()[i]));
    }
    return all;
  };
  std::vector<float> straight_final;
  Trainer straight(c, &world);
  straight.on_state([&](TrainState& s) {
    if (s.step == 20) straight_final = weights(s);
  });
  const TrainResult want = straight.run();
  ASSERT_EQ(want.losses.size(), 20u);

  c.log.run_dir = (dir_ / (std::string("rolled_back-") + GetParam())).string();
  TrainState::Snapshot at5;
  bool restored = false;
  std::vector<float> rolled_final;
  Trainer rolled(c, &world);
  rolled.on_state([&](TrainState& s) {
    if (s.step == 5 && !restored) at5 = s.snapshot();
    if (s.step == 12 && !restored) s.restore(at5), restored = true;
    if (s.step == 20) rolled_final = weights(s);
  });
  const TrainResult got = rolled.run();
  ASSERT_EQ(got.losses.size(), 27u);  // 1..12, then 6..20
  for (int i = 0; i < 20; ++i) EXPECT_EQ(got.losses[i < 12 ? i : i + 7], want.losses[i]) << "step " << i + 1;
  for (int i = 5; i < 12; ++i) EXPECT_EQ(got.losses[i], got.losses[i + 7]) << "step " << i + 1 << " again";
  EXPECT_EQ(rolled_final, straight_final);

  c.log.run_dir = (dir_ / (std::string("resumed-") + GetParam())).string();
  Trainer first(c, &world);
  first.on_step([](int64_t step) {
    if (step == 10) Trainer::stop_flag().store(true);
  });
  const TrainResult a = first.run();
  ASSERT_TRUE(a.interrupted);
  c.checkpoint.resume = "auto";
  std::vector<float> resumed_final;
  Trainer second(c, &world);
  second.on_state([&](TrainState& s) {
    if (s.step == 20) resumed_final = weights(s);
  });
  const TrainResult b = second.run();
  std::vector<double> losses = a.losses;
  losses.insert(losses.end(), b.losses.begin(), b.losses.end());
  EXPECT_EQ(losses, want.losses);
  EXPECT_EQ(resumed_final, straight_final);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TrainerZero1State, ::testing::Values("fp32", "bf16"));

// bf16 with the distributed optimizer's sharded masters over all ranks, stopped at step 6 and resumed with
// tensor parallelism over all ranks (whole masters), and the other way round: each continues the one-rank
// bf16 run within the bf16 layouts' bound (the checkpoint holds the fp32 masters, whatever holds them).
TEST_F(TrainerRuns, Bf16ShardedMastersResumeUnderAnotherLayout) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  auto make = [&](const std::string& run, const char* dtype) {
    TrainConfig c = config(run);
    c.train.dtype = dtype;
    c.train.steps = 12;
    c.train.grad_accum = 2 * n;
    return c;
  };
  auto self = comm::make_self();
  const std::string me = std::to_string(world.rank());
  const TrainResult exact = Trainer(make("masters-fp32-" + me, "fp32"), self.get()).run();
  const TrainResult want = Trainer(make("masters-bf16-" + me, "bf16"), self.get()).run();
  const std::function<void(TrainConfig&)> sharded = [n](TrainConfig& c) {
    c.train.grad_accum = 2, c.parallel.dp = n, c.parallel.distributed_optimizer = true;
  };
  const std::function<void(TrainConfig&)> tensor = [n](TrainConfig& c) {
    c.parallel.tp = n, c.parallel.sequence_parallel = true;
  };
  for (int order = 0; order < 2; ++order) {
    const std::string run = order == 0 ? "masters-dp-tp" : "masters-tp-dp";
    TrainConfig first = make(run, "bf16");
    (order == 0 ? sharded : tensor)(first);
    Trainer a(first, &world);
    a.on_step([](int64_t step) {
      if (step == 6) Trainer::stop_flag().store(true);
    });
    TrainResult got = a.run();
    ASSERT_TRUE(got.interrupted);
    TrainConfig second = make(run, "bf16");
    (order == 0 ? tensor : sharded)(second);
    second.checkpoint.resume = "auto";
    const TrainResult b = Trainer(second, &world).run();
    ASSERT_EQ(b.steps_done, 12);
    got.losses.insert(got.losses.end(), b.losses.begin(), b.losses.end());
    got.grad_norms.insert(got.grad_norms.end(), b.grad_norms.begin(), b.grad_norms.end());
    got.heldout_loss = b.heldout_loss;
    SCOPED_TRACE(run);
    toy::expect_follows_bf16_run(got, want, exact);
  }
}

// Optimizer offload on emulated GPUs (bf16 weights; the fp32 masters and both moments in host memory, the
// update there): the host runs the same CPU AdamW kernel the emulated device does, so every loss and
// gradient norm equals the device update's bit for bit, replicated and sharded over all ranks. The device
// holds exactly the offloaded state fewer bytes at its peak (the device update's moments and masters, and
// the fp32 weights offload frees). A run stopped at step 6 resumes offloaded bitwise, and loads under the
// device update on another dp layout (the checkpoint is layout-free) within the bf16 layouts' bound.
TEST_F(TrainerRuns, OptimizerOffloadOnEmulatedGpusIsTheDeviceUpdate) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  const std::string me = std::to_string(world.rank());
  auto make = [&](const std::string& run, bool zero, bool offload) {
    TrainConfig c = config(run);
    c.train.steps = 12;
    c.train.device = "cuda";
    c.train.dtype = "bf16";
    c.train.grad_accum = 2;
    c.parallel.dp = n, c.parallel.distributed_optimizer = zero;
    c.train.optimizer_offload = offload;
    return c;
  };
  struct Run {
    TrainResult result;
    int64_t peak = 0, state_bytes = 0, fp32_weights = 0, host_bytes = 0, pinned = 0, pinned_after = 0;
  };
  auto run = [&](TrainConfig c, const std::function<void(Trainer&)>& hook = {}) {
    DeviceEmulation emulation;  // its own: its peak is this run's
    if (!toy::every_rank_has_a_gpu(world)) return Run{};
    Run r;
    {
      Trainer t(c, &world);
      t.on_state([&](TrainState& s) {
        r.state_bytes = s.optimizer->state_bytes(), r.host_bytes = s.optimizer->host_bytes();
        r.fp32_weights = s.params->params().numel();
        r.pinned = EmulatedDevice::pinned_bytes();
      });
      if (hook) hook(t);
      r.result = t.run();
    }
    r.peak = EmulatedDevice::peak_bytes();
    r.pinned_after = EmulatedDevice::pinned_bytes();  // the optimizer unpinned its buffers
    return r;
  };
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "sharded" : "replicated");
    const std::string tag = zero ? "zero" : "all";
    const Run device = run(make("offload-device-" + tag, zero, false));
    const Run host = run(make("offload-host-" + tag, zero, true));
    ASSERT_EQ(host.result.losses.size(), 12u);
    EXPECT_EQ(host.result.losses, device.result.losses);
    EXPECT_EQ(host.result.grad_norms, device.result.grad_norms);
    EXPECT_EQ(host.result.heldout_loss, device.result.heldout_loss);
    // On the host, per owned element: fp32 master and two moments (12 bytes), the gradient's landing place
    // (4), and the bf16 staging of the widest bucket's owned part.
    const int64_t owned = host.state_bytes / 12;
    EXPECT_GE(host.host_bytes, 16 * owned);
    EXPECT_LE(host.host_bytes, 18 * owned);
    EXPECT_EQ(host.pinned, host.host_bytes);  // all of it pinned for the copies
    EXPECT_EQ(device.pinned, 0);
    EXPECT_EQ(host.pinned_after, 0);
    EXPECT_EQ(device.peak - host.peak, device.state_bytes + 4 * (device.fp32_weights - host.fp32_weights));
  }
  // Stopped at step 6, resumed offloaded (bitwise) and under the device update on dp 1 (within bounds).
  TrainConfig first = make("offload-resume", true, true);
  const Run stopped = run(first, [](Trainer& t) {
    t.on_step([](int64_t step) {
      if (step == 6) Trainer::stop_flag().store(true);
    });
  });
  ASSERT_TRUE(stopped.result.interrupted);
  TrainConfig again = make("offload-resume", true, true);
  again.checkpoint.resume = "auto";
  const Run resumed = run(again);
  const Run straight = run(make("offload-straight", true, true));
  std::vector<double> losses = stopped.result.losses;
  losses.insert(losses.end(), resumed.result.losses.begin(), resumed.result.losses.end());
  EXPECT_EQ(losses, straight.result.losses);
  EXPECT_EQ(resumed.result.heldout_loss, straight.result.heldout_loss);

  auto self = comm::make_self();
  auto reference = [&](const char* dtype) {
    TrainConfig c = make("offload-reference-" + std::string(dtype) + "-" + me, false, false);
    c.train.device = "cpu", c.train.dtype = dtype, c.parallel.dp = 1,
    c.parallel.distributed_optimizer = false;
    c.train.grad_accum = 2 * n;
    return Trainer(c, self.get()).run();
  };
  const TrainResult exact = reference("fp32"), want = reference("bf16");
  // The step-6 checkpoint of another offloaded run, loaded with all ranks tensor-parallel (dp 1, the device
  // update).
  TrainResult got = stopped.result;
  const Run stopped_again = run(make("offload-switch", true, true), [](Trainer& t) {
    t.on_step([](int64_t step) {
      if (step == 6) Trainer::stop_flag().store(true);
    });
  });
  ASSERT_TRUE(stopped_again.result.interrupted);
  TrainConfig other = make("offload-switch", false, false);
  other.parallel.dp = 1, other.parallel.tp = n, other.parallel.sequence_parallel = n > 1;
  other.train.grad_accum = 2 * n;
  other.checkpoint.resume = "auto";
  const Run switched = run(other);
  ASSERT_EQ(switched.result.steps_done, 12);
  got.losses.insert(got.losses.end(), switched.result.losses.begin(), switched.result.losses.end());
  got.grad_norms.insert(got.grad_norms.end(), switched.result.grad_norms.begin(),
                        switched.result.grad_norms.end());
  got.heldout_loss = switched.result.heldout_loss;
  toy::expect_follows_bf16_run(got, want, exact);
}

// A NaN in one rank's gradients stops every rank at the same step, naming that rank; no rank applies the
// step and the checkpoint stays the previous step's.
TEST_F(TrainerRuns, NonFiniteGradientOnOneRankStopsEveryRank) {
  comm::Communicator& world = comm::world();
  TrainConfig c = config("nan");
  c.train.steps = 4;
  c.resilience.rollback = false;  // the refusal itself (rollback: resilience_test)
  c.checkpoint.every = 1;
  Trainer t(c, &world);
  const int bad_rank = world.size() - 1;
  t.on_gradients([&](int64_t step, ParameterStore& params) {
    if (step == 3 && world.rank() == bad_rank) params.grads().f32()[0] = NAN;
  });
  std::string error;
  try {
    t.run();
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("step 3:"), std::string::npos) << error;
  EXPECT_NE(error.find("first on rank " + std::to_string(bad_rank) + ": gradient of"), std::string::npos)
      << error;
  world.barrier().wait();
  EXPECT_EQ(read_checkpoint_manifest((fs::path(c.log.run_dir) / "checkpoint").string()).step, 2);
}

// model.init_from a Hugging Face folder under tensor parallelism: each rank slices its shard (and the
// padded vocabulary rows) out of the whole tensors, and training continues as on one rank.
TEST_F(TrainerRuns, InitFromAHuggingFaceFolderUnderTensorParallelism) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  // A model that has trained a little (so its weights are not the initialisation), exported by rank 0.
  TrainConfig warm = config("warm-" + std::to_string(world.rank()));
  warm.train.steps = 3;
  auto self = comm::make_self();
  Trainer(warm, self.get()).run();
  if (world.rank() == 0) {
    nn::ComputeOptions fp32;
    fp32.gemm_dtype = DType::f32;
    auto model = load_pretrained_model(fs::path(warm.log.run_dir) / "checkpoint", fp32);
    export_hugging_face(model->params(), model->config().to_json(), dir_ / "hf", {});
  }
  world.barrier().wait();

  TrainConfig ref = config("reference-" + std::to_string(world.rank()));
  ref.model.init_from = (dir_ / "hf").string();
  ref.train.steps = 5;
  TrainResult want = Trainer(ref, self.get()).run();

  TrainConfig par = ref;
  par.log.run_dir = (dir_ / "parallel").string();
  par.parallel.tp = n;
  par.parallel.sequence_parallel = true;
  TrainResult got = Trainer(par, &world).run();
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-5 * want.losses[s]) << "step " << s + 1;
}

TEST_F(TrainerRuns, SequenceParallelNeedsSeqLenDivisibleByTp) {
  comm::Communicator& world = comm::world();
  TrainConfig c = config("odd");
  c.data.seq_len = 15;
  c.parallel.tp = world.size();
  c.parallel.sequence_parallel = true;
  try {
    Trainer(c, &world).run();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "parallel.sequence_parallel: data.seq_len = 15 must be a multiple of parallel.tp = " +
                  std::to_string(world.size()));
  }
}

// Data parallelism on GPUs, with and without ZeRO-1: one GPU per rank, gradients summed over NCCL on the
// device. Follows the one-rank CPU run within the GPU's bf16 attention rounding (tests/models/cuda/
// llama_cuda_test.cpp). On GPUs it needs one per rank (NCCL refuses two ranks on one device), so it is
// skipped on smaller machines; under the device emulation (train/device_emulation.h: the CPU kernels on
// memory closed to host code, MPI standing in for NCCL) it runs everywhere.
void data_parallel_on_gpus_follows_the_one_rank_run(TrainerRuns& t, bool emulated) {
  comm::Communicator& world = comm::world();
  std::optional<DeviceEmulation> emulation;
  if (emulated) emulation.emplace();
  if (!toy::every_rank_has_a_gpu(world)) GTEST_SKIP() << "needs a GPU per rank (" << world.size() << ")";
  TrainConfig ref = t.config("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * world.size();
  auto self = comm::make_self();
  TrainResult want = Trainer(ref, self.get()).run();
  // Replicated Adam state (gradients all-reduced), then ZeRO-1 (reduce-scattered gradients, device shards of
  // the Adam state, parameters all-gathered over NCCL).
  for (bool zero : {false, true}) {
    TrainConfig par = t.config(zero ? "gpu_zero" : "gpu");
    par.train.device = "cuda";
    par.parallel.dp = world.size();
    par.parallel.distributed_optimizer = zero;
    par.parallel.bucket_mb = 0.01;  // several buckets
    TrainResult got = Trainer(par, &world).run();
    ASSERT_EQ(got.losses.size(), want.losses.size());
    // Emulated, the device runs the CPU kernels: only the order of the gradient sums differs.
    const double loss_tolerance = emulated ? 2e-5 : 2e-3, norm_tolerance = emulated ? 2e-4 : 2e-2;
    for (size_t s = 0; s < want.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], loss_tolerance * want.losses[s])
          << "step " << s + 1 << " zero " << zero;
      EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], norm_tolerance * want.grad_norms[s])
          << "step " << s + 1 << " zero " << zero;
    }
  }
  if (emulation) {
    EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
  }
}

TEST_F(TrainerRuns, DataParallelOnGpusFollowsTheOneRankRun) {
  data_parallel_on_gpus_follows_the_one_rank_run(*this, false);
}
TEST_F(TrainerRuns, DataParallelOnEmulatedGpusFollowsTheOneRankRun) {
  data_parallel_on_gpus_follows_the_one_rank_run(*this, true);
}

// Tensor (+ sequence) parallelism on GPUs: activations and gradients over NCCL, per-row loss statistics and
// FP8 amaxes over MPI. Needs a GPU per rank, or the device emulation.
void tensor_parallel_on_gpus_follows_the_one_rank_run(TrainerRuns& t, bool emulated) {
  comm::Communicator& world = comm::world();
  std::optional<DeviceEmulation> emulation;
  if (emulated) emulation.emplace();
  if (!toy::every_rank_has_a_gpu(world)) GTEST_SKIP() << "needs a GPU per rank (" << world.size() << ")";
  TrainConfig ref = t.config("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2;
  auto self = comm::make_self();
  TrainResult want = Trainer(ref, self.get()).run();
  TrainConfig par = t.config("gpu_tp");
  par.train.device = "cuda";
  par.parallel.tp = world.size();
  par.parallel.sequence_parallel = true;
  TrainResult got = Trainer(par, &world).run();
  ASSERT_EQ(got.losses.size(), want.losses.size());
  const double tolerance = emulated ? 2e-5 : 2e-3;
  for (size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], tolerance * want.losses[s]) << "step " << s + 1;
  if (emulation) {
    EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
  }
}

TEST_F(TrainerRuns, TensorParallelOnGpusFollowsTheOneRankRun) {
  tensor_parallel_on_gpus_follows_the_one_rank_run(*this, false);
}
TEST_F(TrainerRuns, TensorParallelOnEmulatedGpusFollowsTheOneRankRun) {
  tensor_parallel_on_gpus_follows_the_one_rank_run(*this, true);
}

// Context parallelism on GPUs: the attention's keys, values and gradients over NCCL (the ring's hops, the
// all-to-alls), its packing and merges as device ops, the statistics over MPI. Ring with all the world in cp;
// all-to-all beside dp x ZeRO-1 at 4 ranks. Needs a GPU per rank, or the device emulation (losses within 1e-5
// of the one-rank CPU run, gradient norms within 1e-4, as on the CPU).
void context_parallel_on_gpus_follows_the_one_rank_run(TrainerRuns& t, bool emulated) {
  comm::Communicator& world = comm::world();
  std::optional<DeviceEmulation> emulation;
  if (emulated) emulation.emplace();
  if (!toy::every_rank_has_a_gpu(world)) GTEST_SKIP() << "needs a GPU per rank (" << world.size() << ")";
  const int n = world.size();
  std::vector<Layout> layouts = {Layout{1, 1, false, false, n, "p2p"}};
  if (n == 4)
    layouts.push_back(Layout{1, 2, false, true, 2, "a2a"});
  else
    layouts.push_back(Layout{1, 1, false, false, 2, "a2a"});
  for (const Layout& l : layouts) {
    SCOPED_TRACE(name_of(l));
    TrainConfig ref = t.config("gpu-cp-reference-" + name_of(l) + "-" + std::to_string(world.rank()));
    ref.train.steps = 6;
    ref.train.grad_accum = 2 * l.dp;
    auto self = comm::make_self();
    const TrainResult want = Trainer(ref, self.get()).run();
    TrainConfig par = t.config("gpu-cp-" + name_of(l));
    par.train.steps = 6;
    par.train.device = "cuda";
    par.parallel.dp = l.dp, par.parallel.cp = l.cp, par.parallel.cp_comm = l.cp_comm;
    par.parallel.distributed_optimizer = l.zero;
    const TrainResult got = Trainer(par, &world).run();
    ASSERT_EQ(got.losses.size(), want.losses.size());
    const double loss_rtol = emulated ? 1e-5 : 2e-3, norm_rtol = emulated ? 1e-4 : 2e-2;
    for (size_t s = 0; s < want.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], loss_rtol * want.losses[s]) << "step " << s + 1;
      EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], norm_rtol * want.grad_norms[s]) << "step " << s + 1;
    }
    EXPECT_NEAR(got.heldout_loss, want.heldout_loss, loss_rtol * want.heldout_loss);
  }
  if (emulation) {
    EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
  }
}

TEST_F(TrainerRuns, ContextParallelOnGpusFollowsTheOneRankRun) {
  context_parallel_on_gpus_follows_the_one_rank_run(*this, false);
}
TEST_F(TrainerRuns, ContextParallelOnEmulatedGpusFollowsTheOneRankRun) {
  context_parallel_on_gpus_follows_the_one_rank_run(*this, true);
}

TEST(TrainerLayoutErrors, WorldSizeMismatchIsOneClearError) {
  comm::Communicator& world = comm::world();
  TrainConfig c;
  c.parallel.tp = world.size() + 1;
  try {
    Trainer(c, &world).run();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel layout"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::trainer_mpi_test
