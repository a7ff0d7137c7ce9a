// The step's pipeline schedule: runs a step's micro-batches through this rank's chunks with the executor
// (parallel/pipeline/executor.h), over the pp group, in the order of the configured schedule's action list.
// The no-pipelining schedule (step.h) is the one-stage case.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/parallel/pipeline/links.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/parallel/pipeline/timeline.h"
#include "forge/train/step.h"

namespace forge::pipeline {
class Executor;
}

namespace forge::train {
class ModelChunk;

class Pipelining final : public Schedule {
 public:
  // pp: the pp group (host; for the measured run's barrier); links: where the stages' messages travel
  // (TrainSetup::pp_links, over pp on the host, NCCL channels on GPUs). chunks: this rank's chunks in the
  // placement's order (TrainSetup::chunks()). rows: the hidden-state rows of one training micro-batch between
  // stages (TrainSetup::stage_rows); sequence_split: tp under sequence parallelism (a batch's rows are split
  // over it), else 1. DualPipe: mirror pairs this rank with the one holding copies of its stages (a
  // communicator for the gradients' memory), chunk_params are the chunks' parameter ids [first, end) in the
  // shared store (TrainSetup::chunk_params), and each step's gradients of the two copies of a stage are
  // summed over it.
  Pipelining(const pipeline::Schedule& schedule, int pp_rank, comm::Communicator& pp,
             const pipeline::Links& links, std::vector<models::Model*> chunks, int64_t rows,
             int64_t sequence_split, comm::Communicator* mirror = nullptr,
             std::vector<std::pair<int, int>> chunk_params = {});
  ~Pipelining() override;

  // Every chunk computes the same number of micro-batches: all of them, or (DualPipe) one direction's half.
  int micro_batches_per_chunk(int count) const override;
  // The loss of the micro-batches this rank's chunks ended. model: the first chunk.
  models::LossSum run(models::Model& model, int count,
                      const std::function<models::MicroBatch(int)>& micro_batch) override;
  // Evaluation: one batch through every stage, forward only (nothing kept); its loss where the last stage
  // is, 0 elsewhere. Collective over the pp group.
  models::LossSum forward_loss(const models::MicroBatch& mb);

  // Tied embeddings with the first and the last stage on two ranks: after each step's schedule, the
  // gradient of `param` (this rank's embedding or its copy) is summed over `group`, the two ranks (a
  // communicator for the gradients' memory).
  void tie(comm::Communicator* group, int param) { tied_group_ = group, tied_param_ = param; }

  // The next run times every action (after a barrier over pp, so the ranks' clocks start together);
  // measured_spans() then holds this rank's compute actions, in seconds since that start.
  void measure_next_run() { measure_ = true; }
  const std::vector<pipeline::TimelineSpan>& measured_spans() const { return measured_; }

 private:
  void sum_mirrored_gradients();

  const pipeline::Schedule& schedule_;
  int pp_rank_;
  comm::Communicator& pp_;
  const pipeline::Links& links_;
  std::vector<models::Model*> chunks_;
  int64_t rows_, sequence_split_;
  comm::Communicator* mirror_;
  std::vector<std::pair<int, int>> chunk_params_;
  comm::Communicator* tied_group_ = nullptr;
  int tied_param_ = -1;
  bool measure_ = false;
  std::function<models::MicroBatch(int)> micro_batch_;  // the running step's
  std::vector<std::unique_ptr<ModelChunk>> model_chunks_;
  std::unique_ptr<pipeline::Executor> executor_;
  std::vector<pipeline::TimelineSpan> measured_;
};

// The measured timelines of every pp rank as one Chrome trace (collective over pp; the text on pp rank 0,
// "" elsewhere), and each rank's idle share of the step.
struct PipelineTrace {
  std::string json;
  std::vector<double> idle_fraction;  // [pp rank], on pp rank 0
};
PipelineTrace gather_pipeline_trace(comm::Communicator& pp, const std::vector<pipeline::TimelineSpan>& mine);

}  // namespace forge::train
