// The simulator: a rank traced on the dry device has the very ops (op, shape, calls) of the same step run for
// real on the CPU, and the same activation memory; profiles and clusters refuse malformed input with one
// line naming the key; the replayed schedule holds the in-flight activations its schedule implies; a strategy
// that cannot fit says by how much and what dominates.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>

#include "forge/core/error.h"
#include "forge/models/model.h"
#include "forge/sim/estimate.h"
#include "forge/sim/hardware.h"
#include "forge/sim/trace.h"

namespace forge::sim::sim_test {
namespace {

const std::string kLlama = std::string(FORGE_FIXTURE_DIR) + "/../../configs/llama-default.json";
const std::string kDeepSeek = std::string(FORGE_FIXTURE_DIR) + "/../../configs/deepseek-v3-tiny.json";

// op|detail -> calls over every phase of the trace, without the device's copies and memsets (the CPU has
// none).
std::map<std::string, int64_t> calls_of(const RankTrace& t) {
  std::map<std::string, int64_t> out;
  for (const ops::OpProfileRow& r : merge_rows(t.phases()))
    if (r.op != "copy" && r.op != "memset") out[r.op + "|" + r.detail] += r.calls;
  return out;
}

// recompute: a policy, "full/N" for block recompute of each stage's first N layers, or "selective:modules".
Strategy small(int tp, const std::string& recompute) {
  Strategy s;
  const size_t slash = recompute.find('/'), colon = recompute.find(':');
  s.tp = tp, s.dp = 1, s.micro_batch = 2, s.seq = 64,
  s.recompute = nn::recompute_from_name(recompute.substr(0, std::min(slash, colon)));
  if (slash != std::string::npos) s.recompute_layers = std::stoll(recompute.substr(slash + 1));
  if (colon != std::string::npos)
    s.recompute_modules = nn::recompute_modules_from_names(recompute.substr(colon + 1));
  s.sequence_parallel = tp > 1;
  return s;
}

class DryTrace : public ::testing::TestWithParam<std::tuple<std::string, int, std::string>> {};

TEST_P(DryTrace, HasTheOpsAndMemoryOfTheMeasuredStep) {
  const auto& [path, tp, recompute] = GetParam();
  // A vocabulary past one CPU loss-head chunk (2048 columns), so that a CPU and a GPU chunk differ.
  nlohmann::json json = models::read_model_config(path)->to_json();
  json["vocab_size"] = 4096;
  const std::unique_ptr<models::ModelConfig> config = models::parse_model_config(json, path);
  const Strategy s = small(tp, recompute);
  const RankTrace dry = trace_rank(*config, s, 0);
  TraceOptions cpu;
  cpu.device = Device::cpu;
  const RankTrace measured = trace_rank(*config, s, 0, cpu);
  EXPECT_EQ(calls_of(dry), calls_of(measured));
  ASSERT_EQ(dry.chunks.size(), 1u);
  EXPECT_GT(dry.chunks[0].activation_bytes, 0);
  EXPECT_EQ(dry.parameters, measured.parameters);
  // A GPU's trace counts the caching allocator's blocks (512 B and 2 MiB multiples): more than the bytes.
  EXPECT_GT(dry.weights_bytes, measured.weights_bytes);
  EXPECT_EQ(dry.weights_bytes % 512, 0);
  // Traced for a CPU run, the dry step takes the CPU kernels' shapes (the loss head's vocabulary chunks) and
  // counts bytes: its memory is the measured step's. A GPU-shaped trace differs there (8192-column chunks).
  TraceOptions for_cpu;
  for_cpu.shaped_for = Device::cpu;
  const RankTrace dry_cpu = trace_rank(*config, s, 0, for_cpu);
  EXPECT_EQ(calls_of(dry_cpu), calls_of(measured));
  EXPECT_EQ(dry_cpu.weights_bytes, measured.weights_bytes);
  // The same up to a few device-side scalars (a GPU keeps the loss sums on the device, each in a block of the
  // caching allocator's 512 bytes).
  EXPECT_NEAR(static_cast<double>(dry_cpu.chunks[0].activation_bytes),
              static_cast<double>(measured.chunks[0].activation_bytes),
              1e-3 * static_cast<double>(measured.chunks[0].activation_bytes) + 1024);
  auto near = [](int64_t a, int64_t b) {
    return std::abs(static_cast<double>(a - b)) <= 1e-3 * static_cast<double>(std::max(a, b)) + 4096;
  };
  EXPECT_PRED2(near, dry_cpu.chunks[0].forward_first.transient_bytes,
               measured.chunks[0].forward_first.transient_bytes);
  EXPECT_PRED2(near, dry_cpu.chunks[0].backward.transient_bytes, measured.chunks[0].backward.transient_bytes);
  // Tensor parallelism's collectives are recorded, on the critical path of forward and backward.
  if (tp > 1) {
    EXPECT_FALSE(dry.chunks[0].forward.comm.empty());
    EXPECT_EQ(dry.chunks[0].forward.comm[0].group, "tp");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, DryTrace,
    ::testing::Values(std::make_tuple(kLlama, 1, std::string("none")),
                      std::make_tuple(kLlama, 2, std::string("selective")),
                      std::make_tuple(kLlama, 1, std::string("full")),
                      std::make_tuple(kLlama, 2, std::string("full/2")),
                      std::make_tuple(kDeepSeek, 1, std::string("none")),
                      std::make_tuple(kDeepSeek, 1, std::string("selective/1")),
                      std::make_tuple(kLlama, 2, std::string("selective:core_attn,norm")),
                      std::make_tuple(kDeepSeek, 1, std::string("selective:moe_act,norm,mla_up_proj"))));

// Experts with a capacity, padded to it: a real router's expert GEMMs have the shapes of the dry run's
// balanced one, op for op, and the strategy says so in its description and its --set line.
TEST(DryTrace, PadsExpertsToTheirCapacityAsTheRunDoes) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kDeepSeek);
  Strategy s = small(1, "none");
  s.moe_capacity_factor = 1, s.moe_pad_to_capacity = true;
  TraceOptions for_cpu, cpu;
  for_cpu.shaped_for = Device::cpu, cpu.device = Device::cpu;
  const RankTrace dry = trace_rank(*config, s, 0, for_cpu), measured = trace_rank(*config, s, 0, cpu);
  EXPECT_EQ(calls_of(dry), calls_of(measured));
  Strategy dropless = s;
  dropless.moe_capacity_factor = 0, dropless.moe_pad_to_capacity = false;
  EXPECT_NE(calls_of(trace_rank(*config, dropless, 0, cpu)), calls_of(measured));
  EXPECT_NE(s.describe().find("cf1 padded"), std::string::npos) << s.describe();
  EXPECT_NE(s.set_line().find("--set moe.capacity_factor=1 --set moe.pad_to_capacity=true"),
            std::string::npos)
      << s.set_line();
}

// Expert parallelism on the dry device: every rank routes as a balanced router, so each receives as many
// rows for its experts as it routes, and a rank's expert GEMMs do the FLOPs of the whole model's on one rank
// (a dry exchange moves no counts; taking them as zeros would leave the local experts idle).
TEST(DryTrace, ExpertParallelRanksComputeWhatTheyRoute) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kDeepSeek);
  auto expert_flops = [&](int ep) {
    Strategy s = small(1, "none");
    s.dp = ep, s.ep = ep;
    double flops = 0;
    for (const ops::OpProfileRow& r : merge_rows(trace_rank(*config, s, 0).phases()))
      if (r.op.find("grouped_gemm") != std::string::npos) flops += r.flops;
    return flops;
  };
  const double one = expert_flops(1);
  EXPECT_GT(one, 0);
  // Within the remainder rows of a token count the experts do not divide (the MTP layer's 1020 tokens), which
  // the balanced router gives the first experts, those of rank 0.
  EXPECT_NEAR(expert_flops(2), one, 0.005 * one);
}

