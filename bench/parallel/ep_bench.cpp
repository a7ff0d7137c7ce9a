// Expert parallelism's overlap, measured (bench/parallel/run_ep.sh), under mpirun -np 2 (ep = 2).
//
// 1. One MoE layer (DeepSeek-V3's shape, scaled down: sigmoid top-k routing, shared experts, experts split
//    over the two ranks): forward + backward of one micro-batch with parallel.ep_overlap on and off,
//    alternated, each the median of --reps steps. The ranks' ExpertParallel is wrapped in a timer, so that
//    the time each rank spends blocked in a transfer's wait (the all-to-all time not hidden) is measured
//    in the same steps: share hidden = 1 - wait(on) / wait(off). The replay beside it: the step with the
//    overlap predicted from the costs measured apart, off - min(shared F, dispatch wait F) - min(shared B,
//    dispatch wait B), i.e. a transfer hidden as far as the shared experts' compute reaches.
// 2. DualPipeV's overlapped pair on a DeepSeek-V3-shaped tiny model (MLA attention, every layer MoE): the
//    forward of one micro-batch and the backward of another, run apart (F + B), back to back as one pair
//    without interleaving, and interleaved at every all-to-all (core/fibers.h, as the executor runs
//    Op::forward_backward under ep). The replay beside it: F + B minus every transfer's wait, the pair with
//    all of its all-to-all hidden under the other micro-batch's compute.
//
// What a CPU can and cannot show: MPI over shared memory copies a large message inside the receiver's MPI
// calls (there is no copy engine and no progress thread), so a transfer "in flight" under compute mostly
// waits for the moment the receiver asks for it; what the overlap hides here is the time one rank waits for
// the other to reach the exchange (skew, the imbalance of its experts' loads), and a small message's eager
// copy. On GPUs NCCL's kernels move the rows while the other stream computes; bench/gpu measures that.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/cpu_features.h"
#include "forge/core/error.h"
#include "forge/core/fibers.h"
#include "forge/core/philox.h"
#include "forge/models/deepseek_v3/deepseek_v3_model.h"
#include "forge/nn/moe.h"
#include "forge/parallel/comm_expert_parallel.h"
#include "mpi_bench.h"

namespace forge {
namespace {

using bench::clock_type;

using bench::median;
using bench::seconds_since;

struct Options {
  int64_t hidden = 512, experts = 16, top_k = 4, expert_ffn = 256, shared_ffn = 512, tokens = 2048;
  int64_t layers = 2, seq = 512, batch = 1, vocab = 2048;  // the pair's model
  std::string dtype = "auto";
  int threads = 1, reps = 7;
  std::string json;
};

[[noreturn]] void usage_and_exit() {
  std::printf(
      "usage: mpirun -np 2 forge_ep_bench [--hidden 512] [--experts 16] [--top-k 4] [--expert-ffn 256]\n"
      "         [--shared-ffn 512] [--tokens 2048] [--layers 2] [--seq 512] [--batch 1] [--vocab 2048]\n"
      "         [--dtype auto|fp32|bf16] [--threads 1] [--reps 7] [--json FILE]\n"
      "  --tokens: the MoE layer's rows per rank; --layers/--seq/--batch/--vocab: the pair's model.\n");
  std::exit(0);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("forge_ep_bench: {} needs a value", arg);
      return argv[++i];
    };
    auto number = [&] { return bench::positive_integer("forge_ep_bench", arg, next()); };
    if (arg == "--hidden")
      o.hidden = number();
    else if (arg == "--experts")
      o.experts = number();
    else if (arg == "--top-k")
      o.top_k = number();
    else if (arg == "--expert-ffn")
      o.expert_ffn = number();
    else if (arg == "--shared-ffn")
      o.shared_ffn = number();
    else if (arg == "--tokens")
      o.tokens = number();
    else if (arg == "--layers")
      o.layers = number();
    else if (arg == "--seq")
      o.seq = number();
    else if (arg == "--batch")
      o.batch = number();
    else if (arg == "--vocab")
      o.vocab = number();
    else if (arg == "--dtype")
      o.dtype = next();
    else if (arg == "--threads")
      o.threads = static_cast<int>(number());
    else if (arg == "--reps")
      o.reps = static_cast<int>(number());
    else if (arg == "--json")
      o.json = next();
    else if (arg == "--help" || arg == "-h")
      usage_and_exit();
    else
      fail("forge_ep_bench: unknown argument '{}' (see --help)", arg);
  }
  if (o.dtype != "auto" && o.dtype != "fp32" && o.dtype != "bf16")
    fail("forge_ep_bench: --dtype is auto, fp32 or bf16, not '{}'", o.dtype);
  if (o.experts % 2 != 0) fail("forge_ep_bench: --experts must be even (two ranks hold half each)");
  if (o.top_k > o.experts) fail("forge_ep_bench: --top-k {} exceeds --experts {}", o.top_k, o.experts);
  if (o.hidden % 64 != 0) fail("forge_ep_bench: --hidden must be a multiple of 64");
  return o;
}

