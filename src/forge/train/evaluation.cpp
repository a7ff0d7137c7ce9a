#include "forge/train/evaluation.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/models/captions.h"
#include "forge/models/pretrained.h"
#include "forge/models/sampling.h"
#include "forge/train/training_data.h"

namespace forge::train {
using namespace forge::models;
using namespace forge::data;
using Clock = std::chrono::steady_clock;

HeldOut evaluate(const TrainSetup& s, Pipelining* pipelining, int64_t windows, comm::Communicator& world) {
  const int64_t seq = s.seq, batch = s.micro, local_seq = s.local_seq();
  const bool every_rank_forwards = s.layout.ep() > 1;
  comm::Communicator& replicas = *s.groups.dp;
  std::vector<int32_t> ids(batch * seq), targets(batch * seq), local_ids(batch * local_seq),
      local_targets(batch * local_seq);
  std::vector<float> pixels;  // image-text data: the batch's images
  HeldOut total;
  ProgressBar progress("eval", windows);  // draws only on a terminal
  // Every rank runs the same number of rounds (some with no batch of their own), so that all of them take
  // each agreed stop decision.
  const int64_t per_round = batch * replicas.size();
  for (int64_t round = 0; round * per_round < windows; ++round) {
    double stop = Trainer::stop_flag().load() ? 1.0 : 0.0;
    if (world.size() > 1) stop = comm::all_reduce_max(world, stop);
    if (stop > 0) {
      Trainer::stop_flag().store(true);
      progress.finish();
      total.interrupted = true;
      return total;
    }
    const int64_t w = round * per_round + batch * replicas.rank();
    const bool mine = w < windows;
    if (!mine && !every_rank_forwards) continue;
    int64_t b = mine ? std::min(batch, windows - w) : std::min(batch, windows);
    const int64_t images = s.data->heldout_batch_images(mine ? w : 0, b, ids.data(), targets.data(), pixels);
    s.context_slice(ids.data(), local_ids.data(), b);
    s.context_slice(targets.data(), local_targets.data(), b);
    MicroBatch mb{local_ids.data(), local_targets.data(), b, local_seq, 0.0f, pixels.data(), images};
    std::vector<int64_t> documents;
    if (s.config.data.document_mask) {
      documents = documents_at_eos(ids.data(), b, local_seq, *s.data->codec().eos_id());
      mb.documents = &documents;
    }
    LossSum part = pipelining ? pipelining->forward_loss(mb) : s.model->forward(mb, Tensor(), nullptr).loss;
    if (!mine) continue;
    total.loss.sum += part.sum, total.loss.tokens += part.tokens;
    for (int64_t i = 0; i < b * local_seq; ++i)  // (targets without a loss, < 0, stand for no text)
      if (local_targets[i] >= 0) total.bytes += s.data->codec().byte_length(local_targets[i]);
    progress.update(w + b);
  }
  progress.finish();
  if (pipelining) {
    double sums[2] = {total.loss.sum, static_cast<double>(total.loss.tokens)};
    comm::all_reduce_sum(s.pp_group(), sums, 2);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
  }
  if (s.dp_group().size() > 1) {
    double sums[3] = {total.loss.sum, static_cast<double>(total.loss.tokens),
                      static_cast<double>(total.bytes)};
    comm::all_reduce_sum(s.dp_group(), sums, 3);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
    total.bytes = static_cast<int64_t>(sums[2]);
  }
  return total;
}

Evaluation::Evaluation(const TrainConfig& config, comm::Communicator& world, const RunLog& log,
                       RunRecords& records, TrainSetup& setup, Pipelining* pipelining,
                       std::filesystem::path checkpoint_dir)
    : c_(config),
      world_(world),
      log_(log),
      records_(records),
      setup_(setup),
      pipelining_(pipelining),
      checkpoint_dir_(std::move(checkpoint_dir)) {}

Evaluation::~Evaluation() = default;

bool Evaluation::periodic(int64_t step) {
  const int64_t windows = std::min(setup_.data->heldout_windows(), c_.eval.batches * setup_.micro);
  const HeldOut e = evaluate(setup_, pipelining_, windows, world_);
  if (e.interrupted) return false;
  const double bpb = e.bits_per_byte();
  log_.say("eval step %lld | held-out loss %.4f | %.4f bits/byte\n", static_cast<long long>(step),
           e.loss.mean(), bpb);
  records_.write({{"step", step}, {"eval_loss", e.loss.mean()}, {"eval_bits_per_byte", bpb}});
  return true;
}

bool Evaluation::final(int64_t step, TrainResult& result, double run_seconds) {
  const HeldOut e = evaluate(setup_, pipelining_, setup_.data->heldout_windows(), world_);
  if (e.interrupted) return false;
  result.heldout_loss = e.loss.mean();
  result.heldout_bits_per_byte = e.bits_per_byte();
  log_.say(
      "final held-out loss %.4f nats/token = %.4f bits per byte (%lld tokens, %lld bytes; %.1f s total)\n",
      result.heldout_loss, result.heldout_bits_per_byte, static_cast<long long>(e.loss.tokens),
      static_cast<long long>(e.bytes), run_seconds);
  records_.write({{"step", step},
                  {"eval_loss", result.heldout_loss},
                  {"eval_bits_per_byte", result.heldout_bits_per_byte},
                  {"final", true}});
  return true;
}

// Generation runs on one process: a model split over tp, pp, ep or cp ranks is read back whole from the
// final checkpoint (onto this rank's device).
Model& Evaluation::generation_model() {
  const parallel::Layout& layout = setup_.layout;
  if (layout.tp() == 1 && layout.pp() == 1 && layout.ep() == 1 && layout.cp() == 1) return *setup_.model;
  if (!whole_) {
    nn::ComputeOptions single;
    single.gemm_dtype = setup_.options.gemm_dtype;
    single.device = setup_.options.device;
    whole_ = load_pretrained_model(checkpoint_dir_, single);
  }
  return *whole_;
}

void Evaluation::caption(int64_t step, TrainResult& result, int64_t count, const char* what) {
  const TrainingData& data = *setup_.data;
  const int64_t n = std::min(count, data.heldout_windows());
  const TextCodec& codec = data.codec();
  Model& model = generation_model();
  const int64_t seq = setup_.seq;
  std::vector<int32_t> ids(static_cast<size_t>(seq)), targets(static_cast<size_t>(seq));
  std::vector<float> pixels;
  models::CaptionScore score;
  const auto start = Clock::now();
  for (int64_t i = 0; i < n && !Trainer::stop_flag().load(); ++i) {
    const int64_t images = data.heldout_batch_images(i, 1, ids.data(), targets.data(), pixels);
    score.add(model, i, ids.data(), targets.data(), seq, pixels.data(), images);
  }
  if (score.count() == 0) {
    log_.say("%s: none of the %lld held-out samples has an answer to compare\n", what,
             static_cast<long long>(n));
    return;
  }
  result.captions = score.count(), result.captions_exact = score.exact();
  result.caption_token_accuracy = score.token_accuracy();
  const models::CaptionDecode decode = [&](std::span<const int32_t> ids) { return codec.decode(ids); };
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  log_.say("%s\n", models::caption_summary(std::string("held-out ") + what, score, seconds).c_str());
  for (const std::string& line : models::caption_lines(score, decode, 4)) log_.say("%s\n", line.c_str());
  records_.write({{"event", what},
                  {"step", step},
                  {"count", score.count()},
                  {"exact", score.exact()},
                  {"token_accuracy", score.token_accuracy()},
                  {"examples", models::caption_examples_json(score, decode)}});
  if (Trainer::stop_flag().load()) {
    result.interrupted = true;
    Trainer::stop_flag().store(false);
  }
}

void Evaluation::sample(TrainResult& result) {
  SamplingOptions so;
  so.max_new_tokens = c_.sample.tokens, so.context = setup_.seq, so.temperature = c_.sample.temperature;
  so.top_k = c_.sample.top_k, so.seed = c_.sample.seed;
  const TextCodec& codec = setup_.data->codec();
  so.vocab_limit = codec.vocab_size();
  std::vector<int32_t> prompt = codec.encode(c_.sample.prompt.empty() ? std::string("\n") : c_.sample.prompt);
  std::vector<int32_t> out = generate(generation_model(), prompt, so);
  result.sample = c_.sample.prompt + codec.decode(out);
  if (Trainer::stop_flag().load()) {  // Ctrl-C while sampling: the run still ends as interrupted (exit 130)
    result.interrupted = true;
    Trainer::stop_flag().store(false);
  }
  log_.say("--- sample (temperature %.2f, top-k %lld) ---\n%s\n---\n", c_.sample.temperature,
           static_cast<long long>(c_.sample.top_k), result.sample.c_str());
}

}  // namespace forge::train
