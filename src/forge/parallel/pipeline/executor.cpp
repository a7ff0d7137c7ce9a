#include "forge/parallel/pipeline/executor.h"

#include <algorithm>
#include <chrono>

#include "forge/core/error.h"
#include "forge/core/fibers.h"
#include "forge/parallel/pipeline/replay.h"

namespace forge::pipeline {
namespace {

constexpr int kActivation = static_cast<int>(Message::activation),
              kGradient = static_cast<int>(Message::gradient);
const char* kind_name(int kind) { return message_name(static_cast<Message>(kind)); }
int kind_of(Op op) {
  return op == Op::send_activation || op == Op::recv_activation ? kActivation : kGradient;
}

}  // namespace

Executor::Executor(const Schedule& schedule, int rank, std::vector<Chunk*> chunks, const Links& links)
    : schedule_(schedule), rank_(rank), chunks_(std::move(chunks)), links_(links) {
  const Placement& p = schedule.placement;
  FORGE_CHECK(rank >= 0 && rank < p.ranks, "pipeline rank {} of {}", rank, p.ranks);
  FORGE_CHECK(static_cast<int>(chunks_.size()) == p.chunks, "schedule {} places {} chunks per rank, got {}",
              schedule.name, p.chunks, chunks_.size());
  FORGE_CHECK(links.size() == p.ranks && links.rank() == rank,
              "the pp links have rank {} of {}, the schedule {} of {}", links.rank(), links.size(), rank,
              p.ranks);
  replay(schedule);  // refuses a list that could deadlock or leaves work undone, before anything runs
}

void Executor::note_held() {
  size_t held = sending_.size();
  for (int k = 0; k < 2; ++k) held += handed_[k].size() + to_send_[k].size() + receiving_[k].size();
  peak_held_ = std::max(peak_held_, static_cast<int>(held));
}

Tensor Executor::take_input(int kind, Unit unit) {
  if (auto it = receiving_[kind].find(unit); it != receiving_[kind].end()) {
    // On a device the consumer's kernels wait for the message in stream order; on the host, the host waits.
    it->second.comm->wait_on_stream(it->second.request);
    if (measuring_ && input_ready_ < 0)
      input_ready_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    Tensor t = std::move(it->second.buffer);
    receiving_[kind].erase(it);
    return t;
  }
  auto it = handed_[kind].find(unit);
  FORGE_CHECK(it != handed_[kind].end(), "pipeline rank {}: no {} for micro-batch {} of chunk {}", rank_,
              kind_name(kind), unit.second, unit.first);
  Tensor t = std::move(it->second);
  handed_[kind].erase(it);
  return t;
}

// A forward output goes to the next stage, an input gradient to the previous one: on this rank (the bottom of
// a V) it is handed over, elsewhere it waits for its send.
void Executor::deliver(int kind, Unit from, const Tensor& result) {
  const Placement& p = schedule_.placement;
  const int stage = p.stage(rank_, from.first);
  const int neighbour = kind == kActivation ? stage + 1 : stage - 1;
  if (neighbour < 0 || neighbour >= p.stages) return;  // the loss, or the embedding's input
  FORGE_CHECK(result.defined(), "pipeline rank {}: chunk {} returned no {} for stage {}", rank_, from.first,
              kind_name(kind), neighbour);
  const Slot to = p.locate(from.second, neighbour);
  if (to.rank == rank_)
    handed_[kind][{to.chunk, from.second}] = result;
  else
    to_send_[kind][from] = result;
}

void Executor::send(const Action& a) {
  const int kind = kind_of(a.op);
  auto it = to_send_[kind].find({a.chunk, a.micro_batch});
  FORGE_CHECK(it != to_send_[kind].end(), "pipeline rank {}: nothing to send for {}", rank_,
              to_string(a, true));
  Tensor t = std::move(it->second);
  to_send_[kind].erase(it);
  const Link link = links_.to(static_cast<Message>(kind), a.peer);
  comm::Request request = link.comm->send(t.raw(), t.numel(), comm::type_of(t.dtype()), link.peer, link.tag);
  request.test();  // starts it now (see the receive's)
  sending_.push_back({std::move(request), std::move(t)});
}

void Executor::release_completed_sends() {
  std::erase_if(sending_, [](Send& s) { return s.request.test(); });
}

void Executor::execute(size_t index) {
  const std::vector<Action>& list = schedule_.actions[rank_];
  const Action& a = list[index];
  const Placement& p = schedule_.placement;
  auto forward = [&](int c, int m) {
    const Tensor input = p.is_first_stage(rank_, c) ? Tensor() : take_input(kActivation, {c, m});
    deliver(kActivation, {c, m}, chunks_[c]->forward(m, input));
  };
  auto backward = [&](int c, int m, bool input_only) {
    const Tensor doutput = p.is_last_stage(rank_, c) ? Tensor() : take_input(kGradient, {c, m});
    Chunk& chunk = *chunks_[c];
    deliver(kGradient, {c, m}, input_only ? chunk.backward_input(m, doutput) : chunk.backward(m, doutput));
  };
  switch (a.op) {
    case Op::recv_activation:
    case Op::recv_gradient: {
      const int kind = kind_of(a.op);
      Chunk& chunk = *chunks_[a.chunk];
      Tensor buffer = Tensor::empty(chunk.activation_shape(), chunk.activation_dtype(), chunk.device());
      const Link link = links_.from(static_cast<Message>(kind), a.peer);
      comm::Request request =
          link.comm->recv(buffer.raw(), buffer.numel(), comm::type_of(buffer.dtype()), link.peer, link.tag);
      request.test();  // starts it now: a NCCL communicator launches what was posted at its next test
      auto [it, fresh] = receiving_[kind].insert(
          {{a.chunk, a.micro_batch}, {std::move(request), link.comm, std::move(buffer)}});
      FORGE_CHECK(fresh, "pipeline rank {}: {} posted twice", rank_, to_string(a, true));
      break;
    }
    case Op::send_activation:
    case Op::send_gradient:
      send(a);
      break;
    case Op::forward:
      forward(a.chunk, a.micro_batch);
      break;
    case Op::backward:
      backward(a.chunk, a.micro_batch, false);
      break;
    case Op::backward_input:
      backward(a.chunk, a.micro_batch, true);
      break;
    case Op::backward_weight:
      chunks_[a.chunk]->backward_weight(a.micro_batch);
      break;
    case Op::forward_backward: {
      // The forward's output leaves as soon as it is there (its send follows the pair in the list).
      auto send_forward_output = [&] {
        for (size_t j = index + 1; j < list.size() && !is_compute(list[j].op); ++j) {
          if (list[j].op == Op::send_activation && list[j].chunk == a.chunk &&
              list[j].micro_batch == a.micro_batch) {
            send(list[j]);
            done_[j] = true;
          }
        }
      };
      Chunk& fc = *chunks_[a.chunk];
      Chunk& bc = *chunks_[a.chunk_b];
      if (!fc.interleaves_pairs() || !bc.interleaves_pairs()) {
        forward(a.chunk, a.micro_batch);
        send_forward_output();
        backward(a.chunk_b, a.micro_batch_b, false);
        break;
      }
      // Both halves as fibers that take turns at their transfers (core/fibers.h). Both inputs are taken
      // first, as DualPipe does: the pair's receives complete before it computes.
      const Tensor input =
          p.is_first_stage(rank_, a.chunk) ? Tensor() : take_input(kActivation, {a.chunk, a.micro_batch});
      const Tensor doutput =
          p.is_last_stage(rank_, a.chunk_b) ? Tensor() : take_input(kGradient, {a.chunk_b, a.micro_batch_b});
      Tensor dinput;
      run_interleaved(
          [&] {
            deliver(kActivation, {a.chunk, a.micro_batch}, fc.forward(a.micro_batch, input));
            send_forward_output();
          },
          [&] { dinput = bc.backward(a.micro_batch_b, doutput); });
      deliver(kGradient, {a.chunk_b, a.micro_batch_b}, dinput);
      break;
    }
  }
  note_held();
  release_completed_sends();
}

void Executor::run(bool measure) {
  const std::vector<Action>& list = schedule_.actions[rank_];
  done_.assign(list.size(), false);
  measured_.assign(measure ? list.size() : 0, {});
  peak_held_ = 0;
  measuring_ = measure;
  t0_ = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  };
  for (size_t i = 0; i < list.size(); ++i) {
    if (done_[i]) continue;
    const double start = measure ? seconds() : 0;
    input_ready_ = -1;
    execute(i);
    done_[i] = true;
    if (measure) measured_[i] = {input_ready_ >= 0 ? input_ready_ : start, seconds()};
  }
  measuring_ = false;
  for (Send& s : sending_) s.request.wait();
  sending_.clear();
  for (int k = 0; k < 2; ++k)
    FORGE_CHECK(handed_[k].empty() && to_send_[k].empty() && receiving_[k].empty(),
                "pipeline rank {}: {} {}s left after the step of schedule {}", rank_,
                handed_[k].size() + to_send_[k].size() + receiving_[k].size(), kind_name(k), schedule_.name);
  for (size_t c = 0; c < chunks_.size(); ++c)
    FORGE_CHECK(chunks_[c]->live_micro_batches() == 0,
                "pipeline rank {}: chunk {} still holds the activations of {} micro-batches after the step",
                rank_, c, chunks_[c]->live_micro_batches());
}

}  // namespace forge::pipeline