// The expert-parallel group with a stopwatch on every blocking moment: the counts' exchange and each
// transfer's wait (what the overlap did not hide). Transfers are numbered in the order they start.
class TimedEp final : public nn::ExpertParallel {
 public:
  explicit TimedEp(nn::ExpertParallel& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void exchange_counts(const int64_t* send, int64_t* recv, int64_t n) override {
    const auto t0 = clock_type::now();
    inner_.exchange_counts(send, recv, n);
    counts_s += seconds_since(t0);
  }
  std::unique_ptr<Transfer> all_to_all_rows(const Tensor& send, std::span<const int64_t> send_rows,
                                            const Tensor& recv, std::span<const int64_t> recv_rows,
                                            int64_t cols) override {
    for (size_t j = 0; j < send_rows.size(); ++j)
      if (static_cast<int>(j) != rank()) bytes += send_rows[j] * cols * 4;
    if (waits.empty()) {
      first_send.assign(send_rows.begin(), send_rows.end());
      first_recv.assign(recv_rows.begin(), recv_rows.end());
    }
    waits.push_back(0);
    return std::make_unique<Timed>(inner_.all_to_all_rows(send, send_rows, recv, recv_rows, cols), *this,
                                   waits.size() - 1);
  }
  void clear() { waits.clear(), counts_s = 0, bytes = 0; }
  double wait_s() const {
    double s = 0;
    for (double w : waits) s += w;
    return s;
  }

  std::vector<double> waits;  // per transfer since clear()
  double counts_s = 0;
  int64_t bytes = 0;                            // sent to the other rank
  std::vector<int64_t> first_send, first_recv;  // the first transfer's rows per rank (a forward dispatch)
  nn::ExpertParallel& inner() { return inner_; }

 private:
  class Timed final : public Transfer {
   public:
    Timed(std::unique_ptr<Transfer> inner, TimedEp& owner, size_t index)
        : inner_(std::move(inner)), owner_(owner), index_(index) {}
    void wait() override {
      const auto t0 = clock_type::now();
      inner_->wait();
      owner_.waits[index_] += seconds_since(t0);
    }
    void progress() override { inner_->progress(); }

   private:
    std::unique_ptr<Transfer> inner_;
    TimedEp& owner_;
    size_t index_;
  };
  nn::ExpertParallel& inner_;
};

Tensor filler(Shape shape, float scale, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32, Device::cpu);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto bits = philox4x32_10({static_cast<uint32_t>(i), seed, 0, 0}, {23, 0});
    p[i] = scale * (static_cast<float>(bits[0] >> 8) / 16777216.0f - 0.5f);
  }
  return t;
}

// s reduced over the ranks (every rank gets the result).
double over_ranks(comm::Communicator& world, double s, comm::ReduceOp op) {
  world.all_reduce(&s, 1, comm::Type::f64, op).wait();
  return s;
}

