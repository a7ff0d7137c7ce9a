// The pipeline executor: runs this rank's action list of any schedule (schedule.h) over the pp group.
//
// It holds what is in flight between actions: the inputs received or handed over for each micro-batch's
// forward, the gradients for its backward, the outputs waiting for their send; the chunks hold each
// micro-batch's saved activations until its B (or W). Receives are posted when the list says (one compute
// action ahead of their consumer) and waited on by the consumer; sends are non-blocking and their buffers are
// released as soon as they complete. Each is started as it is posted (a test: forge's NCCL communicator
// launches posted operations only at the next test or wait on it). In an overlapped F&B pair the forward's
// output is sent before the backward starts, so that its transfer runs behind the backward's compute.
// Messages travel on one FIFO channel per (kind, sender, receiver) (links.h): on MPI one communicator with a
// tag per kind, on NCCL a communicator each. On device memory a received input is waited for in the device's
// stream order (Communicator::wait_on_stream), so the host goes on queueing work.
//
// After a step nothing may be left: every message matched, every chunk's activations released.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/tensor.h"
#include "forge/parallel/pipeline/links.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::pipeline {

// One model chunk of this rank as the executor drives it (train/ adapts a model stage to it). The chunk
// keeps each in-flight micro-batch's saved state, and on the last stage its loss.
class Chunk {
 public:
  virtual ~Chunk() = default;
  // The hidden states a micro-batch hands from stage to stage: what a receive is posted into before the
  // message arrives. f32.
  virtual Shape activation_shape() const = 0;
  // The dtype of the hidden states and their gradients between stages (the residual stream's).
  virtual DType activation_dtype() const { return DType::f32; }
  virtual Device device() const { return Device::cpu; }
  // input: the previous stage's output (undefined on the first stage). Returns the output for the next stage
  // (undefined on the last).
  virtual Tensor forward(int micro_batch, const Tensor& input) = 0;
  // doutput: the gradient of forward's output (undefined on the last stage). Returns the gradient of its
  // input (undefined on the first stage).
  virtual Tensor backward_input(int micro_batch, const Tensor& doutput) = 0;
  virtual void backward_weight(int micro_batch) = 0;
  virtual Tensor backward(int micro_batch, const Tensor& doutput) = 0;  // backward_input + backward_weight
  virtual int live_micro_batches() const = 0;  // micro-batches whose activations it still holds
  // True: in an overlapped pair (Op::forward_backward) this chunk's forward and backward may run as two
  // interleaved fibers (core/fibers.h), taking turns where they wait on a transfer (the token dispatcher's
  // all-to-all under expert parallelism). Both chunks of a pair must agree; otherwise the pair runs its
  // forward, then its backward.
  virtual bool interleaves_pairs() const { return false; }
};

// A compute action's start is when its input was there: the time it waited for a message is not its own.
struct MeasuredAction {
  double start = 0, end = 0;  // seconds since the step began
};

class Executor {
 public:
  // chunks[c]: this rank's chunk c of the schedule's placement. links: where each message travels (its rank
  // is this pipeline rank); it must outlive the executor.
  Executor(const Schedule& schedule, int rank, std::vector<Chunk*> chunks, const Links& links);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs this rank's list once (one step's micro-batches). Collective over the pp group. With measure, the
  // start and end of every action are recorded (measured()).
  void run(bool measure = false);
  const std::vector<MeasuredAction>& measured() const { return measured_; }
  // The most tensors (inputs, gradients, outputs, receive buffers) the executor held at once in the last run.
  int peak_held_tensors() const { return peak_held_; }

 private:
  using Unit = std::pair<int, int>;  // (chunk, micro-batch)
  struct Receive {
    comm::Request request;
    comm::Communicator* comm = nullptr;
    Tensor buffer;
  };
  struct Send {
    comm::Request request;
    Tensor buffer;
  };

  void execute(size_t index);
  Tensor take_input(int kind, Unit unit);
  void deliver(int kind, Unit from, const Tensor& result);
  void send(const Action& a);
  void release_completed_sends();
  void note_held();

  const Schedule& schedule_;
  const int rank_;
  std::vector<Chunk*> chunks_;
  const Links& links_;
  std::vector<bool> done_;  // [action] of this run (sends an F&B pair posted early)
  // [kind]: 0 activations (forward inputs / outputs), 1 gradients (backward outputs / inputs).
  std::map<Unit, Tensor> handed_[2];      // computed on this rank for (chunk, micro-batch), not yet consumed
  std::map<Unit, Tensor> to_send_[2];     // results waiting for their send action
  std::map<Unit, Receive> receiving_[2];  // posted receives
  std::vector<Send> sending_;
  std::vector<MeasuredAction> measured_;
  std::chrono::steady_clock::time_point t0_;
  bool measuring_ = false;
  double input_ready_ = -1;  // measuring: when the running action's first input was taken
  int peak_held_ = 0;
};

}  // namespace forge::pipeline