// Expert parallelism's overlap: the dispatch all-to-all runs while the shared experts compute. The dry
// trace notes those ops on the transfer's event (none without the overlap), and the estimate hides the
// transfer under them, all but the link's host share (a share of 1 hides nothing); overlapped F&B pairs of
// micro-batches hide more.
TEST(DryTrace, ExpertTransfersNoteTheOpsTheyOverlap) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kDeepSeek);
  Strategy s = small(1, "none");
  s.dp = 2, s.ep = 2;
  auto overlapped_calls = [&](bool overlap) {
    s.ep_overlap = overlap;
    const RankTrace t = trace_rank(*config, s, 0);
    int64_t calls = 0, transfers = 0;
    for (const CommEvent& e : t.chunks.at(0).forward.comm) {
      if (e.group != "ep" || e.op != "all_to_all") continue;
      ++transfers;
      for (const ops::OpProfileRow& r : e.overlapped) calls += r.calls;
    }
    EXPECT_GT(transfers, 0);
    return calls;
  };
  EXPECT_GT(overlapped_calls(true), 0);
  EXPECT_EQ(overlapped_calls(false), 0);
  // With two micro-batches they run as an overlapped pair, whose peak is traced as it interleaves: above one
  // micro-batch's activations (two are in flight), below two whole ones (B0 frees as F1 fills).
  s.ep_overlap = true, s.grad_accum = 2;
  const ChunkTrace paired = trace_rank(*config, s, 0).chunks.at(0);
  EXPECT_GT(paired.paired_peak_bytes, paired.activation_bytes);
  EXPECT_LT(paired.paired_peak_bytes, 2 * paired.activation_bytes + paired.backward.transient_bytes);
  s.ep_overlap = false;
  EXPECT_EQ(trace_rank(*config, s, 0).chunks.at(0).paired_peak_bytes, 0);
}