// ---- 1. One MoE layer.

struct LayerNumbers {
  double step_off = 0, step_on = 0;       // median step seconds (the slower rank's)
  double wait_off = 0, wait_on = 0;       // median seconds blocked in transfers (mean of the ranks)
  double counts = 0;                      // the counts' exchanges per step (not overlappable)
  double shared_f = 0, shared_b = 0;      // the shared experts' F and B alone
  double dispatch_f = 0, dispatch_b = 0;  // the dispatches' waits without overlap (F, B)
  double alone = 0;                       // one dispatch's rows moved with nothing else going on
  double predicted_on = 0;                // the replay, the link a resource of its own
  double predicted_on_cpu = 0;            // the replay, the copy on the rank's core (MPI on a CPU)
  int64_t bytes = 0;                      // all-to-all bytes this rank sends per step
};

LayerNumbers bench_layer(const Options& o, comm::Communicator& world, TimedEp& ep, DType gemm_dtype) {
  const int64_t local = o.experts / 2, h = o.hidden;
  ParameterStore store;
  nn::MoeParams ids;
  ids.router = store.add("router", {o.experts, h}, true, Init::normal);
  ids.bias = store.add("bias", {o.experts}, false, Init::zeros);
  for (int64_t e = 0; e < local; ++e) {
    const int gate = store.add(fmt::format("gate{}", e), {o.expert_ffn, h}, true, Init::normal);
    store.add(fmt::format("up{}", e), {o.expert_ffn, h}, true, Init::normal);
    if (e == 0) ids.first_gate_up = gate;
  }
  for (int64_t e = 0; e < local; ++e) {
    const int down = store.add(fmt::format("down{}", e), {h, o.expert_ffn}, true, Init::normal);
    if (e == 0) ids.first_down = down;
  }
  ids.shared.gate = store.add("shared.gate", {o.shared_ffn, h}, true, Init::normal);
  ids.shared.up = store.add("shared.up", {o.shared_ffn, h}, true, Init::normal);
  ids.shared.down = store.add("shared.down", {h, o.shared_ffn}, true, Init::normal);
  store.allocate(gemm_dtype == DType::bf16);
  store.initialize(static_cast<uint64_t>(11 + world.rank()));
  if (gemm_dtype == DType::bf16) store.refresh_bf16();
  // The router's weights at a scale that spreads the tokens over the experts (of order one logits).
  const Tensor router = filler({o.experts, h}, 0.5f, 3);
  store.param(ids.router).copy_from(router);

  nn::MoeShape shape;
  shape.hidden = h, shape.experts = o.experts, shape.top_k = o.top_k, shape.expert_ffn = o.expert_ffn;
  shape.shared_ffn = o.shared_ffn, shape.scaling = 2.5f;
  nn::ComputeOptions on;
  on.gemm_dtype = gemm_dtype, on.ep = &ep, on.ep_overlap = true;
  nn::ComputeOptions off = on;
  off.ep_overlap = false;
  nn::MoeStats stats_on, stats_off;
  const nn::Moe moe_on(&store, ids, shape, on, &stats_on, nullptr);
  const nn::Moe moe_off(&store, ids, shape, off, &stats_off, nullptr);
  const nn::Mlp shared(&store, ids.shared, h, o.shared_ffn, on);

  const Tensor x = filler({o.tokens, h}, 2.0f, 100 + static_cast<uint32_t>(world.rank()));
  const Tensor dy = filler({o.tokens, h}, 1e-2f, 200 + static_cast<uint32_t>(world.rank()));
  TimedEp& timed = ep;
  auto slowest = [&](double s) { return over_ranks(world, s, comm::ReduceOp::max); };
  auto mean = [&](double s) { return over_ranks(world, s, comm::ReduceOp::sum) / world.size(); };
  struct Step {
    double seconds, wait, counts, dispatch_f, dispatch_b;
  };
  auto step = [&](const nn::Moe& moe) {
    world.barrier().wait();
    timed.clear();
    const auto t0 = clock_type::now();
    auto saved = moe.new_saved();
    moe.forward(x, 1, o.tokens, *saved, true);
    moe.backward_input(dy, 1, o.tokens, *saved);
    moe.backward_weight(*saved);
    const double seconds = seconds_since(t0);
    // Transfers in order: forward dispatch, forward combine, backward dispatch, backward combine.
    FORGE_CHECK(timed.waits.size() == 4, "forge_ep_bench: {} transfers in a step, expected 4",
                timed.waits.size());
    return Step{seconds, timed.wait_s(), timed.counts_s, timed.waits[0], timed.waits[2]};
  };
  step(moe_on), step(moe_off);  // warm-up
  std::vector<double> t_on, t_off, w_on, w_off, counts, df, db;
  int64_t bytes = 0;
  for (int r = 0; r < o.reps; ++r) {
    const Step a = step(moe_off);
    bytes = timed.bytes;
    const Step b = step(moe_on);
    t_off.push_back(slowest(a.seconds)), t_on.push_back(slowest(b.seconds));
    w_off.push_back(mean(a.wait)), w_on.push_back(mean(b.wait));
    counts.push_back(mean(a.counts)), df.push_back(mean(a.dispatch_f)), db.push_back(mean(a.dispatch_b));
  }
  // One forward dispatch's all-to-all alone, both ranks entering together: what moving the rows costs
  // without waiting for the other rank.
  std::vector<double> alone;
  {
    int64_t out = 0, in = 0;
    for (int64_t r : timed.first_send) out += r;
    for (int64_t r : timed.first_recv) in += r;
    const Tensor send = filler({out, h}, 1.0f, 7), recv = Tensor::empty({in, h}, DType::f32, Device::cpu);
    for (int r = 0; r < o.reps + 1; ++r) {
      world.barrier().wait();
      const auto t0 = clock_type::now();
      timed.inner().all_to_all_rows(send, timed.first_send, recv, timed.first_recv, h)->wait();
      const double t = mean(seconds_since(t0));
      if (r > 0) alone.push_back(t);
    }
  }
  // The shared experts alone (what can hide a dispatch).
  std::vector<double> sf, sb;
  for (int r = 0; r < o.reps + 1; ++r) {
    nn::Mlp::Saved s;
    const auto t0 = clock_type::now();
    shared.forward(x, s, true);
    const double f = seconds_since(t0);
    const auto t1 = clock_type::now();
    shared.backward_input(dy, s);
    const double b = seconds_since(t1);
    shared.backward_weight(s);
    if (r > 0) sf.push_back(f), sb.push_back(b);
  }
  LayerNumbers n;
  n.step_off = median(t_off), n.step_on = median(t_on), n.wait_off = median(w_off), n.wait_on = median(w_on);
  n.counts = median(counts), n.shared_f = mean(median(sf)), n.shared_b = mean(median(sb));
  n.dispatch_f = median(df), n.dispatch_b = median(db), n.bytes = bytes;
  n.alone = median(alone);
  n.predicted_on = n.step_off - std::min(n.shared_f, n.dispatch_f) - std::min(n.shared_b, n.dispatch_b);
  // On a CPU the receiver's core copies the rows inside its wait: only the waiting for the other rank beyond
  // the copy can hide.
  const double skew_f = std::max(0.0, n.dispatch_f - n.alone), skew_b = std::max(0.0, n.dispatch_b - n.alone);
  n.predicted_on_cpu = n.step_off - std::min(n.shared_f, skew_f) - std::min(n.shared_b, skew_b);
  return n;
}

