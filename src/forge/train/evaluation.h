// The run's evaluation and sampling: the held-out loss in bits per byte (periodic and final), the text sample
// and the held-out captions after training. Evaluation is collective (every rank runs its share of the
// held-out windows); generation runs on the first rank, with the whole model read back from the final
// checkpoint when the run's model is split over ranks.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>

#include "forge/models/model.h"
#include "forge/train/config.h"
#include "forge/train/metrics.h"
#include "forge/train/pipelining.h"
#include "forge/train/run_log.h"
#include "forge/train/setup.h"
#include "forge/train/trainer.h"

namespace forge::train {

struct HeldOut {
  models::LossSum loss;
  int64_t bytes = 0;  // bytes of text the predicted tokens stand for
  bool interrupted = false;
  double bits_per_byte() const { return bytes ? loss.sum / std::log(2.0) / static_cast<double>(bytes) : 0.0; }
};

// Loss over held-out windows [0, windows) in batches of the micro-batch size, with the byte count of the
// targets (collective over `world`). Under data parallelism the batches are dealt round-robin over the dp
// replicas and the sums added up over dp (and cp: each context-parallel rank of a replica runs its slices of
// the replica's batch). Ctrl-C (Trainer::stop_flag, agreed over `world` before each batch) ends it early
// with interrupted set. Under expert parallelism the replicas exchange tokens inside each forward, so a rank
// left without a batch in the last round runs one anyway (the first windows again) and discards its loss.
// Under pipeline parallelism (pipelining set) each batch runs through the stages and the loss, which the
// last stage computes, is summed over pp.
HeldOut evaluate(const TrainSetup& setup, Pipelining* pipelining, int64_t windows, comm::Communicator& world);

class Evaluation {
 public:
  // checkpoint_dir: where the final checkpoint is, for generation from a model split over ranks.
  Evaluation(const TrainConfig& config, comm::Communicator& world, const RunLog& log, RunRecords& records,
             TrainSetup& setup, Pipelining* pipelining, std::filesystem::path checkpoint_dir);
  ~Evaluation();

  // eval.batches micro-batches of held-out windows after step `step`: a line and a record. False when
  // Ctrl-C interrupted it (the next step's stop check saves and ends the run).
  bool periodic(int64_t step);
  // Every held-out window after the last step: a line and a record (final), into `result`. False when
  // interrupted.
  bool final(int64_t step, TrainResult& result, double run_seconds);
  // On the first rank: sample.tokens of text from sample.prompt, into result.sample.
  void sample(TrainResult& result);
  // On the first rank, image-text data: sample.captions held-out images answered greedily and scored
  // against their references (a line, examples and a record).
  // Greedy answers to `count` held-out samples scored against their references (models/captions.h):
  // sample.captions for image-text data, sample.answers for fine-tuning conversations (`what`: "captions" or
  // "answers", in the log line and the metrics event).
  void caption(int64_t step, TrainResult& result, int64_t count, const char* what);

 private:
  models::Model& generation_model();

  const TrainConfig& c_;
  comm::Communicator& world_;
  const RunLog& log_;
  RunRecords& records_;
  TrainSetup& setup_;
  Pipelining* pipelining_;
  const std::filesystem::path checkpoint_dir_;
  std::unique_ptr<models::Model> whole_;  // the whole model, when the run's is split
};

}  // namespace forge::train