// Generation as forge generate runs it: the dry trace (shaped for the CPU) holds the measured run's weights
// and KV cache to the byte, its prefill peak within a few hundred bytes and its ops call for call; the cache
// is forge's own (layers x keys and values x positions x kv heads x head_dim floats).
TEST(GenerationTrace, IsTheMeasuredGenerationsMemoryAndOps) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  GenerationRequest r;
  r.batch = 2, r.prompt = 24, r.new_tokens = 9;
  TraceOptions for_cpu, cpu;
  for_cpu.shaped_for = Device::cpu, cpu.device = Device::cpu;
  const GenerationTrace dry = trace_generation(*config, r, for_cpu),
                        measured = trace_generation(*config, r, cpu);
  const models::ModelShape shape = config->shape();
  EXPECT_EQ(dry.cache_bytes, shape.layers * 2 * r.batch * (r.prompt + r.new_tokens - 1) * shape.kv_heads *
                                 (shape.hidden / shape.heads) * 4);
  EXPECT_EQ(dry.cache_bytes, measured.cache_bytes);
  EXPECT_EQ(dry.weights_bytes, measured.weights_bytes);
  // The prefill's peak, up to a few values a device keeps where the CPU keeps them on the stack.
  EXPECT_NEAR(static_cast<double>(dry.prefill.transient_bytes),
              static_cast<double>(measured.prefill.transient_bytes), 1024);
  auto calls = [](const Phase& p) {
    std::map<std::string, int64_t> out;
    for (const ops::OpProfileRow& row : p.rows)
      if (row.op != "copy" && row.op != "memset") out[row.op + "|" + row.detail] += row.calls;
    return out;
  };
  EXPECT_EQ(calls(dry.prefill), calls(measured.prefill));
  EXPECT_EQ(calls(dry.decode), calls(measured.decode));
  EXPECT_FALSE(dry.decode.rows.empty());
  // One new token is sampled from the prefill: no decoding step.
  r.new_tokens = 1;
  EXPECT_TRUE(trace_generation(*config, r).decode.rows.empty());
  r.prompt = shape.max_positions + 1;
  EXPECT_THROW(trace_generation(*config, r), Error);
}

const char* kProfile = R"(
[hardware]
name = "test device"
memory_gib = 1.0
bf16_tflops = 100
gemm_efficiency = [[6.0, 0.25], [9.0, 0.75]]
memory_bandwidth_gbs = 1000
op_overhead_us = 1
[link.node]
bandwidth_gbs = 100
latency_us = 2
[measured]
"gemm|bf16 NT 8x8x8 -> fp32" = 0.5
)";

TEST(HardwareProfile, CostsRowsByMeasurementThenCurve) {
  const HardwareProfile h = HardwareProfile::parse(kProfile, "test.toml");
  // Measured: 0.5 s a call, plus the 1 us of host work around each.
  EXPECT_DOUBLE_EQ(h.row_seconds({"gemm", "bf16 NT 8x8x8 -> fp32", 3, 0, 3 * 1024.0, 0}), 3 * (0.5 + 1e-6));
  EXPECT_DOUBLE_EQ(h.efficiency(1e6), 0.25);
  EXPECT_DOUBLE_EQ(h.efficiency(1e9), 0.75);
  EXPECT_NEAR(h.efficiency(std::pow(10.0, 7.5)), 0.5, 1e-12);
  // 2 calls of 1e9 FLOPs at 75% of 100 TFLOP/s, plus 1 us each.
  EXPECT_NEAR(h.row_seconds({"gemm", "bf16 NN 1000x1000x500 -> fp32", 2, 0, 2e9, 0}),
              2 * (1e9 / 75e12 + 1e-6), 1e-15);
  // Memory-bound: bytes at the bandwidth.
  EXPECT_NEAR(h.row_seconds({"adamw", "n=1", 1, 0, 0, 1e9}), 1e-3 + 1e-6, 1e-15);
  EXPECT_EQ(h.network, h.node);  // no network link: the node's
  // It writes what it reads.
  const HardwareProfile again = HardwareProfile::parse(h.to_toml(), "again.toml");
  EXPECT_EQ(again.measured, h.measured);
  EXPECT_EQ(again.gemm_efficiency, h.gemm_efficiency);
  EXPECT_EQ(again.node, h.node);
  HardwareProfile shared = h;
  shared.node = {50, 3, 20, 0.25};
  EXPECT_EQ(HardwareProfile::parse(shared.to_toml(), "shared.toml").node, shared.node);
}