// ---- 2. DualPipeV's overlapped pair on a tiny DeepSeek-V3.

models::DeepseekV3Config pair_config(const Options& o) {
  models::DeepseekV3Config c;
  c.hidden_size = o.hidden / 2, c.intermediate_size = o.hidden, c.moe_intermediate_size = o.expert_ffn / 2;
  c.num_hidden_layers = o.layers, c.first_k_dense_replace = 0;
  c.num_attention_heads = std::max<int64_t>(1, c.hidden_size / 64), c.q_lora_rank = 0;
  c.kv_lora_rank = c.hidden_size / 4, c.qk_nope_head_dim = 32, c.qk_rope_head_dim = 16, c.v_head_dim = 32;
  c.n_routed_experts = o.experts, c.n_shared_experts = 1, c.num_experts_per_tok = o.top_k;
  c.routed_scaling_factor = 2.5, c.num_nextn_predict_layers = 0;
  c.vocab_size = o.vocab, c.max_position_embeddings = o.seq, c.rms_norm_eps = 1e-6;
  c.origin.name = "forge_ep_bench";
  c.validate("forge_ep_bench");
  return c;
}

struct PairNumbers {
  double forward = 0, backward = 0;            // apart
  double forward_wait = 0, backward_wait = 0;  // their transfers' waits
  double sequential = 0, interleaved = 0;      // the pair back to back, and interleaved
  double sequential_no_overlap = 0;            // back to back with ep_overlap off (no shared-expert overlap)
  double predicted = 0;                        // the replay: F + B - all waits
  int64_t switches = 0;                        // fiber switches per interleaved pair
};

