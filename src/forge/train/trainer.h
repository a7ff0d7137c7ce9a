// The trainer: micro-batches with gradient accumulation, global-norm clipping, AdamW with an LR schedule,
// held-out evaluation in bits per byte, one log line and one metrics.jsonl record per logged step,
// checkpoints (periodic, final, and on Ctrl-C) with bitwise-exact resume, and a sample, on one process or
// under tensor x data parallelism. Built as setup (setup.h), state (train_state.h), step (step.h) and the
// loop (trainer.cpp), which decides when to log, evaluate, checkpoint, sample and stop.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "forge/train/config.h"

namespace forge::comm {
class Communicator;
}
namespace forge {
class ParameterStore;
}
namespace forge::train {
struct TrainState;
}

namespace forge::train {

struct TrainResult {
  int64_t steps_done = 0;          // optimizer steps completed in total (including resumed ones)
  std::vector<double> losses;      // training loss of each step run in this invocation
  std::vector<double> grad_norms;  // global gradient norm of each of those steps (before clipping)
  double heldout_loss = 0;         // final evaluation, nats per token
  double heldout_bits_per_byte = 0;
  bool interrupted = false;
  int64_t rollbacks = 0;            // automatic rollbacks after anomalies (docs/resilience.md)
  bool time_limit_reached = false;  // stopped by train.max_minutes before the planned/configured steps
  std::string sample;               // generated text ("" when sample.tokens == 0)
  // sample.captions (image-text) or sample.answers (fine-tuning conversations): held-out samples answered
  // greedily after training, how many answers equal their reference token for token, and the share of
  // reference tokens matched at their position.
  int64_t captions = 0, captions_exact = 0;
  double caption_token_accuracy = 0;
  int64_t peak_activation_bytes = 0;
  // FP8 delayed recipe: the scales of every FP8 Linear's operands after the last step ([linears][3]: input,
  // weight, output gradient); empty for the other recipes and without FP8.
  std::vector<float> fp8_scales;
};

// Callbacks into the loop (tests, tools). Each may be empty.
struct TrainerHooks {
  std::function<void(int64_t)> on_step;
  std::function<void(int64_t, ParameterStore&)> on_gradients;
  std::function<void(int64_t, const std::string&)> on_saved;
  std::function<void(TrainState&)> on_state;
};

class Trainer {
 public:
  // world: the ranks of this run (null: comm::world(), MPI's when launched by mpirun, else one rank).
  // Every rank of world calls run() with the same config; [parallel] splits them into groups.
  explicit Trainer(TrainConfig config, comm::Communicator* world = nullptr);
  // Runs to completion, the time limit, or until stop_requested() turns true (then saves a checkpoint).
  TrainResult run();

  // Set from a signal handler (Ctrl-C) or a test; checked between steps.
  static std::atomic<bool>& stop_flag();
  // Called after every optimizer step with the number of steps done (tests use it to stop at a step).
  void on_step(std::function<void(int64_t)> callback) { hooks_.on_step = std::move(callback); }
  // Called after each checkpoint is committed, with its step and why it was saved ("periodic", "final",
  // "interrupted").
  void on_saved(std::function<void(int64_t, const std::string&)> callback) {
    hooks_.on_saved = std::move(callback);
  }
  // Called in every step once its gradients are reduced, before they are checked and applied, with the
  // step's number (1-based, as logged) and the parameters (tests poison a gradient here).
  void on_gradients(std::function<void(int64_t, ParameterStore&)> callback) {
    hooks_.on_gradients = std::move(callback);
  }
  // Called after every step (after on_step) with the run's state: tests snapshot it and restore it here, and
  // the loop continues from whatever step the state then holds.
  void on_state(std::function<void(TrainState&)> callback) { hooks_.on_state = std::move(callback); }

 private:
  TrainConfig config_;
  comm::Communicator* world_ = nullptr;
  TrainerHooks hooks_;
};

// Installs SIGINT/SIGTERM handlers that set Trainer::stop_flag() (a second Ctrl-C exits at once).
void install_stop_signal_handlers();

}  // namespace forge::train
