// The training step: zero the gradients, hand the step's micro-batches to a schedule, reduce, check, clip and
// update. A schedule decides the order in which each micro-batch's forward, backward_input (B) and
// backward_weight (W) run; gradients become final by count (ParameterStore::begin_grad_step), so the
// data-parallel buckets start reducing whatever order it picks. The no-pipelining schedule is the first; the
// pipeline schedules (parallel/pipeline/) run their action lists through the same interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/models/model.h"
#include "forge/train/setup.h"
#include "forge/train/train_state.h"

namespace forge::train {

class Schedule {
 public:
  virtual ~Schedule() = default;
  // Runs micro-batches 0 .. count - 1 of one step through `model`; micro_batch(m) gives micro-batch m (its
  // ids and targets stay valid until the step ends). Returns the loss summed over the micro-batches.
  virtual models::LossSum run(models::Model& model, int count,
                              const std::function<models::MicroBatch(int)>& micro_batch) = 0;
  // The micro-batches of a step of `count` that pass through each of the rank's chunks, and so how many
  // weight-gradient contributions every parameter expects (ParameterStore::begin_grad_step).
  virtual int micro_batches_per_chunk(int count) const { return count; }
};

// One stage holding the whole model, micro-batch after micro-batch.
//   fused      each micro-batch's backward with every layer's W right after its B (the least memory);
//   b_then_w   each micro-batch's B for every layer, then its W;
//   deferred_w every micro-batch's forward and B first, all the W at the end (the order zero-bubble
//              schedules create), holding every micro-batch's activations until then.
//   paired     1F1B on one stage, as overlapped pairs: the forward of micro-batch m + 1 beside the backward
//              of micro-batch m, interleaved at the expert-parallel all-to-alls (core/fibers.h) so that each
//              one's transfers travel while the other computes (Megatron's "EP A2A overlap"). Holds two
//              micro-batches' activations instead of one.
// All four give bitwise the same gradients (the backwards accumulate in the same order).
class NoPipelining final : public Schedule {
 public:
  enum class Order { fused, b_then_w, deferred_w, paired };
  explicit NoPipelining(Order order = Order::fused) : order_(order) {}
  models::LossSum run(models::Model& model, int count,
                      const std::function<models::MicroBatch(int)>& micro_batch) override;

 private:
  Order order_;
};

// One MoE layer over the step's global batch (every data-parallel replica, every micro-batch).
struct ExpertLayerReport {
  int64_t layer = 0;         // the Hugging Face layer index
  std::vector<double> load;  // tokens routed to each expert
  double balance_loss = 0;   // moe.seq_aux_loss_coeff * the mean over sequences of sum_i f_i P_i
  double aux_loss = 0;       // moe.aux_loss_coeff * the mean over micro-batches of sum_i f_i P_i
  int64_t dropped = 0;       // assignments over capacity (of the sum of load, counted before the drop)
  double bias_norm = 0;      // L2 norm of the correction bias the step routed with
  // Expert parallelism (else empty / 0): rows each rank of the first rank's ep group had its experts take
  // (its own tokens' included), and rows all of them sent to other ranks' experts (the dispatch's
  // all-to-all volume; the combine sends as many back), over the step's micro-batches.
  std::vector<int64_t> received;
  int64_t sent = 0;
  // The ranks a token's experts live on, on average and at most, over the ep group's tokens.
  double ranks_per_token = 0;
  int64_t max_ranks_per_token = 0;
};

// min / max / coefficient of variation / MaxVio = (max - mean) / mean of an expert-load vector.
struct LoadSummary {
  double min = 0, max = 0, mean = 0, cv = 0, max_violation = 0;
};
LoadSummary summarize_load(const std::vector<double>& load);

struct StepResult {
  double loss = 0;        // mean training loss of the step over every dp replica
  double local_loss = 0;  // this rank's mean
  double grad_norm = 0;   // global, before clipping
  float lr = 0;
  int64_t images = 0;      // image-text data: the step's images over every dp replica
  bool applied = false;    // false: an anomaly (non_finite or spike below); nothing was changed
  std::string non_finite;  // what was not finite, and on which rank first (collective)
  std::string spike;       // the loss or gradient-norm spike StepHooks::judge found (agreed over the world)
  std::string data_error;  // the step's data could not be read, on some rank ("<error> (rank r)"; agreed)
  // Models with routed experts or MTP, on every rank after an applied step: every MoE layer of the model in
  // slot order, and every MTP depth, over the global batch.
  std::vector<ExpertLayerReport> experts;
  std::vector<models::MtpDepthTotals> mtp;
  bool with_aux_loss = false;  // moe.aux_loss_coeff > 0: the step line shows the auxiliary loss
  bool with_capacity = false;  // moe.capacity_factor > 0: the step line shows the dropped fraction
};

// A step's expert balance and MTP measures. fields, for metrics.jsonl: {"moe": {"max_violation" (the largest
// over layers), "cv" (their mean), "balance_loss" and "aux_loss" (the sums), "bias_norm" (the largest),
// "dropped", "dropped_fraction" (dropped over all assignments of every layer), "layers": [per layer: "layer",
// "min", "max", "cv", "max_violation", "bias_norm", "balance_loss", "aux_loss", "dropped",
// "dropped_fraction", and with with_loads "load": the tokens routed to each expert]}, "mtp": [per depth:
// "depth", "loss", "top1"]}; summary: their short form for the step line (the auxiliary loss and the dropped
// fraction only when with_aux_loss / with_capacity). Both empty for a model without experts or MTP.
struct BalanceMetrics {
  nlohmann::json fields = nlohmann::json::object();
  std::string summary;
};
BalanceMetrics balance_metrics(const StepResult& r, bool with_loads = false);

// Callbacks into a step (the trainer's fault injection and spike detection, tests). Each may be empty; step
// numbers are 1-based, as logged.
struct StepHooks {
  // As micro-batch m's data is read, before the step changes anything (an exception thrown here is a data
  // error, agreed over the world: StepResult::data_error).
  std::function<void(int64_t step, int micro_batch)> on_read;
  // As the schedule takes micro-batch m, inside the step's compute (an exception thrown here is an
  // exception in the step: the caller's to handle).
  std::function<void(int64_t step, int micro_batch)> on_micro_batch;
  // This rank's loss of the step, before it is reduced over ranks.
  std::function<void(int64_t step, models::LossSum& loss)> on_loss;
  // The reduced gradients, before they are checked and applied.
  std::function<void(int64_t step, ParameterStore& params)> on_gradients;
  // The step's reduced loss and gradient norm (finite): a non-empty cause refuses the update as a spike.
  std::function<std::string(int64_t step, double loss, double grad_norm)> judge;
  // Right before the update changes the weights and the optimizer state (a background checkpoint save
  // reading them lets go of them here).
  std::function<void()> before_update;
};

// Runs one optimizer step of state.step + 1 (collective over the setup's world). The update is applied only
// when the loss and gradient norm are finite on every rank and judge finds no spike on any; then state.step
// advances, and in models with routed experts each MoE layer's correction bias moves from the loads of the
// global batch. The learning rate is the schedule's times state.lr_scale_at(step).
StepResult train_step(TrainSetup& setup, TrainState& state, Schedule& schedule, const StepHooks& hooks = {});

}  // namespace forge::train
