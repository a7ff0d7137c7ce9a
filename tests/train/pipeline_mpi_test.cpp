// The pipeline executor under mpirun: every schedule that fits the world (2 and 4 ranks) trains an 8-layer
// LLaMA cut into its stages to the loss and the gradients of one process running the whole model, within
// rtol 1e-5 / atol 4e-5 per gradient (torch's pipelining tests' tolerance) and 1e-5 relative on the loss.
// DualPipe's mirrored copies each see half the micro-batches; their gradients are summed, as the trainer
// will. After each step nothing is left in flight: no message, no activation.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/philox.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/model.h"
#include "forge/parallel/pipeline/executor.h"
#include "forge/parallel/pipeline/links.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/train/device_emulation.h"
#include "forge/train/pipeline_chunk.h"
#include "forge/train/step.h"

namespace forge::pipeline_mpi_test {
using namespace forge::models;
using namespace forge::train;
namespace {

constexpr int64_t kBatch = 2, kSeq = 8, kLayers = 8;

LlamaConfig eight_layers() {
  LlamaConfig c;
  c.hidden_size = 32, c.intermediate_size = 40, c.num_hidden_layers = kLayers;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 8;
  c.vocab_size = 53, c.max_position_embeddings = 16, c.rms_norm_eps = 1e-5;
  c.validate("test config");
  return c;
}

struct Batches {
  std::vector<std::vector<int32_t>> ids, targets;
  float grad_scale = 0;
  MicroBatch operator()(int m) const { return {ids[m].data(), targets[m].data(), kBatch, kSeq, grad_scale}; }
};

Batches make_batches(int count, int64_t vocab) {
  Batches b;
  b.ids.resize(count), b.targets.resize(count);
  for (int m = 0; m < count; ++m)
    for (int64_t i = 0; i < kBatch * kSeq; ++i) {
      const auto bits = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(m), 0, 0}, {7, 0});
      b.ids[m].push_back(static_cast<int32_t>(bits[0] % vocab));
      b.targets[m].push_back(i % 7 == 3 ? -1 : static_cast<int32_t>(bits[1] % vocab));
    }
  b.grad_scale = 1.0f / static_cast<float>(count * kBatch * kSeq);
  return b;
}

struct Reference {
  std::unique_ptr<Model> model;
  LossSum loss;
};

Reference run_whole(const LlamaConfig& config, const Batches& batches, int count) {
  Reference ref;
  ref.model = build_model(config, nn::ComputeOptions{}, StageSpec::whole(), 0.02f);
  ref.model->initialize(5);
  ref.model->params().zero_grads();
  ref.model->params().begin_grad_step(count);
  NoPipelining serial;
  ref.loss = serial.run(*ref.model, count, [&](int m) { return batches(m); });
  return ref;
}

