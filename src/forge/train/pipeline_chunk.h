// A model stage as a pipeline chunk (parallel/pipeline/executor.h): the executor hands it micro-batch
// numbers and hidden states; it runs the stage's forward, backward_input and backward_weight, keeps each
// in-flight micro-batch's activations, and on the last stage sums the loss. A model with routing to hand on
// (models::Model::stage_routing_size) has it travel in rows appended to each message, the doubles' bytes as
// they are (exact whatever the dtype of the hidden states).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "forge/models/model.h"
#include "forge/parallel/pipeline/executor.h"

namespace forge::train {

class ModelChunk final : public pipeline::Chunk {
 public:
  // micro_batch(m): micro-batch m of the step (its ids and targets must stay valid until the step ends).
  // rows: the hidden-state rows one micro-batch hands between stages (batch * seq, divided by tp under
  // sequence parallelism).
  ModelChunk(models::Model& model, std::function<models::MicroBatch(int)> micro_batch, int64_t rows);

  Shape activation_shape() const override { return {rows_ + routing_rows_, model_.config().shape().hidden}; }
  DType activation_dtype() const override { return model_.options().residual_dtype; }
  Device device() const override { return model_.options().device; }
  Tensor forward(int micro_batch, const Tensor& input) override;
  Tensor backward_input(int micro_batch, const Tensor& doutput) override;
  void backward_weight(int micro_batch) override;
  Tensor backward(int micro_batch, const Tensor& doutput) override;
  int live_micro_batches() const override { return static_cast<int>(saved_.size()); }
  // Under expert parallelism (with ComputeOptions::ep_overlap): the pair's forward and backward take turns
  // at the token dispatcher's transfers. The model's state is per micro-batch (StageActivations) and its
  // statistics are added by one direction only (loads in backward, losses in forward), so the two need no
  // other care; the FP8 amax recording the two set is the same (both record), and delayed scaling, the one
  // recipe that reads it, is refused with expert parallelism.
  bool interleaves_pairs() const override {
    return model_.options().ep_size() > 1 && model_.options().ep_overlap;
  }

  models::Model& model() { return model_; }
  // The loss summed over the micro-batches this chunk ended (the last stage), since the last reset.
  const models::LossSum& loss() const { return loss_; }
  void reset_loss() { loss_ = {}; }

 private:
  models::StageActivations& saved(int micro_batch);
  // A message: the stage's hidden states (or their gradient) [rows, hidden] and the routing rows after them.
  Tensor with_routing(const Tensor& hidden, const std::vector<double>& routing) const;
  Tensor without_routing(const Tensor& message, std::vector<double>& routing) const;

  models::Model& model_;
  std::function<models::MicroBatch(int)> micro_batch_;
  int64_t rows_;
  int64_t routing_rows_ = 0;  // rows of the message after the hidden states
  std::map<int, std::unique_ptr<models::StageActivations>> saved_;
  models::LossSum loss_;
};

}  // namespace forge::train
