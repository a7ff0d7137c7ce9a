// The simulator's view of one rank: its part of the model built for real and run for one step's worth of
// micro-batches, op by op, under the op profiler, with every collective recorded by a communicator that moves
// nothing (sim/dry_comm.h). Nothing is modelled by hand: the ops, their shapes, the FLOPs and bytes they
// imply, the collectives and their sizes, and the memory each phase allocates are those of forge's own code
// for this model under this strategy.
//
// Two modes. Dry (Device::cuda under the device emulation's check-only mode, kernels/emulated_device.h): ops
// are checked, not computed, and device memory is never committed, so a rank of a model far larger than this
// machine is traced in milliseconds; the op list is the CPU's too (the same op table entries; a test holds
// them equal). Measured (Device::cpu): the same step runs for real, so each row's time is this machine's;
// `forge plan calibrate` writes them into a hardware profile.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "forge/core/tensor.h"
#include "forge/kernels/profiler.h"
#include "forge/models/model.h"
#include "forge/sim/dry_comm.h"
#include "forge/sim/strategy.h"

namespace forge::sim {

// One stretch of a step: its ops (calls, FLOPs, bytes; times when measured), its communication, and the
// memory it allocates: kept (live at its end minus at its start; negative when it frees) and transient (the
// most it held above its start at once).
struct Phase {
  std::vector<ops::OpProfileRow> rows;
  std::vector<CommEvent> comm;
  int64_t kept_bytes = 0, transient_bytes = 0;
  double wall_seconds = 0;  // measured mode: the phase's wall time
};

// One model chunk of the rank (the whole rank's model unless a schedule places several chunks there).
struct ChunkTrace {
  int stage = 0;  // its stage in the pipeline
  models::StageSpec spec;
  // The first micro-batch of a step (forward_first: FP8 weight casts happen there), then a steady one.
  Phase forward_first, forward;
  Phase backward;  // B: backward_input and backward_weight fused (the least memory)
  Phase backward_input, backward_weight;
  int64_t activation_bytes = 0;  // what one micro-batch keeps from its forward to its backward
  int64_t output_bytes = 0;      // the hidden states it hands to the next stage (0 on the last stage)
  // One stage under expert parallelism's overlap with several micro-batches: the most F0, the overlapped pair
  // F1 & B0 and B1 held at once above the step's start (0: not traced).
  int64_t paired_peak_bytes = 0;
};

struct RankTrace {
  int pp_rank = 0;
  std::vector<ChunkTrace> chunks;
  Phase step_begin;  // zeroing the gradients
  Phase step_end;    // the gradient buckets' last reductions, the norm, the finiteness check, the update
  // Memory: the parameters with their bf16 shadow and gradients (after the build), the optimizer's moments
  // and FP8 state (what the first update adds), and all of it (live between steps).
  int64_t weights_bytes = 0, optimizer_bytes = 0, static_bytes = 0;
  // Optimizer offload: the host memory its state takes, the bytes each step copies to the host (gradients)
  // and back (weights), the elements the host updates, and the chunks (buckets) it pipelines them in.
  int64_t host_bytes = 0, offload_down_bytes = 0, offload_up_bytes = 0, offload_update_elements = 0,
          offload_chunks = 0;
  int64_t parameters = 0;  // this rank's parameter elements

  // Every phase of the step: the step's own, then each chunk's.
  std::vector<const Phase*> phases() const;
};

struct TraceOptions {
  Device device = Device::cuda;  // cuda: a dry run (the caller need not hold an emulation); cpu: measured
  // A dry run for a rank that will train on the CPU: cpu (the modules then choose their shapes as forge's CPU
  // kernels want them, nn::ComputeOptions::shaped_for). Unset: a GPU's.
  std::optional<Device> shaped_for;
};

// Traces pp rank `pp_rank` (tp, dp and ep rank 0) of the strategy. Fails with one line when the model does
// not split under it.
RankTrace trace_rank(const models::ModelConfig& config, const Strategy& strategy, int pp_rank,
                     const TraceOptions& options = {});

// Generation as `forge generate` runs it (models::generate_sequence, one process): the inference model, a KV
// cache for the prompt and the new tokens, the prompt's forward pass (prefill) and one-token steps (decode).
struct GenerationRequest {
  int64_t batch = 1;           // sequences generated together
  int64_t prompt = 1;          // tokens per prompt
  int64_t new_tokens = 1;      // tokens generated per sequence
  std::string dtype = "bf16";  // GEMM operands: bf16 | fp32 (forge generate --dtype)
};
struct GenerationTrace {
  int64_t weights_bytes = 0;  // the inference model's parameters (and their bf16 copies)
  int64_t cache_bytes = 0;    // the KV cache, made once for prompt + new_tokens - 1 positions
  Phase prefill;              // the prompt's forward pass (its transient: the most it holds above the cache)
  // One one-token step at the middle of the generated stretch (attention's cost grows along it); empty for a
  // single new token (it is sampled from the prefill's logits).
  Phase decode;
};
GenerationTrace trace_generation(const models::ModelConfig& config, const GenerationRequest& request,
                                 const TraceOptions& options = {});

// The sum of the rows of several phases (same op and detail merged).
std::vector<ops::OpProfileRow> merge_rows(const std::vector<const Phase*>& phases);

}  // namespace forge::sim
