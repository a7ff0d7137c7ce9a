// log.hardware_profile: the simulator's prediction of this run (memory per device, time per step), printed at
// start and compared with what the run measured at the end, so that every run is a validation point of the
// simulator (docs/simulator.md).
#include <omp.h>

#include <algorithm>

#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/sim/hardware.h"
#include "forge/train/plan.h"
#include "forge/train/training_run.h"

namespace forge::train::detail {

void TrainingRun::predict() {
  if (c_.log.hardware_profile.empty()) return;
  TrainSetup& s = *setup_;
  sim::HardwareProfile hardware = sim::HardwareProfile::read(sim::resolve_profile(c_.log.hardware_profile));
  // This machine's ranks on one node (a multi-node job: pass a cluster to forge plan estimate instead).
  sim::Simulator simulator(*s.model_config, sim::Cluster::single_node(std::move(hardware), world_.size()));
  prediction_ = simulator.estimate(strategy_of(c_, world_.size()));
  const sim::Estimate& e = *prediction_;
  log_.say(
      "plan (%s, %s): predicted %.2f ms/step, %.0f tokens/s, %s per device (parameters %s, optimizer %s, "
      "activations %s, transient %s)\n",
      simulator.cluster().hardware.name.c_str(), simulator.cluster().hardware.kind.c_str(), 1e3 * e.time.step,
      e.time.tokens_per_s, sim::human_bytes(e.memory.total).c_str(),
      sim::human_bytes(e.memory.weights).c_str(), sim::human_bytes(e.memory.optimizer).c_str(),
      sim::human_bytes(e.memory.activations).c_str(), sim::human_bytes(e.memory.transient).c_str());
  if (!e.fits) log_.say("plan: warning: %s\n", e.over.c_str());
  const int threads = omp_get_max_threads();
  if (simulator.cluster().hardware.threads > 0 && simulator.cluster().hardware.threads != threads)
    log_.say(
        "plan: warning: %s was measured with %d thread%s per rank; this run has %d (calibrate with the "
        "run's)\n",
        c_.log.hardware_profile.c_str(), simulator.cluster().hardware.threads,
        simulator.cluster().hardware.threads == 1 ? "" : "s", threads);
  write_metrics({{"event", "prediction"},
                 {"profile", c_.log.hardware_profile},
                 {"step_s", e.time.step},
                 {"tokens_per_s", e.time.tokens_per_s},
                 {"memory_bytes", e.memory.total}});
}

void TrainingRun::compare_with_prediction() {
  if (!prediction_ || step_seconds_.size() < 2) return;
  // Steps after the first (which pays one-time costs), the median; the allocator's peak since the second, the
  // largest of the ranks' (the prediction is the most loaded rank's).
  std::vector<double> steady(step_seconds_.begin() + 1, step_seconds_.end());
  std::sort(steady.begin(), steady.end());
  const double measured = steady[steady.size() / 2];
  const int64_t peak = static_cast<int64_t>(comm::all_reduce_max(
      world_, static_cast<double>(setup_->on_gpu() ? device_memory(setup_->device).peak_allocated()
                                                   : memory_stats().peak_bytes)));
  const sim::Estimate& e = *prediction_;
  const double time_error = e.time.step / measured - 1;
  const double memory_error = static_cast<double>(e.memory.total) / static_cast<double>(peak) - 1;
  log_.say(
      "plan vs run: step %.2f ms predicted, %.2f ms measured (median of %zu steps; %+.1f%%) | peak memory %s "
      "predicted, %s measured (%+.1f%%)\n",
      1e3 * e.time.step, 1e3 * measured, steady.size(), 100 * time_error,
      sim::human_bytes(e.memory.total).c_str(), sim::human_bytes(peak).c_str(), 100 * memory_error);
  write_metrics({{"event", "prediction_check"},
                 {"step_s_predicted", e.time.step},
                 {"step_s_measured", measured},
                 {"steps", steady.size()},
                 {"memory_bytes_predicted", e.memory.total},
                 {"memory_bytes_measured", peak}});
}

}  // namespace forge::train::detail