void expect_refused(const std::string& text, const std::string& culprit) {
  try {
    (void)HardwareProfile::parse(text, "bad.toml");
    ADD_FAILURE() << "accepted; expected an error naming " << culprit;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(culprit), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

TEST(HardwareProfile, RefusesMalformedInput) {
  std::string text = kProfile;
  expect_refused(text + "\n[hardware2]\n", "unknown key 'hardware2'");
  std::string misspelt = text;
  misspelt.replace(misspelt.find("bf16_tflops"), 11, "bf16_tflop");
  expect_refused(misspelt, "bf16_tflop");
  std::string negative = text;
  negative.replace(negative.find("memory_gib = 1.0"), 16, "memory_gib = -1");
  expect_refused(negative, "hardware.memory_gib");
  std::string curve = text;
  curve.replace(curve.find("[[6.0, 0.25], [9.0, 0.75]]"), 26, "[[9.0, 0.25], [6.0, 0.75]]");
  expect_refused(curve, "gemm_efficiency");
  std::string share = text;
  share.replace(share.find("latency_us = 2"), 14, "latency_us = 2\nhost_share = 1.5");
  expect_refused(share, "link.node.host_share");
  std::string host = text;
  host.replace(host.find("op_overhead_us = 1"), 18, "op_overhead_us = 1\nhost_link_gbs = 50");
  expect_refused(host, "give all three or none");
  expect_refused("[hardware\n", "bad.toml:");
  expect_refused("[link.node]\nbandwidth_gbs = 1\n", "missing table [hardware]");
  EXPECT_THROW((void)Cluster::parse("[cluster]\nhardware = \"no-such-gpu\"\n", "c.toml"), Error);
}

TEST(Cluster, PlacesGroupsOnTheirLinks) {
  Cluster c = Cluster::single_node(HardwareProfile::parse(kProfile, "t.toml"), 4);
  c.nodes = 2;
  c.hardware.network = {10, 20};
  EXPECT_EQ(c.link({0, 1, 2, 3}).bandwidth_gbs, 100);
  EXPECT_EQ(c.link({2, 6}).bandwidth_gbs, 10);
  // A ring all-reduce moves 2 (n-1)/n of the buffer.
  EXPECT_NEAR(comm_seconds({"all_reduce", "dp", 4, 4000000000}, {100, 0}), 2 * 0.75 * 0.04, 1e-12);
  EXPECT_EQ(comm_seconds({"all_reduce", "dp", 1, 4000}, {100, 0}), 0);
}

TEST(Simulator, ReplaysTheScheduleForMemoryAndTime) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 64;
  Simulator sim(*config, Cluster::single_node(h, 8));
  Strategy s = small(1, "none");
  s.pp = 2, s.grad_accum = 8;
  // fp32 activations: in this small model bf16 ones leave the last stage's logits the larger peak.
  s.activation_dtype = DType::f32;
  const Estimate one_f_one_b = sim.estimate(s);
  // 1F1B: pp rank 0 holds P = 2 micro-batches' activations at its peak.
  EXPECT_EQ(one_f_one_b.memory.pp_rank, 0);
  EXPECT_EQ(one_f_one_b.memory.in_flight, 2);
  EXPECT_GT(one_f_one_b.time.bubble, 0);
  EXPECT_TRUE(one_f_one_b.fits);
  // More micro-batches per step: the same bubble over a longer step.
  s.grad_accum = 16;
  const Estimate longer = sim.estimate(s);
  EXPECT_LT(longer.time.bubble / longer.time.step, one_f_one_b.time.bubble / one_f_one_b.time.step);
  // Full recompute keeps less.
  s.recompute = nn::Recompute::full;
  const Estimate full = sim.estimate(s);
  EXPECT_LT(full.memory.activations, longer.memory.activations);
  // Block recompute (one of each stage's three layers) keeps less than none and more than full, and
  // spends less time recomputing than full.
  s.recompute_layers = 1;
  const Estimate block = sim.estimate(s);
  EXPECT_LT(block.memory.activations, longer.memory.activations);
  EXPECT_GT(block.memory.activations, full.memory.activations);
  EXPECT_LT(block.time.step, full.time.step);
  EXPECT_GT(block.time.step, longer.time.step);
  EXPECT_NE(s.describe().find("rc:full/1"), std::string::npos) << s.describe();
  s.pp_layers = "2,4";
  EXPECT_NE(s.describe().find("1f1b uneven"), std::string::npos) << s.describe();
  EXPECT_NE(s.set_line().find("--set parallel.schedule=1f1b --set parallel.pp_layers=2,4"), std::string::npos)
      << s.set_line();
  s.pp_layers.clear();
  EXPECT_NE(s.set_line().find("--set train.recompute=full --set train.recompute_layers=1"), std::string::npos)
      << s.set_line();
  // Selective recompute of every module keeps less than the default selective set and more than full.
  Strategy m = s;
  m.recompute_layers = 0, m.recompute = nn::Recompute::selective;
  const Estimate selective = sim.estimate(m);
  m.recompute_modules = nn::recompute_modules_from_names("core_attn,mlp_act,moe_act,norm,mla_up_proj");
  const Estimate fine = sim.estimate(m);
  EXPECT_LT(fine.memory.activations, selective.memory.activations);
  EXPECT_GT(fine.memory.activations, full.memory.activations);
  EXPECT_NE(m.describe().find("rc:selective[attn,mlp,moe,norm,up]"), std::string::npos) << m.describe();
  EXPECT_NE(m.set_line().find("--set train.recompute_modules=core_attn,mlp_act,moe_act,norm,mla_up_proj"),
            std::string::npos)
      << m.set_line();
  // Data parallelism adds the reductions; ZeRO-1 shards the optimizer state.
  Strategy d = small(1, "none");
  d.dp = 4;
  const Estimate replicated = sim.estimate(d);
  EXPECT_GT(replicated.time.dp_comm, 0);
  d.distributed_optimizer = true;
  const Estimate sharded = sim.estimate(d);
  EXPECT_LT(sharded.memory.optimizer, replicated.memory.optimizer);
  // Too many ranks for the cluster: one line.
  d.dp = 16;
  EXPECT_THROW(sim.estimate(d), Error);
}

// Host-progressed collectives (MPI on CPUs): the link's host share of every overlapped bucket is taken from
// the compute, so it adds to the step whole even where the link hides under backward.
TEST(Simulator, ChargesTheHostShareOfOverlappedReductionsToTheStep) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 64;
  h.node.bandwidth_gbs = 1000;  // a fast link: the reductions hide under backward
  Strategy d = small(1, "none");
  d.dp = 2;
  const Estimate hidden = Simulator(*config, Cluster::single_node(h, 2)).estimate(d);
  ASSERT_GT(hidden.time.dp_comm, 0);
  h.node.host_share = 0.5;
  const Estimate shared = Simulator(*config, Cluster::single_node(h, 2)).estimate(d);
  EXPECT_DOUBLE_EQ(shared.time.dp_comm, hidden.time.dp_comm);
  // What was exposed past backward can only shrink (backward ends later); the stall adds in full.
  const double stall = 0.5 * hidden.time.dp_comm;
  EXPECT_LE(shared.time.step - hidden.time.step, stall + 1e-12);
  EXPECT_GE(shared.time.step - hidden.time.step, stall - hidden.time.dp_exposed - 1e-12);
  EXPECT_GE(shared.time.dp_exposed, stall);
  // One rank has no reduction to share.
  d.dp = 1;
  HardwareProfile unshared = h;
  unshared.node.host_share = 0;
  EXPECT_DOUBLE_EQ(Simulator(*config, Cluster::single_node(h, 1)).estimate(d).time.step,
                   Simulator(*config, Cluster::single_node(unshared, 1)).estimate(d).time.step);
}

