// Hardware profiles and clusters: what an op and a message cost on a device and between devices.
//
// A profile (TOML) gives a device's peaks and efficiency curves (GEMM throughput by the FLOPs of one call,
// attention's fraction of the GEMM peak, the memory bandwidth memory-bound ops reach, a per-call overhead),
// the links between devices, and optionally the measured time of individual ops at given shapes (`forge plan
// calibrate` writes those from this machine's own kernels; an op and shape found there costs what was
// measured). Shipped profiles (configs/hardware/*.toml) for GPUs come from published peaks and efficiency
// curves and say so (kind = "published").
//
// A cluster (TOML) names a profile and says how many devices a node holds and how many nodes there are, and
// may override the links' bandwidth and latency.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "forge/kernels/profiler.h"
#include "forge/sim/dry_comm.h"

namespace forge::sim {

struct Link {
  double bandwidth_gbs = 0;  // GB/s per device, one direction (the bus bandwidth a ring collective reaches)
  double latency_us = 0;     // per message step
  double async_bandwidth_gbs = 0;  // non-blocking collectives (MPI's are slower); 0: bandwidth_gbs
  // The share of a non-blocking collective's time that its rank's computing thread spends on it: MPI on the
  // host moves and sums the data inside the calls that test it, on the rank's own thread between the ops, so
  // an "overlapped" reduction still takes that share from the compute (calibrate measures it; 0 on GPUs,
  // where the collective runs on the device beside the compute).
  double host_share = 0;
  bool operator==(const Link&) const = default;
};

struct HardwareProfile {
  std::string name;                // "H100 SXM 80GB", "cpu: AMD EPYC 9B14 (1 thread per rank)"
  std::string kind = "published";  // published | measured
  std::string notes;               // where the numbers come from
  int threads = 0;                 // CPU profiles: OpenMP threads per rank the measurement ran with
  double memory_gib = 0;           // per device
  // Dense peaks (TFLOP/s) by operand type; a GEMM reaches peak x gemm_efficiency(flops of one call).
  double bf16_tflops = 0, fp32_tflops = 0, fp8_tflops = 0;
  std::vector<std::pair<double, double>>
      gemm_efficiency;                // (log10 FLOPs of one call, fraction of peak), sorted
  double attention_efficiency = 0.5;  // fused attention's fraction of the bf16 peak
  double memory_bandwidth_gbs = 0;    // what memory-bound ops reach
  // The host behind each device, for optimizer offload (0: none, as in CPU profiles): the device's host
  // link (PCIe, GB/s each way), the host memory bandwidth and the host memory its share of the host gives
  // it (the host's divided by the devices per node).
  double host_link_gbs = 0, host_memory_bandwidth_gbs = 0, host_memory_gib = 0;
  // Per op call, on top of its cost: a kernel launch, a parallel region, the host's work between ops
  // (calibrate measures it: a step's wall time less its ops' times, over the op calls).
  double op_overhead_us = 0;
  Link node, network;  // within a node, between nodes
  // Measured seconds per call of an op at a shape, keyed "op|detail" (ops::OpProfileRow's op and detail).
  std::map<std::string, double> measured;
  std::string source;  // the file it was read from

  // Seconds for all of a row's calls.
  double row_seconds(const ops::OpProfileRow& row) const;
  double rows_seconds(const std::vector<ops::OpProfileRow>& rows) const;
  double efficiency(double flops_per_call) const;

  // Strict: unknown keys and missing or out-of-range values fail with one line naming the file and key.
  static HardwareProfile read(const std::string& path);
  static HardwareProfile parse(const std::string& text, const std::string& source);
  std::string to_toml() const;
};

// Where the shipped profiles are ("h100" -> configs/hardware/h100.toml, found next to the binary's source
// tree or in the working directory); a path is used as it is.
std::string resolve_profile(const std::string& name_or_path);

struct Cluster {
  HardwareProfile hardware;
  int devices_per_node = 8, nodes = 1;
  std::string source;
  int devices() const { return devices_per_node * nodes; }
  // The link a group of these world ranks talks over: the node's when they share one, else the network's.
  const Link& link(const std::vector<int>& ranks) const;
  static Cluster read(const std::string& path);
  static Cluster parse(const std::string& text, const std::string& source);
  // One node of `devices` devices of this profile (the CPU case: ranks on this machine).
  static Cluster single_node(HardwareProfile hardware, int devices);
};

// Seconds a collective of `bytes` (CommEvent's convention) takes over a ring of group_size ranks on link.
double comm_seconds(const CommEvent& event, const Link& link);

}  // namespace forge::sim
