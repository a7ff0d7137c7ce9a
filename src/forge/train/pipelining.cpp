#include "forge/train/pipelining.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <sstream>

#include "forge/parallel/pipeline/executor.h"
#include "forge/train/pipeline_chunk.h"

namespace forge::train {

Pipelining::Pipelining(const pipeline::Schedule& schedule, int pp_rank, comm::Communicator& pp,
                       const pipeline::Links& links, std::vector<models::Model*> chunks, int64_t rows,
                       int64_t sequence_split, comm::Communicator* mirror,
                       std::vector<std::pair<int, int>> chunk_params)
    : schedule_(schedule),
      pp_rank_(pp_rank),
      pp_(pp),
      links_(links),
      chunks_(std::move(chunks)),
      rows_(rows),
      sequence_split_(sequence_split),
      mirror_(mirror),
      chunk_params_(std::move(chunk_params)) {
  FORGE_CHECK(static_cast<int>(chunks_.size()) == schedule.placement.chunks,
              "schedule {} has {} chunks per rank, got {}", schedule.name, schedule.placement.chunks,
              chunks_.size());
  FORGE_CHECK(!mirror_ || chunk_params_.size() == chunks_.size(), "mirrored chunks need their parameters");
  // Built once (the executor replays the schedule to check it): each step only hands over its micro-batches.
  std::vector<pipeline::Chunk*> views;
  for (models::Model* m : chunks_) {
    model_chunks_.push_back(std::make_unique<ModelChunk>(
        *m, [this](int i) { return micro_batch_(i); }, rows_));
    views.push_back(model_chunks_.back().get());
  }
  executor_ = std::make_unique<pipeline::Executor>(schedule_, pp_rank_, views, links_);
}

Pipelining::~Pipelining() = default;

int Pipelining::micro_batches_per_chunk(int count) const {
  FORGE_CHECK(count == schedule_.placement.micro_batches,
              "schedule {} was made for {} micro-batches, the step has {}", schedule_.name,
              schedule_.placement.micro_batches, count);
  return static_cast<int>(schedule_.placement.micro_batches_of(pp_rank_, 0).size());
}

models::LossSum Pipelining::run(models::Model& model, int count,
                                const std::function<models::MicroBatch(int)>& micro_batch) {
  FORGE_CHECK(&model == chunks_[0], "Pipelining runs the chunks it was made with");
  (void)micro_batches_per_chunk(count);
  micro_batch_ = micro_batch;
  for (const auto& c : model_chunks_) c->reset_loss();
  pipeline::Executor& executor = *executor_;
  if (measure_) pp_.barrier().wait();
  executor.run(measure_);
  if (measure_) {
    measured_.clear();
    const std::vector<pipeline::Action>& list = schedule_.actions[pp_rank_];
    for (size_t i = 0; i < list.size(); ++i) {
      const pipeline::Action& a = list[i];
      if (!pipeline::is_compute(a.op)) continue;
      measured_.push_back({pp_rank_, executor.measured()[i].start, executor.measured()[i].end, a.op, a.chunk,
                           a.micro_batch, a.chunk_b, a.micro_batch_b});
    }
    measure_ = false;
  }
  if (mirror_) sum_mirrored_gradients();
  if (tied_group_ && tied_param_ >= 0) {
    const Tensor g = chunks_[0]->params().grad(tied_param_);
    comm::all_reduce_sum(*tied_group_, g.f32(), g.numel());
  }
  models::LossSum loss;
  for (const auto& c : model_chunks_) loss.sum += c->loss().sum, loss.tokens += c->loss().tokens;
  micro_batch_ = nullptr;  // the step's micro-batches are gone after it
  return loss;
}

// Rank r's chunk holding stage s and its mirror's chunk holding stage s cover the same tensors in the same
// order, laid out alike (a flat run per parameter group: dense, then the experts under expert parallelism);
// both ranks visit their stages in increasing order, so each all-reduce meets its partner. A tied embedding
// is one tensor shared by a rank's end chunks (the embedding of one direction, the head of the other): it is
// left out of the runs and summed over the tied pair after them.
void Pipelining::sum_mirrored_gradients() {
  ParameterStore& store = chunks_[0]->params();
  for (int c : schedule_.placement.chunks_by_stage(pp_rank_)) {
    const auto [first, end] = chunk_params_[c];
    std::vector<int> ids;
    for (int id = first; id < end; ++id)
      if (id != tied_param_) ids.push_back(id);
    std::sort(ids.begin(), ids.end(),
              [&](int a, int b) { return store.info(a).offset < store.info(b).offset; });
    std::vector<std::pair<int64_t, int64_t>> runs;  // [begin, end) of the flat buffer
    for (int id : ids) {
      const int64_t at = store.info(id).offset, n = shape_numel(store.info(id).shape);
      if (!runs.empty() && runs.back().second == at)
        runs.back().second += n;
      else
        runs.push_back({at, at + n});
    }
    for (const auto& [from, to] : runs)
      if (to > from) comm::all_reduce_sum(*mirror_, store.grads().f32() + from, to - from);
  }
}

// Every rank walks the stages in order and takes part where it holds one, so each send meets a receive
// posted by a rank that has finished everything before it.
models::LossSum Pipelining::forward_loss(const models::MicroBatch& mb) {
  const pipeline::Placement& p = schedule_.placement;
  models::LossSum loss;
  Tensor handed;  // the output of this rank's previous stage, when the next one is here too
  std::vector<comm::Request> sends;
  std::vector<Tensor> sent;
  for (int s = 0; s < p.stages; ++s) {
    const pipeline::Slot here = p.locate(0, s);
    if (here.rank != pp_rank_) continue;
    models::Model& model = *chunks_[here.chunk];
    Tensor input;
    if (s > 0) {
      const pipeline::Slot from = p.locate(0, s - 1);
      if (from.rank == pp_rank_) {
        input = handed;
      } else {
        input = Tensor::empty({mb.batch * mb.seq / sequence_split_, model.config().shape().hidden},
                              model.options().residual_dtype, model.options().device);
        const pipeline::Link link = links_.from(pipeline::Message::activation, from.rank);
        link.comm->recv(input.raw(), input.numel(), comm::type_of(input.dtype()), link.peer, link.tag).wait();
      }
    }
    const models::StageOutput out = model.forward(mb, input, nullptr);
    loss.sum += out.loss.sum, loss.tokens += out.loss.tokens;
    if (s + 1 < p.stages) {
      const pipeline::Slot to = p.locate(0, s + 1);
      if (to.rank == pp_rank_) {
        handed = out.hidden;
      } else {
        const pipeline::Link link = links_.to(pipeline::Message::activation, to.rank);
        sends.push_back(link.comm->send(out.hidden.raw(), out.hidden.numel(),
                                        comm::type_of(out.hidden.dtype()), link.peer, link.tag));
        // Started now: a NCCL communicator launches a posted send only at its next test or wait, and the
        // next stage waits for it while this rank may wait for another stage's output.
        sends.back().test();
        sent.push_back(out.hidden);
      }
    }
  }
  comm::wait_all(sends);
  return loss;
}

PipelineTrace gather_pipeline_trace(comm::Communicator& pp, const std::vector<pipeline::TimelineSpan>& mine) {
  std::string text;
  for (const pipeline::TimelineSpan& s : mine)
    text += fmt::format("{} {:.9f} {:.9f} {} {} {} {} {}\n", s.row, s.start, s.end, static_cast<int>(s.op),
                        s.chunk, s.micro_batch, s.chunk_b, s.micro_batch_b);
  const std::vector<std::string> all = comm::all_gather_strings(pp, text);
  PipelineTrace trace;
  if (pp.rank() != 0) return trace;
  std::vector<pipeline::TimelineSpan> spans;
  std::vector<double> busy(all.size(), 0.0);
  double step = 0;
  for (const std::string& part : all) {
    std::istringstream in(part);
    pipeline::TimelineSpan s;
    int op = 0;
    while (in >> s.row >> s.start >> s.end >> op >> s.chunk >> s.micro_batch >> s.chunk_b >>
           s.micro_batch_b) {
      s.op = static_cast<pipeline::Op>(op);
      spans.push_back(s);
      busy.at(s.row) += s.end - s.start;
      step = std::max(step, s.end);
    }
  }
  std::vector<std::string> names;
  for (size_t r = 0; r < all.size(); ++r) {
    names.push_back(fmt::format("pp rank {}", r));
    trace.idle_fraction.push_back(step > 0 ? 1 - busy[r] / step : 0);
  }
  trace.json = pipeline::chrome_trace_json(spans, names, 1.0);
  return trace;
}

}  // namespace forge::train