TEST(Simulator, HidesExpertTransfersUnderTheirOverlapAllButTheHostShare) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kDeepSeek);
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 64;
  h.node.bandwidth_gbs = 2;  // transfers of the order of the compute that can hide them
  Strategy s = small(1, "none");
  s.dp = 2, s.ep = 2, s.grad_accum = 4;
  auto step = [&](bool overlap, double host_share) {
    h.node.host_share = host_share;
    s.ep_overlap = overlap;
    return Simulator(*config, Cluster::single_node(h, 2)).estimate(s).time;
  };
  // What the overlap saves at a host share (which also lengthens the data-parallel reductions' backward).
  auto saved = [&](double host_share) { return step(false, host_share).step - step(true, host_share).step; };
  EXPECT_GT(step(false, 0).ep_comm, 0);
  EXPECT_GT(saved(0), saved(0.5));
  EXPECT_GT(saved(0.5), 0);
  EXPECT_NEAR(saved(1), 0, 1e-12);
}

TEST(Simulator, EstimatesGenerationAndSaysWhatDoesNotFit) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 64;
  Simulator sim(*config, Cluster::single_node(h, 1));
  GenerationRequest r;
  r.prompt = 32, r.new_tokens = 17;
  const GenerationEstimate e = sim.estimate_generation(r);
  EXPECT_TRUE(e.fits);
  EXPECT_EQ(e.total, e.weights + e.cache + e.transient);
  EXPECT_GT(e.prefill, 0);
  EXPECT_NEAR(e.total_seconds, e.prefill + 16 * e.decode_per_token, 1e-12);
  r.batch = 8;  // eight caches
  EXPECT_EQ(sim.estimate_generation(r).cache, 8 * e.cache);
  h.memory_gib = 1e-3;
  const GenerationEstimate small = Simulator(*config, Cluster::single_node(h, 1)).estimate_generation(r);
  EXPECT_FALSE(small.fits);
  EXPECT_NE(small.over.find("most of it the weights"), std::string::npos) << small.over;
}

TEST(Simulator, SaysByHowMuchAStrategyDoesNotFit) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 0.001;
  Simulator sim(*config, Cluster::single_node(h, 1));
  const Estimate e = sim.estimate(small(1, "none"));
  EXPECT_FALSE(e.fits);
  EXPECT_NE(e.over.find("over the"), std::string::npos) << e.over;
  EXPECT_NE(e.over.find("most of it"), std::string::npos) << e.over;
}

