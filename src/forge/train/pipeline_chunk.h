// A model stage as a pipeline chunk (parallel/pipeline/executor.h): the executor hands it micro-batch
// numbers and hidden states; it runs the stage's forward, backward_input and backward_weight, keeps each
// in-flight micro-batch's activations, and on the last stage sums the loss.
#pragma once

#include <functional>
#include <map>
#include <memory>

#include "forge/models/model.h"
#include "forge/parallel/pipeline/executor.h"

namespace forge::train {

class ModelChunk final : public pipeline::Chunk {
 public:
  // micro_batch(m): micro-batch m of the step (its ids and targets must stay valid until the step ends).
  // rows: the hidden-state rows one micro-batch hands between stages (batch * seq, divided by tp under
  // sequence parallelism).
  ModelChunk(models::Model& model, std::function<models::MicroBatch(int)> micro_batch, int64_t rows);

  Shape activation_shape() const override { return {rows_, model_.config().shape().hidden}; }
  Device device() const override { return model_.options().device; }
  Tensor forward(int micro_batch, const Tensor& input) override;
  Tensor backward_input(int micro_batch, const Tensor& doutput) override;
  void backward_weight(int micro_batch) override;
  Tensor backward(int micro_batch, const Tensor& doutput) override;
  int live_micro_batches() const override { return static_cast<int>(saved_.size()); }

  models::Model& model() { return model_; }
  // The loss summed over the micro-batches this chunk ended (the last stage), since the last reset.
  const models::LossSum& loss() const { return loss_; }
  void reset_loss() { loss_ = {}; }

 private:
  models::StageActivations& saved(int micro_batch);

  models::Model& model_;
  std::function<models::MicroBatch(int)> micro_batch_;
  int64_t rows_;
  std::map<int, std::unique_ptr<models::StageActivations>> saved_;
  models::LossSum loss_;
};

}  // namespace forge::train
