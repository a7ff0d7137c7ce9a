// The FP8 training state of a model, as its Linear layers see it: the recipe (fp8/recipe.h), the
// delayed-scaling amax history of every FP8 Linear's three operands (input, weight, output gradient), and
// each Linear's FP8 weight, cast once per weight version (once per optimizer step) and reused by every
// micro-batch, evaluation and both GEMMs that read it.
//
// Life of a step under the delayed recipe:
//   forward/backward   each FP8 Linear casts its input and output gradient with the scale of the previous
//                      steps' history and records their amaxes (only while recording(): training
//                      micro-batches, not evaluation or generation); its weight is cast once and its amax
//                      recorded then;
//   step_amaxes()      the caller max-reduces this step's amaxes over every rank that must agree (the
//                      tensor- and data-parallel groups; a routed expert's Linears under expert
//                      parallelism: the ranks holding that expert, is_expert()), one all-reduce for
//                      the whole model;
//   end_step()         new scales from the history, history rolled.
// The current recipe computes each scale from the tensor being cast (weights: the amax over the
// tensor-parallel group, so every shard of a weight shares one scale); the block recipe from each 1x128 or
// 128x128 tile. Neither keeps a history; end_step() is then a no-op and step_amaxes() is empty.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "forge/core/tensor.h"
#include "forge/fp8/recipe.h"
#include "forge/fp8/scaling.h"

namespace forge::nn {

struct Fp8Options {
  fp8::RecipeConfig recipe;
  // Keep each Linear's input for the weight gradient as FP8 codes (1 byte per element, and no second cast in
  // backward) rather than in the GEMM dtype (2 or 4 bytes, cast again to FP8 in backward).
  bool save_fp8_inputs = true;
  // CPU emulation of the FP8 tensor cores' limited accumulator (ops::Fp8GemmParams): 0 = exact fp32.
  int accumulator_bits = 0;
  int64_t promote_every = 128;
  // Forward GEMMs (per-tensor recipes) accumulate without promotion to fp32 (ops::Fp8GemmParams::
  // fast_accumulation): TransformerEngine's default, faster on Hopper; the gradient GEMMs always promote.
  bool forward_fast_accumulation = true;
  // Models keep their first and last this many transformer layers out of FP8 (their GEMMs in the GEMM dtype).
  int64_t bf16_first_layers = 0, bf16_last_layers = 0;
  // Multimodal models: the vision encoder's layers and the projector run the recipe too (their patch
  // embedding, whose K is channels x patch^2, stays in the GEMM dtype); false: the whole encoder and
  // projector do.
  bool vision = false;
};

// Throws forge::Error naming the first bad field.
void validate(const Fp8Options& options);

// The floats of a current-scaling `scales` tensor (Fp8Weight::scales, GemmOperand::scales), in device memory.
constexpr int64_t kAmax = 0, kScale = 1, kScaleInv = 2, kScaleFloats = 3;

// A Linear's FP8 weight W [out, in]: its codes and how to read them back.
struct Fp8Weight {
  uint64_t version = ~uint64_t{0};  // ParameterStore::version() of the master weights it was cast from
  Tensor q;                         // [out, in] FP8 codes
  // [in, out]: the same codes transposed, from the same pass. The input gradient reads W [out, in] with K =
  // out running down its rows; tensor cores take only K-contiguous FP8 operands, so it reads q_t instead.
  Tensor q_t;
  float scale = 1.0f, scale_inv = 1.0f;  // delayed recipe (host values)
  // Current recipe: [amax, scale, scale_inv] on the Linears' device (nn::kAmax, ...), computed there from the
  // weight (its amax max-reduced over the tensor-parallel group) and read there by the GEMMs.
  Tensor scales;
  Tensor block_scale_inv;    // block recipe: [ceil(out/128)][ceil(in/128)] (fp8/quantize.h)
  Tensor block_scale_inv_t;  // block recipe: q_t's, [ceil(in/128)][ceil(out/128)]
};

class Fp8Context {
 public:
  explicit Fp8Context(Fp8Options options);
  Fp8Context(const Fp8Context&) = delete;
  Fp8Context& operator=(const Fp8Context&) = delete;

  const Fp8Options& options() const { return options_; }
  fp8::Recipe recipe() const { return options_.recipe.recipe; }
  DType dtype(fp8::TensorRole role) const { return fp8::dtype_for(options_.recipe.format, role); }

