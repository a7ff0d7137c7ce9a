// What a training run builds before its first step, on every rank, apart from the state, the step and the
// loop (train_state.h, step.h, trainer.cpp): the layout and its groups, the device and its communicators,
// the model config and the model (this rank's shard), the FP8 context, the gradient buckets, the optimizer,
// the learning-rate schedule and the data. Everything that can be refused (a layout that does not fit the
// world or the model, a device that is not there, a tokenizer larger than the vocabulary) is refused here,
// on every rank, with the same one line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "forge/comm/comm.h"
#include "forge/core/memory.h"
#include "forge/models/model.h"
#include "forge/models/pretrained.h"
#include "forge/nn/fp8_context.h"
#include "forge/optim/lr_schedule.h"
#include "forge/parallel/comm_context_parallel.h"
#include "forge/parallel/comm_expert_parallel.h"
#include "forge/parallel/comm_tensor_parallel.h"
#include "forge/parallel/distributed_optimizer.h"
#include "forge/parallel/grad_buckets.h"
#include "forge/parallel/layout.h"
#include "forge/parallel/pipeline/links.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/train/config.h"
#include "forge/train/training_data.h"

namespace forge::train {

class TrainSetup {
 public:
  // Collective over world (every rank, the same config).
  TrainSetup(const TrainConfig& config, comm::Communicator& world);
  TrainSetup(const TrainSetup&) = delete;
  TrainSetup& operator=(const TrainSetup&) = delete;

  const TrainConfig& config;
  comm::Communicator& world;
  const parallel::Layout layout;
  ScopedHostMemoryLimit memory_limit;  // train.memory_limit_mb, for as long as the run's tensors live
  parallel::ParallelGroups groups;
  // The dense parameters' gradients reduce over dp x cp (every rank that saw some of their tokens).
  comm::Communicator& dp_group() const { return *groups.dp_cp; }
  // dp: the data-parallel replicas (each reads its own samples); the cp ranks of one replica read the same
  // sequences and keep their slices of them (context_slice).
  int64_t dp = 1, dp_rank = 0;
  int64_t seq = 0, micro = 0, accum = 0;  // seq: the whole sequence's tokens (cp ranks hold seq / cp each)
  int64_t cp = 1;
  std::unique_ptr<parallel::CommContextParallel> context_parallel;  // cp > 1
  // This rank's tokens of `batch` whole sequences of seq tokens (all of them when cp = 1), in the order the
  // model takes them (parallel::ContextSplit): local must hold batch * local_seq() values.
  int64_t local_seq() const { return seq / cp; }
  void context_slice(const int32_t* whole, int32_t* local, int64_t batch) const;

  Device device = Device::cpu;
  bool on_gpu() const { return device != Device::cpu; }
  // On GPUs: NCCL communicators over the tp and dp groups (device buffers), or a one-rank one for dp = 1;
  // under expert parallelism also over ep (the token all-to-alls) and expert_dp (the experts' gradients),
  // under context parallelism over cp (the attention's keys, values and their gradients).
  std::unique_ptr<comm::Communicator> dp_nccl, tp_nccl, dp_self, ep_nccl, expert_dp_nccl, cp_nccl;

  std::optional<models::PretrainedDir> init_source;  // model.init_from
  std::string model_source;                          // where the model config came from, for messages
  std::unique_ptr<models::ModelConfig> model_config;
  std::unique_ptr<TrainingData> data;

  std::string dtype_name;  // the GEMM dtype in use ("bf16", "fp32")
  nn::ComputeOptions options;
  std::unique_ptr<parallel::CommTensorParallel> tensor_parallel;
  std::unique_ptr<parallel::CommExpertParallel> expert_parallel;  // parallel.ep > 1
  std::unique_ptr<nn::Fp8Context> fp8;                            // null without FP8
  std::string fp8_summary = "off";
  // Pipeline parallelism: the part of the model this rank holds (the whole model when pp = 1), the
  // schedule's action lists (null when pp = 1), this rank's place in them and the hidden-state rows one
  // micro-batch hands from stage to stage.
  // Schedules that place several chunks on a rank (interleaved, zbv, dualpipe, dualpipev) build each into
  // one shared parameter store (rank_params), so that the rank has one optimizer, one set of gradient buckets
  // and one checkpoint; chunk_params[c] is chunk c's parameter ids [first, end) in it (registration order;
  // in the buffer each parameter group is laid out apart, so a chunk spans one flat run per group).
  // DualPipe's mirror pairs ranks r and P-1-r, which hold copies of each other's stages and sum their
  // gradients.
  std::vector<models::StageSpec> chunk_stages;  // [chunk]
  std::unique_ptr<pipeline::Schedule> pipeline;
  int pp_rank = 0;
  int64_t stage_rows = 0;
  std::string pipeline_summary;  // for the run log
  comm::Communicator& pp_group() const { return *groups.pp; }
  // Where the stages' hidden states and gradients travel: over pp_group on CPUs, over a NCCL channel per
  // (kind, sender, receiver) on GPUs (parallel/pipeline/links.h).
  std::unique_ptr<pipeline::Links> pp_links;
  std::unique_ptr<ParameterStore> rank_params;
  std::vector<std::pair<int, int>> chunk_params;
  std::vector<std::pair<int64_t, int64_t>> chunk_fp8_linears;  // [chunk]: its FP8 Linears' slots (with FP8)
  std::unique_ptr<comm::Communicator> mirror;
  // Tied embeddings with the first and the last stage on two ranks: the pair's communicator (null on the
  // other ranks) and the tied tensor's id in this rank's store; the last stage's copy sums its gradient with
  // the embedding's after each schedule.
  std::unique_ptr<comm::Communicator> tied_group;
  int tied_param = -1;
  // On GPUs the mirrored and tied gradients are device memory: NCCL communicators over the same pairs.
  std::unique_ptr<comm::Communicator> mirror_nccl, tied_nccl;
  comm::Communicator* mirror_grads() const { return mirror_nccl ? mirror_nccl.get() : mirror.get(); }
  comm::Communicator* tied_grads() const { return tied_nccl ? tied_nccl.get() : tied_group.get(); }
  std::unique_ptr<models::Model> model;                     // this rank's stage (its first chunk)
  std::vector<std::unique_ptr<models::Model>> more_chunks;  // its other chunks
  std::vector<models::Model*> chunks() const;
  std::unique_ptr<parallel::GradBuckets> buckets;         // the dense parameters' (over dp x cp)
  std::unique_ptr<parallel::GradBuckets> expert_buckets;  // parallel.ep > 1: the experts' (over expert_dp)
  std::unique_ptr<parallel::DistributedAdamW> optimizer;
  optim::LrSchedule schedule;

 private:
  void check_model_fits() const;
  void check_step_fits() const;
  void open_devices();
  void make_compute_options();
  void make_pipeline();
  void build_chunks();
  void tie_embeddings_across_stages();
  std::unique_ptr<comm::Communicator> device_communicator(comm::Communicator& bootstrap,
                                                          const std::string& name) const;
  int gpu_ordinal_ = 0;
};

// OpenMP threads per rank: train.threads, else OMP_NUM_THREADS when set, else this node's cores shared by
// its ranks.
int threads_per_rank(int64_t configured);

}  // namespace forge::train
