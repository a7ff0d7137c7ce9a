#include "forge/train/pipelining.h"

#include "forge/parallel/pipeline/executor.h"
#include "forge/train/pipeline_chunk.h"

namespace forge::train {

models::LossSum Pipelining::run(models::Model& model, int count,
                                const std::function<models::MicroBatch(int)>& micro_batch) {
  FORGE_CHECK(count == schedule_.placement.micro_batches,
              "schedule {} was made for {} micro-batches, the step has {}", schedule_.name,
              schedule_.placement.micro_batches, count);
  ModelChunk chunk(model, micro_batch, rows_);
  pipeline::Executor executor(schedule_, pp_rank_, {&chunk}, pp_, pp_);
  executor.run();
  return chunk.loss();
}

models::LossSum Pipelining::forward_loss(models::Model& model, const models::MicroBatch& mb) {
  const pipeline::Placement& p = schedule_.placement;
  const int stage = p.stage(pp_rank_, 0);
  Tensor input;
  if (stage > 0) {
    const int64_t rows = mb.batch * mb.seq / sequence_split_;
    input = Tensor::empty({rows, model.config().shape().hidden}, DType::f32, model.options().device);
    pp_.recv(input.raw(), input.numel(), comm::Type::f32, p.locate(0, stage - 1).rank, 0).wait();
  }
  const models::StageOutput out = model.forward(mb, input, nullptr);
  if (stage < p.stages - 1)
    pp_.send(out.hidden.raw(), out.hidden.numel(), comm::Type::f32, p.locate(0, stage + 1).rank, 0).wait();
  return out.loss;
}

}  // namespace forge::train
