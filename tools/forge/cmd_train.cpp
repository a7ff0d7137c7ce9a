// forge train: the training loop over a TOML configuration.
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/comm/comm.h"
#include "forge/models/model.h"
#include "forge/train/config.h"
#include "forge/train/trainer.h"

namespace forge::cli {
using namespace forge::optim;
using namespace forge::train;
namespace {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;
};

int run_train(const TrainOptions& o) {
  TrainConfig config = o.config_path.empty() ? TrainConfig{} : TrainConfig::from_toml_file(o.config_path);
  for (const auto& assignment : o.overrides) config.apply_override(assignment);
  config.validate();
  // MPI starts inside the trainer, after the configuration is read: its start-up keeps parallel.timeout_s
  // too (unless FORGE_COMM_TIMEOUT says otherwise).
  comm::set_startup_timeout_seconds(config.parallel.timeout_s);
  install_stop_signal_handlers();
  Trainer trainer(config);
  TrainResult result = trainer.run();
  return result.interrupted ? 130 : 0;
}

}  // namespace

void add_train_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<TrainOptions>();
  auto* train =
      app.add_subcommand("train", "Train a model from a Hugging Face config.json or folder (" +
                                      models::family_names() + "); configs/default.toml shows every setting");
  train->add_option("-c,--config", o->config_path, "TOML run configuration (default: built-in defaults)")
      ->check(CLI::ExistingFile);
  train->add_option("--set", o->overrides,
                    "Override one setting, section.key=value (repeatable), e.g. --set train.steps=100");
  train->footer(
      "Ctrl-C saves a checkpoint to <run_dir>/checkpoint/step-N (committed by <run_dir>/checkpoint/latest) "
      "and\n"
      "exits with status 130; resume with --set checkpoint.resume=auto (the newest complete checkpoint). A "
      "run\n"
      "directory that holds checkpoints is not started over unless --set checkpoint.overwrite=true.\n"
      "Writes <run_dir>/metrics.jsonl and <run_dir>/config.toml.\n"
      "Many processes: mpirun -np N forge train --set parallel.tp=T [--set parallel.sequence_parallel=true]\n"
      "[--set parallel.distributed_optimizer=true]: N ranks as tp x dp (dp = N / tp); rank 0 logs, every\n"
      "rank writes its checkpoint shard (see docs/parallelism.md).\n"
      "FP8: --set fp8.recipe=delayed|current|block runs the transformer layers' Linear GEMMs in FP8\n"
      "(emulated exactly on CPU; see docs/fp8.md).\n"
      "When training goes wrong ([resilience], docs/resilience.md): a NaN/Inf or a loss spike rolls back to\n"
      "an in-memory snapshot, skips the data window and goes on (resilience.max_retries in a row, then one\n"
      "line naming step, rank and cause). Periodic checkpoints are written in the background\n"
      "(checkpoint.async). Faults for drills: --set 'resilience.inject=nan_loss step=50 rank=1' or\n"
      "FORGE_FAULT=...; restarts after a dead or hung rank: forge launch -- ... (docs/launch.md).");
  commands.push_back({train, [o] { return run_train(*o); }});
}

}  // namespace forge::cli
