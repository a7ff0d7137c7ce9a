#include "forge/train/pipeline_chunk.h"

#include "forge/core/error.h"

namespace forge::train {

ModelChunk::ModelChunk(models::Model& model, std::function<models::MicroBatch(int)> micro_batch, int64_t rows)
    : model_(model), micro_batch_(std::move(micro_batch)), rows_(rows) {}

models::StageActivations& ModelChunk::saved(int micro_batch) {
  auto it = saved_.find(micro_batch);
  FORGE_CHECK(it != saved_.end(), "layers {}..{}: backward of micro-batch {} without its forward",
              model_.stage().first_layer, model_.stage().end_layer, micro_batch);
  return *it->second;
}

Tensor ModelChunk::forward(int micro_batch, const Tensor& input) {
  std::unique_ptr<models::StageActivations>& slot = saved_[micro_batch];
  FORGE_CHECK(slot == nullptr, "micro-batch {} forward twice", micro_batch);
  const models::StageOutput out = model_.forward(micro_batch_(micro_batch), input, &slot);
  loss_.sum += out.loss.sum, loss_.tokens += out.loss.tokens;
  return out.hidden;
}

Tensor ModelChunk::backward_input(int micro_batch, const Tensor& doutput) {
  return model_.backward_input(doutput, saved(micro_batch));
}

void ModelChunk::backward_weight(int micro_batch) {
  model_.backward_weight(saved(micro_batch));
  saved_.erase(micro_batch);
}

Tensor ModelChunk::backward(int micro_batch, const Tensor& doutput) {
  Tensor dinput = model_.backward(doutput, saved(micro_batch));
  saved_.erase(micro_batch);
  return dinput;
}

}  // namespace forge::train