// Context parallelism on the dry device: each rank holds its chunks (half the activations at cp 2), runs
// the ring's attention blocks (half the causal attention's FLOPs) with its key/value hops on the cp group,
// each noting the blocks it travels under (the backward's last gradient hop under nothing), or the
// all-to-all's exchanges; op for op the measured step's; the estimate says so, and a sequence that does not
// split is refused with one line.
// bf16 activations (with a bf16 residual stream) halve the tensor-parallel, context-parallel and pipeline
// messages of a step, counted in the traced run's own collectives and stage outputs; the gradients'
// data-parallel reductions stay fp32. The
// activations one micro-batch keeps drop by the share that is now bf16; the numbers are printed for the
// record.
TEST(DryTrace, Bf16ActivationsHalveTheMessages) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  TraceOptions for_cpu;
  for_cpu.shaped_for = Device::cpu;
  struct Bytes {
    std::map<std::string, int64_t> by_group;
    int64_t activations = 0, pipeline = 0;  // kept by one micro-batch; handed to the next stage
  };
  auto traced = [&](DType activations) {
    Strategy s = small(2, "none");
    s.pp = 2, s.dp = 2, s.grad_accum = 4;
    s.activation_dtype = activations;
    Bytes b;
    for (int pp_rank : {0, 1}) {
      const RankTrace t = trace_rank(*config, s, pp_rank, for_cpu);
      for (const Phase* phase : t.phases())
        for (const CommEvent& e : phase->comm) b.by_group[e.group] += e.bytes;
      for (const ChunkTrace& c : t.chunks) b.activations += c.activation_bytes, b.pipeline += c.output_bytes;
    }
    return b;
  };
  const Bytes fp32 = traced(DType::f32), bf16 = traced(DType::bf16);
  for (const auto& [group, bytes] : fp32.by_group)
    std::printf("%s: %lld bytes with fp32 activations, %lld with bf16\n", group.c_str(),
                static_cast<long long>(bytes), static_cast<long long>(bf16.by_group.at(group)));
  std::printf("activations one micro-batch keeps: %lld bytes fp32, %lld bf16 (%.2fx)\n",
              static_cast<long long>(fp32.activations), static_cast<long long>(bf16.activations),
              static_cast<double>(fp32.activations) / static_cast<double>(bf16.activations));
  ASSERT_TRUE(fp32.by_group.count("tp") && fp32.by_group.count("dp"));
  // Tensor parallelism: the layers' gathers and reductions and the embedding's sum of its vocabulary shards
  // halve; the loss head's per-row statistics stay fp32 (here 4% of the fp32 bytes: 0.52x).
  EXPECT_LT(bf16.by_group.at("tp"), 0.53 * static_cast<double>(fp32.by_group.at("tp")));
  EXPECT_GT(bf16.by_group.at("tp"), 0.5 * static_cast<double>(fp32.by_group.at("tp")));
  EXPECT_EQ(2 * bf16.pipeline, fp32.pipeline);                // the hidden states between stages
  EXPECT_EQ(bf16.by_group.at("dp"), fp32.by_group.at("dp"));  // fp32 gradient reductions
  EXPECT_LT(bf16.activations, fp32.activations);
  // parallel.grad_reduce_in_bf16 halves them.
  {
    Strategy s = small(2, "none");
    s.pp = 2, s.dp = 2, s.grad_accum = 4;
    s.grad_reduce_in_bf16 = true;
    int64_t dp = 0;
    for (int pp_rank : {0, 1})
      for (const Phase* phase : trace_rank(*config, s, pp_rank, for_cpu).phases())
        for (const CommEvent& e : phase->comm) dp += e.group == "dp" ? e.bytes : 0;
    EXPECT_EQ(2 * dp, fp32.by_group.at("dp"));
  }
  // Context parallelism: the ring's key/value hops and their gradients' hops, and the all-to-all's
  // exchanges but the log-sum-exp's, carry bf16.
  for (const char* comm : {"p2p", "a2a"}) {
    auto cp_bytes = [&](DType activations) {
      Strategy s = small(1, "none");
      s.cp = 2, s.cp_comm = parallel::context_attention_from_name(comm);
      s.activation_dtype = activations;
      int64_t bytes = 0;
      for (const Phase* phase : trace_rank(*config, s, 0, for_cpu).phases())
        for (const CommEvent& e : phase->comm) bytes += e.group == "cp" ? e.bytes : 0;
      return static_cast<double>(bytes);
    };
    const double cp32 = cp_bytes(DType::f32), cp16 = cp_bytes(DType::bf16);
    std::printf("cp (%s): %.0f bytes with fp32 activations, %.0f with bf16\n", comm, cp32, cp16);
    EXPECT_GE(cp16, 0.5 * cp32) << comm;
    EXPECT_LT(cp16, (comm == std::string("p2p") ? 0.51 : 0.6) * cp32) << comm;
  }
}

// The distributed optimizer's static memory per parameter, traced as a run holds it: in bf16 2 bytes of bf16
// weights and 4 of fp32 gradient whole, 12/dp of fp32 masters and Adam moments, plus the parameters modules
// read in fp32 (norm weights: the embedding's rows go straight into the bf16 residual stream) kept whole in
// fp32; in fp32 the weights are the masters, 8 + 8/dp; without it 10 + 8 (bf16) and 8 + 8 (fp32). No other
// buffer beside them: the collectives run in place (the toy LLaMA's buckets all divide by dp).
TEST(DryTrace, DistributedOptimizerHoldsMegatronsBytesPerParameter) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  TraceOptions for_cpu;
  for_cpu.shaped_for = Device::cpu;
  const nlohmann::json json = config->to_json();
  const int64_t hidden = json["hidden_size"], layers = json["num_hidden_layers"];
  const int64_t norms = (2 * layers + 1) * hidden;  // the fp32 weights kept whole under sharded masters
  for (DType dtype : {DType::bf16, DType::f32})
    for (int dp : {1, 2, 4})
      for (bool sharded : {false, true}) {
        Strategy s = small(1, "none");
        s.dp = dp, s.grad_accum = 1, s.distributed_optimizer = sharded;
        s.dtype = s.activation_dtype = dtype;
        const RankTrace t = trace_rank(*config, s, 0, for_cpu);
        const double n = static_cast<double>(t.parameters);
        const double weights = dtype == DType::bf16 ? (sharded ? 6 * n + 4.0 * norms : 10 * n) : 8 * n;
        const double optimizer =
            sharded ? (dtype == DType::bf16 ? 12 * (n - norms) + 8.0 * norms : 8 * n) / dp : 8 * n;
        const std::string what = fmt::format("{} dp {}{}", dtype_name(dtype), dp, sharded ? " sharded" : "");
        // The model's other buffers (RoPE tables: 32 KiB here) and the allocator's 512-byte rounding.
        EXPECT_NEAR(static_cast<double>(t.weights_bytes), weights, 65536) << what;
        EXPECT_NEAR(static_cast<double>(t.static_bytes - t.weights_bytes), optimizer,
                    8192 + 0.001 * optimizer)
            << what;
        // The updated weights' gather: each rank sends its shard in bf16 with the bf16 shadow (and its norms'
        // fp32 beside), in fp32 otherwise (Megatron's bf16 parameter gather halves the bytes).
        int64_t gathered = 0;
        for (const CommEvent& ev : t.step_end.comm)
          if (ev.group == "dp" && ev.op == "all_gather") gathered += ev.bytes;
        if (!sharded || dp == 1) {
          EXPECT_EQ(gathered, 0) << what;
        } else if (dtype == DType::bf16) {
          EXPECT_GE(static_cast<double>(gathered), 2 * n / dp) << what;
          EXPECT_LE(static_cast<double>(gathered), 2 * n / dp + 4.0 * norms + 1024) << what;
        } else {
          EXPECT_NEAR(static_cast<double>(gathered), 4 * n / dp, 1024) << what;
        }
      }
}

