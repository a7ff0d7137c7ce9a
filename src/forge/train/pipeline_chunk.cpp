#include "forge/train/pipeline_chunk.h"

#include <cstring>

#include "forge/core/error.h"

namespace forge::train {

ModelChunk::ModelChunk(models::Model& model, std::function<models::MicroBatch(int)> micro_batch, int64_t rows)
    : model_(model), micro_batch_(std::move(micro_batch)), rows_(rows) {
  const int64_t bytes = model.stage_routing_size() * static_cast<int64_t>(sizeof(double));
  const int64_t row_bytes =
      model.config().shape().hidden * static_cast<int64_t>(dtype_size(model.options().residual_dtype));
  routing_rows_ = (bytes + row_bytes - 1) / row_bytes;
}

Tensor ModelChunk::with_routing(const Tensor& hidden, const std::vector<double>& routing) const {
  if (routing_rows_ == 0 || !hidden.defined()) return hidden;
  const int64_t width = model_.config().shape().hidden, n = model_.stage_routing_size();
  FORGE_CHECK(hidden.numel() == rows_ * width && static_cast<int64_t>(routing.size()) == n,
              "layers {}..{}: a message of {} hidden values and {} routing values, expected {} and {}",
              model_.stage().first_layer, model_.stage().end_layer, hidden.numel(), routing.size(),
              rows_ * width, n);
  Tensor message = Tensor::empty({rows_ + routing_rows_, width}, hidden.dtype(), hidden.device());
  message.view(0, {rows_, width}).copy_from(hidden);
  Tensor tail = Tensor::zeros({routing_rows_ * width}, hidden.dtype());
  std::memcpy(tail.raw(), routing.data(), routing.size() * sizeof(double));
  message.view(rows_ * width, {routing_rows_ * width}).copy_from(tail);
  return message;
}

Tensor ModelChunk::without_routing(const Tensor& message, std::vector<double>& routing) const {
  if (routing_rows_ == 0 || !message.defined()) return message;
  const int64_t width = model_.config().shape().hidden;
  FORGE_CHECK(message.numel() == (rows_ + routing_rows_) * width,
              "layers {}..{}: a message of {} values, expected [{} + {}, {}]", model_.stage().first_layer,
              model_.stage().end_layer, message.numel(), rows_, routing_rows_, width);
  const Tensor tail = message.view(rows_ * width, {routing_rows_ * width}).to(Device::cpu);
  routing.resize(static_cast<size_t>(model_.stage_routing_size()));
  std::memcpy(routing.data(), tail.raw(), routing.size() * sizeof(double));
  return message.view(0, {rows_, width});
}

models::StageActivations& ModelChunk::saved(int micro_batch) {
  auto it = saved_.find(micro_batch);
  FORGE_CHECK(it != saved_.end(), "layers {}..{}: backward of micro-batch {} without its forward",
              model_.stage().first_layer, model_.stage().end_layer, micro_batch);
  return *it->second;
}

Tensor ModelChunk::forward(int micro_batch, const Tensor& input) {
  std::unique_ptr<models::StageActivations>& slot = saved_[micro_batch];
  FORGE_CHECK(slot == nullptr, "micro-batch {} forward twice", micro_batch);
  models::MicroBatch mb = micro_batch_(micro_batch);
  std::vector<double> before;
  const Tensor hidden = without_routing(input, before);
  if (!before.empty()) mb.routing_before = before.data();
  const models::StageOutput out = model_.forward(mb, hidden, &slot);
  loss_.sum += out.loss.sum, loss_.tokens += out.loss.tokens;
  return with_routing(out.hidden, out.routing);
}

Tensor ModelChunk::backward_input(int micro_batch, const Tensor& doutput) {
  models::StageActivations& s = saved(micro_batch);
  const Tensor dhidden = without_routing(doutput, s.routing_total);
  return with_routing(model_.backward_input(dhidden, s), s.routing_total);
}

void ModelChunk::backward_weight(int micro_batch) {
  model_.backward_weight(saved(micro_batch));
  saved_.erase(micro_batch);
}

Tensor ModelChunk::backward(int micro_batch, const Tensor& doutput) {
  models::StageActivations& s = saved(micro_batch);
  const Tensor dhidden = without_routing(doutput, s.routing_total);
  Tensor dinput = with_routing(model_.backward(dhidden, s), s.routing_total);
  saved_.erase(micro_batch);
  return dinput;
}

}  // namespace forge::train