PairNumbers bench_pair(const Options& o, comm::Communicator& world, TimedEp& ep, DType gemm_dtype) {
  const models::DeepseekV3Config config = pair_config(o);
  nn::ComputeOptions on;
  on.gemm_dtype = gemm_dtype, on.ep = &ep, on.ep_overlap = true;
  nn::ComputeOptions off = on;
  off.ep_overlap = false;
  models::DeepseekV3Options mo;
  mo.with_mtp = false;
  models::DeepseekV3Model model(config, on, 0.02f, true, models::StageSpec::whole(), nullptr, mo);
  models::DeepseekV3Model baseline(config, off, 0.02f, true, models::StageSpec::whole(), nullptr, mo);
  model.initialize(5), baseline.initialize(5);
  const int64_t n = o.batch * o.seq;
  std::vector<int32_t> ids[2], targets[2];
  for (int m = 0; m < 2; ++m)
    for (int64_t i = 0; i < n; ++i) {
      const auto bits = philox4x32_10(
          {static_cast<uint32_t>(i), static_cast<uint32_t>(m), static_cast<uint32_t>(world.rank()), 0},
          {5, 0});
      ids[m].push_back(static_cast<int32_t>(bits[0] % o.vocab));
      targets[m].push_back(static_cast<int32_t>(bits[1] % o.vocab));
    }
  const float scale = 1.0f / static_cast<float>(2 * n);
  auto mb = [&](int m) {
    return models::MicroBatch{ids[m].data(), targets[m].data(), o.batch, o.seq, scale};
  };
  auto slowest = [&](double s) { return over_ranks(world, s, comm::ReduceOp::max); };
  auto mean = [&](double s) { return over_ranks(world, s, comm::ReduceOp::sum) / world.size(); };
  auto timed = [&](auto&& f) {
    world.barrier().wait();
    ep.clear();
    const auto t0 = clock_type::now();
    f();
    return seconds_since(t0);
  };
  std::vector<double> f, b, fw, bw, seq, inter, seq_off;
  int64_t switches = 0;
  for (int r = 0; r < o.reps + 1; ++r) {  // the first repetition is the warm-up
    std::unique_ptr<models::StageActivations> s0, s1;
    const double tf = timed([&] { model.forward(mb(0), Tensor(), &s0); });
    const double tfw = ep.wait_s();
    const double tb = timed([&] { model.backward(Tensor(), *s0); });
    const double tbw = ep.wait_s();
    model.forward(mb(0), Tensor(), &s0);
    const double ts = timed([&] {
      model.forward(mb(1), Tensor(), &s1);
      model.backward(Tensor(), *s0);
    });
    model.backward(Tensor(), *s1);
    model.forward(mb(0), Tensor(), &s0);
    const int64_t before = fiber_switches();
    const double ti = timed([&] {
      run_interleaved([&] { model.forward(mb(1), Tensor(), &s1); }, [&] { model.backward(Tensor(), *s0); });
    });
    const int64_t made = fiber_switches() - before;
    model.backward(Tensor(), *s1);
    baseline.forward(mb(0), Tensor(), &s0);
    const double to = timed([&] {
      baseline.forward(mb(1), Tensor(), &s1);
      baseline.backward(Tensor(), *s0);
    });
    baseline.backward(Tensor(), *s1);
    if (r == 0) continue;
    f.push_back(slowest(tf)), b.push_back(slowest(tb)), fw.push_back(mean(tfw)), bw.push_back(mean(tbw));
    seq.push_back(slowest(ts)), inter.push_back(slowest(ti)), seq_off.push_back(slowest(to));
    switches = made;
  }
  model.params().zero_grads(), baseline.params().zero_grads();
  PairNumbers p;
  p.forward = median(f), p.backward = median(b), p.forward_wait = median(fw), p.backward_wait = median(bw);
  p.sequential = median(seq), p.interleaved = median(inter), p.sequential_no_overlap = median(seq_off);
  p.predicted = p.forward + p.backward - p.forward_wait - p.backward_wait;
  p.switches = switches;
  return p;
}