// Optimizer offload on the dry device: the device keeps 2 bytes of bf16 weights and 4 of fp32 gradient per
// parameter and the norms' fp32 weights, and no optimizer state; the host holds 16 bytes per owned element
// (fp32 master, two moments, the gradient's landing place) and a bucket's bf16 staging, of everything
// replicated or 1/dp sharded, and each step copies 6 bytes per owned element (the gradient down in fp32,
// the updated weight back in bf16; the norms' in fp32 too). The estimate
// costs that traffic over the host link and the update's 28 bytes per element over the host's memory,
// refuses offload on hardware that does not describe its host, and says when the host's share is too small.
TEST(DryTrace, OptimizerOffloadLeavesTheDeviceItsBf16WeightsAndGradients) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  const nlohmann::json json = config->to_json();
  const int64_t hidden = json["hidden_size"], layers = json["num_hidden_layers"];
  const int64_t norms = (2 * layers + 1) * hidden;
  for (int dp : {1, 2, 4})
    for (bool sharded : {false, true}) {
      Strategy s = small(1, "none");
      s.dp = dp, s.grad_accum = 1, s.distributed_optimizer = sharded, s.optimizer_offload = true;
      const RankTrace t = trace_rank(*config, s, 0);
      const std::string what = fmt::format("dp {}{}", dp, sharded ? " sharded" : "");
      const int64_t n = t.parameters, owned = sharded ? n / dp : n;
      // The model's other buffers (RoPE tables) and the allocator's rounding to 2 MiB blocks from 1 MiB.
      EXPECT_NEAR(static_cast<double>(t.weights_bytes), 6.0 * static_cast<double>(n) + 4.0 * norms, 8 << 20)
          << what;
      EXPECT_NEAR(static_cast<double>(t.static_bytes - t.weights_bytes), 0, 4 << 20) << what;
      EXPECT_EQ(t.offload_update_elements, owned) << what;
      // And the bf16 staging of the widest bucket's owned part.
      EXPECT_GE(t.host_bytes, 16 * owned) << what;
      EXPECT_LE(t.host_bytes, 18 * owned) << what;
      // The gradient down in fp32, the weight back in bf16 (and the kept norms' in fp32 too), pipelined over
      // the buckets' owned parts.
      EXPECT_EQ(t.offload_down_bytes, 4 * owned) << what;
      EXPECT_GE(t.offload_up_bytes, 2 * owned) << what;
      EXPECT_LE(t.offload_up_bytes, 2 * owned + 4 * norms) << what;
      EXPECT_GE(t.offload_chunks, 1) << what;
    }
  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 100;
  Strategy s = small(1, "none");
  s.optimizer_offload = true;
  try {
    Simulator(*config, Cluster::single_node(h, 1)).estimate(s);
    ADD_FAILURE() << "offload on hardware without a host";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer offload needs the host behind each device"),
              std::string::npos)
        << e.what();
  }
  h.host_link_gbs = 10, h.host_memory_bandwidth_gbs = 20, h.host_memory_gib = 100;
  Simulator sim(*config, Cluster::single_node(h, 1));
  const Estimate with = sim.estimate(s);
  const RankTrace& t = *sim.last_traces()[0];
  EXPECT_TRUE(with.fits) << with.over;
  // The three stages pipelined over the chunks: the slowest one's time, and the others' share of one chunk.
  const double down = static_cast<double>(t.offload_down_bytes) / 10e9,
               up = static_cast<double>(t.offload_up_bytes) / 10e9,
               update = 28.0 * static_cast<double>(t.offload_update_elements) / 20e9;
  const double slowest = std::max({down, up, update});
  EXPECT_DOUBLE_EQ(with.time.offload,
                   slowest + (down + up + update - slowest) / static_cast<double>(t.offload_chunks));
  EXPECT_EQ(with.memory.host, t.host_bytes);
  s.optimizer_offload = false;
  const Estimate without = sim.estimate(s);
  EXPECT_EQ(without.time.offload, 0);
  // The step trades the device's update for the offload.
  EXPECT_NEAR(with.time.step - without.time.step,
              with.time.offload - (without.time.optimizer - with.time.optimizer), 1e-9);
  EXPECT_GT(without.time.optimizer, with.time.optimizer);
  EXPECT_LT(with.memory.total, without.memory.total);
  s.optimizer_offload = true;
  h.host_memory_gib = 1e-4;
  const Estimate small_host = Simulator(*config, Cluster::single_node(h, 1)).estimate(s);
  EXPECT_FALSE(small_host.fits);
  EXPECT_NE(small_host.over.find("of host memory behind each test device"), std::string::npos)
      << small_host.over;
  s.dtype = s.activation_dtype = DType::f32;
  EXPECT_THROW(sim.estimate(s), Error);
}