  // Registration, while the model is built: each FP8 Linear takes one slot. seal() ends registration (the
  // first use of the scaling state seals implicitly); a later add_linear() is an error.
  // Every Linear of a context runs on the same device (where its amax accumulators live). `expert`: the
  // Linear belongs to a routed expert that only some ranks hold (expert parallelism: parameter group
  // "experts"), whose amaxes agree over those ranks alone.
  int add_linear(std::string name, Device device = Device::cpu, bool expert = false);
  void seal();
  int64_t linears() const { return static_cast<int64_t>(names_.size()); }
  const std::string& linear_name(int linear) const { return names_.at(static_cast<size_t>(linear)); }
  bool is_expert(int linear) const { return experts_.at(static_cast<size_t>(linear)) != 0; }

  // Delayed recipe: the scale this step uses for a Linear's operand, and the amax to fold into its history.
  float delayed_scale(int linear, fp8::TensorRole role);
  void record_amax(int linear, fp8::TensorRole role, float amax);
  // Where a cast folds this operand's amax (ops::Fp8CastParams::amax_accumulate), in the Linears' device
  // memory: the step's amaxes gather there without a host round trip per cast and join the history in
  // step_amaxes() / end_step() (one copy per step).
  float* amax_accumulator(int linear, fp8::TensorRole role);
  // Whether inputs and gradients record their amaxes (inside an Fp8Recording scope that is on: training
  // micro-batches) or not (outside one, or inside one that is off: evaluation, generation). Weight amaxes are
  // recorded whenever a weight is cast: they describe the weights, not the data.
  bool recording() const { return recording_scopes_ > 0 && muted_scopes_ == 0; }

  Fp8Weight& weight(int linear) { return weights_.at(static_cast<size_t>(linear)); }
  int64_t weight_casts() const { return weight_casts_; }
  void count_weight_cast() { ++weight_casts_; }

  // End of an optimizer step. Delayed: this step's amaxes, [linears][3] (input, weight, grad_output),
  // contiguous, for the caller's max all-reduce; then end_step() computes the scales of the next step.
  std::span<float> step_amaxes();
  void end_step();
  // A step that is not applied (refused by the trainer): the amaxes it recorded are forgotten. The weights'
  // casts are not redone by themselves (the weights did not change): the caller bumps the weight version
  // (ParameterStore::refresh_bf16) so that the next step casts them again and records their amaxes.
  void discard_step();

  // Delayed scaling state for checkpoints (history by age [history_len][linears * 3], scales [linears * 3]);
  // null for the other recipes.
  fp8::DelayedScalingGroup* delayed_group();

 private:
  int64_t slot(int linear, fp8::TensorRole role) const;
  void fold_accumulators();  // the accumulators' amaxes into the group's current step, then zero them

  Fp8Options options_;
  std::vector<std::string> names_;
  std::vector<char> experts_;  // [linears]: is_expert
  std::vector<Fp8Weight> weights_;
  std::optional<fp8::DelayedScalingGroup> delayed_;
  bool sealed_ = false;
  int recording_scopes_ = 0, muted_scopes_ = 0;  // open Fp8Recording scopes that are on, off
  friend class Fp8Recording;
  Device device_ = Device::cpu;
  Tensor accumulators_;  // [linears * 3] floats on device_, allocated on first use
  int64_t weight_casts_ = 0;
};

// A scope in which recording() is on (training micro-batches) or off (evaluation, generation): off wins
// while any off scope is open. Scopes are counted rather than saved and restored, so the interleaved scopes
// of an overlapped pair's two fibers (core/fibers.h: a forward and a backward, which end in either order)
// leave recording on until both have ended.
class Fp8Recording {
 public:
  Fp8Recording(Fp8Context* context, bool on) : context_(context), on_(on) {
    if (context_) ++(on_ ? context_->recording_scopes_ : context_->muted_scopes_);
  }
  ~Fp8Recording() {
    if (context_) --(on_ ? context_->recording_scopes_ : context_->muted_scopes_);
  }
  Fp8Recording(const Fp8Recording&) = delete;
  Fp8Recording& operator=(const Fp8Recording&) = delete;

 private:
  Fp8Context* context_;
  bool on_;
};

}  // namespace forge::nn
