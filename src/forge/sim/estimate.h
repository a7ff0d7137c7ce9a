// Memory and time of one training step under a strategy on a cluster: the ranks' traces (sim/trace.h)
// costed by the cluster's hardware profile (sim/hardware.h), the pipeline's action lists replayed with those
// costs (parallel/pipeline/replay.h: the same lists the executor runs), and the communication placed where
// forge does it: tensor- and expert-parallel collectives on the critical path of their phase, pipeline sends
// between actions, the data-parallel bucket reductions under the last micro-batch's backward (each bucket
// launched when its gradients are final, the buckets one after another on the link), the rest of the
// reductions and the ZeRO-1 all-gather after it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "forge/models/model.h"
#include "forge/sim/hardware.h"
#include "forge/sim/strategy.h"
#include "forge/sim/trace.h"

namespace forge::sim {

struct MemoryEstimate {
  // The rank with the most: its parameters (fp32, bf16 shadow, gradients), optimizer state (AdamW moments,
  // sharded under ZeRO-1; FP8 scales and histories), the activations it holds at once, the largest transient
  // of an action on top of them, and the total.
  int64_t weights = 0, optimizer = 0, activations = 0, transient = 0, total = 0;
  int64_t host = 0;   // optimizer offload: that rank's state in host memory (not in total)
  int in_flight = 0;  // micro-batch chunks whose activations are held at that peak
  int pp_rank = 0;
  std::string dominant() const;  // "activations", ...
};

struct TimeEstimate {
  double step = 0;        // seconds per optimizer step
  double compute = 0;     // the busiest rank's ops (pipeline actions, first-micro-batch extras, update)
  double bubble = 0;      // the pipeline's idle time on that rank
  double tp_comm = 0;     // tensor-parallel collectives (critical path)
  double ep_comm = 0;     // expert-parallel all-to-alls
  double cp_comm = 0;     // context parallelism's attention transfers (what compute does not hide)
  double pp_comm = 0;     // pipeline sends
  double dp_comm = 0;     // data-parallel reductions (and ZeRO-1's all-gather) in all
  double dp_exposed = 0;  // the part not hidden under backward
  double optimizer = 0;   // the update and its norm (ops)
  // Optimizer offload: the owned gradients copied to the host, updated there (AdamW reads and writes 28
  // bytes per element of host memory), the weights copied back, pipelined bucket by bucket as the optimizer
  // runs them (parallel/distributed_optimizer.h).
  double offload = 0;
  double tokens_per_s = 0, mfu = 0;
};

struct Estimate {
  Strategy strategy;
  MemoryEstimate memory;
  TimeEstimate time;
  bool fits = true;
  std::string over;  // when it does not fit: by how much, and what dominates
};

// Generation (forge generate) on one device: memory and time of a prompt's prefill and the decoding.
struct GenerationEstimate {
  GenerationRequest request;
  int64_t weights = 0, cache = 0, transient = 0, total = 0;  // bytes
  double prefill = 0;                                        // seconds for the prompt's forward pass
  double decode_per_token = 0;  // seconds per generated token after the first (a one-token step)
  double total_seconds = 0;     // prefill and every decoding step
  bool fits = true;
  std::string over;  // when it does not fit: by how much, and what dominates
};

class Simulator {
 public:
  Simulator(const models::ModelConfig& config, Cluster cluster, TraceOptions options = {});
  // Fails with one line when the strategy cannot run (does not split the model, a schedule refuses it, more
  // ranks than the cluster has).
  Estimate estimate(const Strategy& strategy);
  // Generation on one device of the cluster (fails with one line for a request the model cannot run).
  GenerationEstimate estimate_generation(const GenerationRequest& request);
  const Cluster& cluster() const { return cluster_; }
  const models::ModelConfig& config() const { return *config_; }
  // The traces estimate() used (by pp rank), for breakdowns.
  const std::vector<const RankTrace*>& last_traces() const { return last_; }
  int64_t traces_run() const { return traces_run_; }

 private:
  const RankTrace& trace(const Strategy& s, int pp_rank);
  std::unique_ptr<models::ModelConfig> config_;
  Cluster cluster_;
  TraceOptions options_;
  static constexpr size_t kMaxCachedTraces = 256;
  std::map<std::string, std::unique_ptr<RankTrace>> cache_;
  std::vector<const RankTrace*> last_;
  int64_t traces_run_ = 0;
};

// A human-readable breakdown of one estimate (forge plan estimate).
std::string format_estimate(const Estimate& e, const Simulator& sim);
std::string format_generation(const GenerationEstimate& e, const Simulator& sim);
std::string human_bytes(int64_t bytes);  // "12.3 GiB"

}  // namespace forge::sim
