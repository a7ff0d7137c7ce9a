// The step's pipeline schedule: runs a step's micro-batches through this rank's stage with the executor
// (parallel/pipeline/executor.h), over the pp group, in the order of the configured schedule's action list.
// The no-pipelining schedule (step.h) is the one-stage case.
#pragma once

#include "forge/comm/comm.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/train/step.h"

namespace forge::train {

class Pipelining final : public Schedule {
 public:
  // rows: the hidden-state rows of one training micro-batch between stages (TrainSetup::stage_rows);
  // sequence_split: tp under sequence parallelism (a batch's rows are split over it), else 1.
  Pipelining(const pipeline::Schedule& schedule, int pp_rank, comm::Communicator& pp, int64_t rows,
             int64_t sequence_split)
      : schedule_(schedule), pp_rank_(pp_rank), pp_(pp), rows_(rows), sequence_split_(sequence_split) {}

  // The loss of the micro-batches this rank's stage ended: all of them on the last stage, none elsewhere.
  models::LossSum run(models::Model& model, int count,
                      const std::function<models::MicroBatch(int)>& micro_batch) override;
  // Evaluation: one batch through every stage, forward only (nothing kept); its loss on the last stage.
  // Collective over the pp group.
  models::LossSum forward_loss(models::Model& model, const models::MicroBatch& mb);

 private:
  const pipeline::Schedule& schedule_;
  int pp_rank_;
  comm::Communicator& pp_;
  int64_t rows_, sequence_split_;
};

}  // namespace forge::train