double ms(double s) { return 1e3 * s; }

int run(int argc, char** argv) {
  comm::Communicator& world = comm::world(/*force_mpi=*/true);
  const Options o = parse(argc, argv);
  if (world.size() != 2) fail("forge_ep_bench: run under mpirun -np 2 (got {} ranks)", world.size());
  omp_set_num_threads(o.threads);
  const bool bf16 = o.dtype == "bf16" || (o.dtype == "auto" && cpu_has_native_bf16());
  const DType gemm_dtype = bf16 ? DType::bf16 : DType::f32;
  parallel::CommExpertParallel group(&world);
  TimedEp ep(group);
  const bool root = world.rank() == 0;
  if (root)
    std::printf(
        "# forge_ep_bench: 2 ranks x %d thread(s), ep 2, %s GEMMs, %d reps (medians)\n"
        "# MoE layer: %lld tokens per rank, hidden %lld, %lld experts (%lld per rank) top-%lld, expert ffn "
        "%lld, shared ffn %lld\n",
        o.threads, bf16 ? "bf16" : "fp32", o.reps, static_cast<long long>(o.tokens),
        static_cast<long long>(o.hidden), static_cast<long long>(o.experts),
        static_cast<long long>(o.experts / 2), static_cast<long long>(o.top_k),
        static_cast<long long>(o.expert_ffn), static_cast<long long>(o.shared_ffn));
  const LayerNumbers l = bench_layer(o, world, ep, gemm_dtype);
  const double hidden_share = l.wait_off > 0 ? 1 - l.wait_on / l.wait_off : 0;
  if (root) {
    std::printf("%-34s %10s %14s\n", "MoE layer F+B (ep 2)", "step ms", "a2a wait ms");
    std::printf("%-34s %10.2f %14.2f\n", "  overlap off (wait where started)", ms(l.step_off),
                ms(l.wait_off));
    std::printf("%-34s %10.2f %14.2f\n", "  overlap on (shared experts)", ms(l.step_on), ms(l.wait_on));
    std::printf("%-34s %10.2f\n", "  replay, link of its own", ms(l.predicted_on));
    std::printf("%-34s %10.2f\n", "  replay, copy on the core (CPU)", ms(l.predicted_on_cpu));
    std::printf(
        "  a2a: %.2f MiB out per step in 4 transfers, counts exchange %.2f ms | shared experts F %.2f ms, B "
        "%.2f ms | dispatch wait (off) F %.2f ms, B %.2f ms; one dispatch alone %.2f ms\n"
        "  share of the all-to-all wait hidden: %.0f%% measured; step on / off %.3f measured, %.3f replayed "
        "(link of its own), %.3f replayed (copy on the core)\n",
        static_cast<double>(l.bytes) / (1 << 20), ms(l.counts), ms(l.shared_f), ms(l.shared_b),
        ms(l.dispatch_f), ms(l.dispatch_b), ms(l.alone), 100 * hidden_share, l.step_on / l.step_off,
        l.predicted_on / l.step_off, l.predicted_on_cpu / l.step_off);
  }
  const models::DeepseekV3Config pc = pair_config(o);
  if (root)
    std::printf(
        "# pair: DeepSeek-V3-shaped, hidden %lld, %lld MoE layers (MLA, %lld experts top-%lld, expert ffn "
        "%lld, 1 shared), batch %lld x seq %lld per micro-batch, vocab %lld\n",
        static_cast<long long>(pc.hidden_size), static_cast<long long>(pc.num_hidden_layers),
        static_cast<long long>(pc.n_routed_experts), static_cast<long long>(pc.num_experts_per_tok),
        static_cast<long long>(pc.moe_intermediate_size), static_cast<long long>(o.batch),
        static_cast<long long>(o.seq), static_cast<long long>(o.vocab));
  const PairNumbers p = bench_pair(o, world, ep, gemm_dtype);
  if (root) {
    std::printf("%-44s %10s\n", "overlapped pair F(m1) & B(m0)", "ms");
    std::printf("%-44s %10.2f   (F %.2f + B %.2f; a2a waits %.2f + %.2f)\n", "  apart: F + B",
                ms(p.forward + p.backward), ms(p.forward), ms(p.backward), ms(p.forward_wait),
                ms(p.backward_wait));
    std::printf("%-44s %10.2f\n", "  back to back, ep_overlap off", ms(p.sequential_no_overlap));
    std::printf("%-44s %10.2f\n", "  back to back (shared-expert overlap only)", ms(p.sequential));
    std::printf("%-44s %10.2f   (%lld fiber switches)\n", "  interleaved at every all-to-all",
                ms(p.interleaved), static_cast<long long>(p.switches));
    std::printf("%-44s %10.2f\n", "  replay: F + B, every wait hidden", ms(p.predicted));
    std::printf("  interleaved / apart %.3f measured, %.3f replayed\n",
                p.interleaved / (p.forward + p.backward), p.predicted / (p.forward + p.backward));
  }
  if (root && !o.json.empty()) {
    const nlohmann::json j = {{"threads", o.threads},
                              {"gemm_dtype", bf16 ? "bf16" : "fp32"},
                              {"layer",
                               {{"tokens", o.tokens},
                                {"hidden", o.hidden},
                                {"experts", o.experts},
                                {"top_k", o.top_k},
                                {"step_off_s", l.step_off},
                                {"step_on_s", l.step_on},
                                {"wait_off_s", l.wait_off},
                                {"wait_on_s", l.wait_on},
                                {"hidden_share", hidden_share},
                                {"predicted_on_s", l.predicted_on},
                                {"predicted_on_cpu_s", l.predicted_on_cpu},
                                {"dispatch_alone_s", l.alone},
                                {"shared_forward_s", l.shared_f},
                                {"shared_backward_s", l.shared_b},
                                {"counts_s", l.counts},
                                {"a2a_bytes", l.bytes}}},
                              {"pair",
                               {{"forward_s", p.forward},
                                {"backward_s", p.backward},
                                {"forward_wait_s", p.forward_wait},
                                {"backward_wait_s", p.backward_wait},
                                {"sequential_s", p.sequential},
                                {"sequential_no_overlap_s", p.sequential_no_overlap},
                                {"interleaved_s", p.interleaved},
                                {"predicted_s", p.predicted},
                                {"switches", p.switches}}}};
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  comm::finalize();
  return 0;
}

}  // namespace
}  // namespace forge

int main(int argc, char** argv) { return forge::bench::run_mpi_bench(forge::run, argc, argv); }