TEST(DryTrace, ContextParallelRanksHoldTheirChunks) {
  const std::unique_ptr<models::ModelConfig> config = models::read_model_config(kLlama);
  TraceOptions for_cpu, cpu;
  for_cpu.shaped_for = Device::cpu, cpu.device = Device::cpu;
  auto traced = [&](int cp, const char* comm) {
    Strategy s = small(1, "none");
    s.cp = cp, s.cp_comm = parallel::context_attention_from_name(comm);
    return trace_rank(*config, s, 0, for_cpu);
  };
  auto attention_flops = [](const RankTrace& t) {
    double flops = 0;
    for (const ops::OpProfileRow& r : merge_rows(t.phases()))
      if (r.op.find("attention") != std::string::npos) flops += r.flops;
    return flops;
  };
  const RankTrace one = traced(1, "p2p"), ring = traced(2, "p2p"), a2a = traced(2, "a2a");
  const double half = 0.5 * static_cast<double>(one.chunks[0].activation_bytes);
  EXPECT_NEAR(static_cast<double>(ring.chunks[0].activation_bytes), half, 0.02 * half);
  EXPECT_NEAR(static_cast<double>(a2a.chunks[0].activation_bytes), half, 0.02 * half);
  EXPECT_NEAR(attention_flops(ring), 0.5 * attention_flops(one), 0.01 * attention_flops(one));
  EXPECT_NEAR(attention_flops(a2a), 0.5 * attention_flops(one), 0.01 * attention_flops(one));
  const int64_t layers = config->shape().layers;
  auto events = [](const Phase& p, const char* op) {
    int64_t n = 0;
    for (const CommEvent& e : p.comm) n += e.group == "cp" && e.op == op;
    return n;
  };
  EXPECT_EQ(events(ring.chunks[0].forward, "send"), layers);       // one hop per layer at cp 2
  EXPECT_EQ(events(ring.chunks[0].backward, "send"), 3 * layers);  // a key/value hop and two gradient hops
  for (const CommEvent& e : ring.chunks[0].forward.comm)
    if (e.group == "cp") {
      EXPECT_FALSE(e.overlapped.empty());
    }
  int64_t exposed = 0;
  for (const CommEvent& e : ring.chunks[0].backward.comm) exposed += e.group == "cp" && e.overlapped.empty();
  EXPECT_EQ(exposed, layers);                                           // the last gradient hop of each layer
  EXPECT_EQ(events(a2a.chunks[0].forward, "all_to_all"), 5 * layers);   // q, k, v in; out, lse back
  EXPECT_EQ(events(a2a.chunks[0].backward, "all_to_all"), 9 * layers);  // q, k, v, dout, out, lse; dq, dk, dv
  for (const char* comm : {"p2p", "a2a"}) {
    Strategy s = small(1, "none");
    s.cp = 2, s.cp_comm = parallel::context_attention_from_name(comm);
    EXPECT_EQ(calls_of(trace_rank(*config, s, 0, for_cpu)), calls_of(trace_rank(*config, s, 0, cpu))) << comm;
  }

  HardwareProfile h = HardwareProfile::parse(kProfile, "t.toml");
  h.memory_gib = 64;
  Simulator sim(*config, Cluster::single_node(h, 8));
  Strategy s = small(1, "none");
  const Estimate whole = sim.estimate(s);
  s.cp = 2;
  const Estimate split = sim.estimate(s);
  EXPECT_LT(split.memory.activations, whole.memory.activations);
  EXPECT_GT(split.time.dp_comm, 0);  // gradients reduced over dp x cp
  EXPECT_NE(s.describe().find("cp2"), std::string::npos) << s.describe();
  EXPECT_NE(s.set_line().find("--set parallel.cp=2 --set parallel.cp_comm=p2p"), std::string::npos)
      << s.set_line();
  s.cp = 4, s.seq = 60;
  try {
    sim.estimate(s);
    ADD_FAILURE() << "a sequence of 60 split over 8 chunks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.seq_len = 60 must be a multiple of 2 x parallel.cp = 8"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace forge::sim::sim_test