void expect_pipeline_matches(const std::string& name, int micro_batches, int vpp = 1) {
  comm::Communicator& world = comm::world();
  const int ranks = world.size(), rank = world.rank();
  const pipeline::Schedule schedule =
      pipeline::make_schedule({pipeline::schedule_kind(name), ranks, micro_batches, vpp});
  const pipeline::Placement& p = schedule.placement;
  ASSERT_LE(p.stages, kLayers);
  const LlamaConfig config = eight_layers();
  const Batches batches = make_batches(micro_batches, config.vocab_size);
  const Reference ref = run_whole(config, batches, micro_batches);

  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<ModelChunk>> chunks;
  std::vector<pipeline::Chunk*> chunk_ptrs;
  for (int c = 0; c < p.chunks; ++c) {
    const StageSpec spec = StageSpec::split(kLayers, p.stages, p.stage(rank, c));
    models.push_back(build_model(config, nn::ComputeOptions{}, spec, 0.02f));
    models.back()->initialize(5);
    models.back()->params().zero_grads();
    models.back()->params().begin_grad_step(static_cast<int>(p.micro_batches_of(rank, c).size()));
    chunks.push_back(std::make_unique<ModelChunk>(*models.back(), batches, kBatch * kSeq));
    chunk_ptrs.push_back(chunks.back().get());
  }
  const pipeline::Links links(world);
  pipeline::Executor executor(schedule, rank, chunk_ptrs, links);
  executor.run();

  // The loss: summed over the chunks that end a micro-batch's path, over the ranks.
  double sums[2] = {0, 0};
  for (const auto& chunk : chunks)
    sums[0] += chunk->loss().sum, sums[1] += static_cast<double>(chunk->loss().tokens);
  comm::all_reduce_sum(world, sums, 2);
  EXPECT_NEAR(sums[0], ref.loss.sum, 1e-5 * std::abs(ref.loss.sum)) << name;
  EXPECT_EQ(static_cast<int64_t>(sums[1]), ref.loss.tokens) << name;

  // The gradients: each stage's (and each mirrored copy's) placed into the whole model's layout and summed
  // over the ranks, so that every parameter's is the sum over the micro-batches that passed through it.
  const ParameterStore& whole = ref.model->params();
  std::vector<float> grads(static_cast<size_t>(whole.numel()), 0.0f);
  for (const auto& model : models) {
    const ParameterStore& part = model->params();
    EXPECT_FALSE(part.grad_step_active()) << name << ": gradients not final after the step";
    for (const ParamInfo& info : part.infos()) {
      const int id = whole.find(info.name);
      ASSERT_GE(id, 0) << info.name;
      const float* g = part.grad(part.find(info.name)).f32();
      float* out = grads.data() + whole.info(id).offset;
      for (int64_t i = 0; i < shape_numel(info.shape); ++i) out[i] += g[i];
    }
  }
  comm::all_reduce_sum(world, grads.data(), static_cast<int64_t>(grads.size()));
  const float* expected = whole.grads().f32();
  int bad = 0;
  for (const ParamInfo& info : whole.infos()) {
    for (int64_t i = 0; i < shape_numel(info.shape); ++i) {
      const float want = expected[info.offset + i], got = grads[info.offset + i];
      if (std::abs(got - want) > 4e-5f + 1e-5f * std::abs(want) && bad++ < 5)
        ADD_FAILURE() << name << ": gradient of " << info.name << "[" << i << "] " << got << ", serial "
                      << want;
    }
  }
  EXPECT_EQ(bad, 0) << name;
  for (const auto& chunk : chunks) EXPECT_EQ(chunk->live_micro_batches(), 0);
}

TEST(PipelineExecutorMpi, OneFOneBMatchesTheSerialRun) {
  expect_pipeline_matches("1f1b", 2 * comm::world().size());
  expect_pipeline_matches("1f1b", 3);  // fewer micro-batches than a full pipeline on 4 ranks
}

TEST(PipelineExecutorMpi, InterleavedMatchesTheSerialRun) {
  expect_pipeline_matches("interleaved", 2 * comm::world().size(), 2);
}

TEST(PipelineExecutorMpi, ZeroBubbleH1MatchesTheSerialRun) {
  expect_pipeline_matches("zb-h1", 2 * comm::world().size());
}

TEST(PipelineExecutorMpi, ZbvMatchesTheSerialRun) {
  expect_pipeline_matches("zbv", 2 * comm::world().size() + 1);
}

TEST(PipelineExecutorMpi, DualPipeMatchesTheSerialRunAfterSummingMirroredCopies) {
  expect_pipeline_matches("dualpipe", 2 * comm::world().size());
  expect_pipeline_matches("dualpipe", 2 * comm::world().size() + 2);
}

TEST(PipelineExecutorMpi, DualPipeVMatchesTheSerialRun) {
  expect_pipeline_matches("dualpipev", 2 * comm::world().size());
  expect_pipeline_matches("dualpipev", 3 * comm::world().size());
}

