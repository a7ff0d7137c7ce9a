// Options shared by every module of a model: the GEMM operand type and the recompute policy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forge/core/tensor.h"

namespace forge::nn {

// none: keep every activation backward needs. selective: keep layer inputs, q/k/v and the gate|up
// projection; recompute the attention core and SwiGLU in backward. full: keep only each layer's input and
// recompute the whole layer in backward.
enum class Recompute { none, selective, full };
Recompute recompute_from_name(std::string_view name);
std::string_view recompute_name(Recompute r);

// What selective recompute drops from a micro-batch's saved activations, each recomputed in backward
// (ComputeOptions::recompute_modules; train.recompute_modules):
//   core_attn    the attention core's output and statistics (GQA and MLA), from q|k|v
//   mlp_act      the MLP activation (SwiGLU, GeGLU, GELU) of dense MLPs and shared experts, from its input
//   moe_act      the routed experts' activation
//   norm         the norms' outputs each part keeps as its GEMMs' input (under sequence parallelism the
//                gathered rows): the norm runs again in backward, and the all-gather (Megatron's layernorm)
//   mla_up_proj  MLA's up-projected q, k and v (with a q LoRA; without one, k and v), from the latents
enum class RecomputeModule : uint32_t {
  core_attn = 1u << 0,
  mlp_act = 1u << 1,
  moe_act = 1u << 2,
  norm = 1u << 3,
  mla_up_proj = 1u << 4
};
constexpr uint32_t module_bit(RecomputeModule m) { return static_cast<uint32_t>(m); }
// Selective recompute's modules unless told otherwise.
constexpr uint32_t kDefaultRecomputeModules = module_bit(RecomputeModule::core_attn) |
                                              module_bit(RecomputeModule::mlp_act) |
                                              module_bit(RecomputeModule::moe_act);
// "core_attn,norm" -> the mask; an unknown name is an error naming it and the modules ("" -> 0: the default).
uint32_t recompute_modules_from_names(std::string_view comma_list);
// The mask's names, comma-separated in the order above ("" for 0).
std::string recompute_modules_names(uint32_t modules);

class TensorParallel;
class ContextParallel;
class ExpertParallel;
class Fp8Context;

struct ComputeOptions {
  DType gemm_dtype = DType::bf16;  // f32 or bf16 operands; accumulation is fp32
  Recompute recompute = Recompute::none;
  // The tensor-parallel group (null: one rank, nothing split). Modules register and use only their shard.
  TensorParallel* tp = nullptr;
  int64_t vocab_divisible_by = 128;  // tp > 1 pads the vocabulary to a multiple of this x tp
  // The context-parallel group (null: whole sequences): every sequence's tokens are split over it and
  // attention runs across it (nn/context_parallel.h).
  ContextParallel* cp = nullptr;
  // FP8 training (null: off): the Linears of the transformer layers run their GEMMs in FP8 per the recipe.
  // The model owns the context; norms, attention, the embedding and the output head stay in higher precision.
  Fp8Context* fp8 = nullptr;
  // Where the model's parameters and activations live and its ops run (the op table of that device).
  Device device = Device::cpu;
  // The simulator's dry run (sim/trace.h) of a rank that will train on a device other than the one it is
  // traced on: the device whose kernel-shaped choices the modules follow (the loss head's vocabulary chunk,
  // FP8's 16-row multiples on tensor cores), so that the traced shapes and memory are those of the run
  // predicted. Unset: `device`'s.
  std::optional<Device> shaped_for = std::nullopt;
  Device kernel_device() const { return shaped_for.value_or(device); }
  // The loss head keeps a micro-batch's logits ([rows, vocab] fp32) between its forward and backward, instead
  // of computing them again chunk by chunk, when they take at most this many bytes (0: always recompute). It
  // saves a quarter of the head's GEMM work per training step (three GEMMs instead of four).
  int64_t keep_logits_bytes = int64_t{4} << 30;
  // Mixture-of-experts layers: each expert takes at most ceil(tokens * top_k / experts * this) assignments of
  // a micro-batch, the rest dropped (nn::MoeShape::capacity_factor; 0: dropless). Models without routed
  // experts ignore it.
  double moe_capacity_factor = 0;
  bool moe_pad_to_capacity = false;  // nn::MoeShape::pad_to_capacity
  // The expert-parallel group (null: every routed expert on this rank): mixture-of-experts layers hold
  // experts / ep of them and send each token to the rank of its expert (nn/expert_parallel.h).
  ExpertParallel* ep = nullptr;
  // With ep: the shared experts compute while the dispatched rows travel, and an overlapped pair
  // (Op::forward_backward) interleaves its two micro-batches at the transfers. false: every transfer is
  // waited for where it starts (the baseline the overlap is measured against; the same results bit for bit).
  bool ep_overlap = true;
  // Parts of the model that do not train (train.freeze; a LLaVA's "vision", "projector", "language"): their
  // parameters are frozen (ParameterStore::freeze): no gradient, no optimizer state.
  std::vector<std::string> frozen = {};
  // The dtype of the activations whose kernels take it (bf16 needs bf16 GEMMs): the gated and GELU MLPs' and
  // GQA attention's inputs (the norms write them), their insides (gate|up, the GLU's output; q|k|v, the
  // core's output) and outputs, every gradient of those, and so the tensor-parallel messages around them
  // (nn/mlp.h, nn/attention.h), MLA's and the MoE experts' sorted rows. FP8 Linears cast them from bf16
  // (widened for the cast kernels). bf16 halves those tensors' memory and their bytes through memory and over
  // links.
  DType activation_dtype = DType::f32;
  // The residual stream between layers (and so the pipeline's messages): bf16 with bf16 activations, or fp32
  // (train.fp32_residual, Megatron's fp32_residual_connection). Each layer adds its parts' outputs to it
  // with one rounding (nn/decoder_layer.h).
  DType residual_dtype = DType::f32;
  // Dropout on the embeddings and on each decoder layer's attention and feed-forward outputs before they join
  // the residual stream (Megatron's hidden dropout; 0: off), in training micro-batches only (DropoutRows),
  // its masks drawn under dropout_seed.
  float hidden_dropout = 0.0f;
  uint64_t dropout_seed = 0;
  // > 0: `recompute` (above) applies to the first this many decoder layers of each pipeline stage (each chunk
  // of an interleaved or V schedule, counted from the chunk's first layer; a DeepSeek-V3's MTP layers count
  // after the stage's own), and the rest keep every activation: Megatron's --recompute-method block
  // --recompute-num-layers. Recompute as few layers as memory requires. 0: every layer.
  int64_t recompute_layers = 0;
  // Under Recompute::selective, the modules whose saved activations are dropped and recomputed (a mask of
  // RecomputeModule; 0: kDefaultRecomputeModules).
  uint32_t recompute_modules = 0;
  // Whether a forward that may drop activations drops module m's: under selective the modules above, under
  // full the default set (the layer's transient peak; it keeps only its input anyway), under none nothing.
  bool recomputes(RecomputeModule m) const;
  // The dtype the parts (attention, MLPs, experts) keep their activations in: activation_dtype where the
  // GEMMs are bf16, else fp32.
  DType part_dtype() const {
    return activation_dtype == DType::bf16 && gemm_dtype == DType::bf16 ? DType::bf16 : DType::f32;
  }
  int tp_rank() const;
  int tp_size() const;
  int ep_rank() const;
  int ep_size() const;
};

// Where a micro-batch's rows sit in the training data, for dropout's masks (ops::DropoutParams): local row r
// of its [batch * seq, ...] activations is local position r % seq of sample first_sample + r / seq, which is
// the sequence's position positions[r % seq] (context parallelism's slice; null: r % seq itself).
struct DropoutRows {
  int64_t first_sample = -1;  // < 0: no dropout (evaluation, inference, a stage's warm-up)
  int64_t seq = 0;
  int64_t row_begin = 0;               // sequence parallelism: the rank's first row of the micro-batch
  const int32_t* positions = nullptr;  // [seq] on the model's device, or null
  uint32_t stream = 0;                 // the dropout site (ops::DropoutParams::stream)
  bool active() const { return first_sample >= 0; }
};

// Dropout at site rows.stream of x, [rows, cols]: in place, or (dropout_copy) into a new tensor, x itself
// when nothing drops. Nothing drops when options.hidden_dropout is 0 or the rows are not a training
// micro-batch's. The backward pass of a dropout is dropout_copy of the gradient with the same rows.
void dropout_inplace(const ComputeOptions& options, const DropoutRows& rows, Tensor& x, int64_t cols);
Tensor dropout_copy(const ComputeOptions& options, const DropoutRows& rows, const Tensor& x, int64_t cols);

// x itself when it already holds gemm_dtype elements (fp32, or a bf16 activation), else a bf16 copy of the
// fp32 x on its device (the operand a GEMM reads).
Tensor to_gemm_dtype(const Tensor& x, DType gemm_dtype);
// x itself when it holds `dtype` already, else a copy in it: fp32 <-> bf16 (rounded once to bf16).
Tensor to_dtype(const Tensor& x, DType dtype);

}  // namespace forge::nn
