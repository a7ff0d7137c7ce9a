// The simulator's strategy of a training run's settings: what `forge plan estimate --config run.toml`
// predicts and what the trainer prints at start (log.hardware_profile) is what this TrainConfig trains.
#pragma once

#include "forge/sim/strategy.h"
#include "forge/train/config.h"

namespace forge::train {

// world_size: the ranks the run has (parallel.dp = 0 takes what tp x pp leave of them).
sim::Strategy strategy_of(const TrainConfig& config, int world_size);

}  // namespace forge::train