// On device memory the links give each (kind, sender, receiver) the schedule sends on a communicator of its
// own: 1F1B's activations go up and its gradients down (2 channels per pair), the interleaved schedule's
// also wrap from the last rank to the first, DualPipe's go both ways between every neighbour. A pair the
// schedule never uses has no channel, and asking for one is one line naming it.
TEST(PipelineLinks, OneDeviceChannelPerKindAndDirection) {
  comm::Communicator& world = comm::world();
  const int n = world.size();
  DeviceEmulation emulation;
  const auto make = [](comm::Communicator& bootstrap, const std::string& name) {
    return comm::make_nccl(bootstrap, 0, name);
  };
  const int me = world.rank(), up = (me + 1) % n, down = (me + n - 1) % n;
  {
    const pipeline::Schedule s = pipeline::make_schedule({pipeline::ScheduleKind::one_f_one_b, n, 2 * n, 1});
    const pipeline::Links links(s, world, make);
    EXPECT_EQ(links.communicators(), 2 * (me > 0) + 2 * (me < n - 1));
    if (me < n - 1) {
      EXPECT_EQ(links.to(pipeline::Message::activation, me + 1).comm->size(), 2);
      EXPECT_NE(links.to(pipeline::Message::activation, me + 1).comm,
                links.from(pipeline::Message::gradient, me + 1).comm);
    }
    // Gradients never go up, nor activations from the last rank to the first.
    const pipeline::Message unused = me < n - 1 ? pipeline::Message::gradient : pipeline::Message::activation;
    try {
      (void)links.to(unused, up);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("no {} channel from rank {} to rank {}",
                                                       pipeline::message_name(unused), me, up)),
                std::string::npos)
          << e.what();
    }
  }
  {
    const pipeline::Schedule s = pipeline::make_schedule({pipeline::ScheduleKind::interleaved, n, 2 * n, 2});
    const pipeline::Links links(s, world, make);
    // Activations to the next rank (the last to the first), gradients to the previous, and both received.
    EXPECT_EQ(links.communicators(), 4);
    EXPECT_NE(links.to(pipeline::Message::activation, up).comm,
              links.from(pipeline::Message::activation, down).comm);
  }
}

Tensor host(std::initializer_list<float> values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::f32);
  std::copy(values.begin(), values.end(), t.f32());
  return t;
}

// The emulated NCCL communicator keeps the order of forge's NCCL communicator: sends and receives posted
// together form one group whose requests complete together (so a send grouped with a pending receive is not
// done, where on MPI a small send completes at once), a ring exchange within one group completes, and the
// messages land in device memory.
TEST(PipelineLinks, EmulatedDeviceTransfersRunInPostingOrder) {
  comm::Communicator& world = comm::world();
  if (world.size() != 2) GTEST_SKIP() << "needs 2 ranks";
  DeviceEmulation emulation;
  auto device = comm::make_nccl(world, 0, "ordered");
  const int me = world.rank(), peer = 1 - me;
  Tensor a = Tensor::empty({4}, DType::f32, Device::cuda), b = Tensor::empty({4}, DType::f32, Device::cuda);
  if (me == 0) {
    b.copy_from(host({1, 2, 3, 4}));
    comm::Request ra = device->recv(a.raw(), 4, comm::Type::f32, peer, 0);
    comm::Request sb = device->send(b.raw(), 4, comm::Type::f32, peer, 0);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    bool sent = false;
    while (!sent && std::chrono::steady_clock::now() < until) sent = sb.test();
    EXPECT_FALSE(sent) << "the send ran ahead of the receive posted before it";
    world.barrier().wait();  // only now does rank 1 send
    ra.wait(), sb.wait();
    const Tensor got = a.to(Device::cpu);
    EXPECT_EQ(got.f32()[0], 5.0f);
    EXPECT_EQ(got.f32()[3], 8.0f);
  } else {
    a.copy_from(host({5, 6, 7, 8}));
    world.barrier().wait();
    comm::Request sa = device->send(a.raw(), 4, comm::Type::f32, peer, 0);
    comm::Request rb = device->recv(b.raw(), 4, comm::Type::f32, peer, 0);
    sa.wait(), rb.wait();
    const Tensor got = b.to(Device::cpu);
    EXPECT_EQ(got.f32()[0], 1.0f);
    EXPECT_EQ(got.f32()[3], 4.0f);
  }
}

}  // namespace
}  // namespace forge::pipeline_mpi_test
