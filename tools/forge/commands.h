// The forge subcommands. Each lives in its own tools/forge/cmd_<name>.cpp and registers itself on the
// application: it adds its CLI11 subcommand and options, and returns the function that runs it once the
// command line is parsed. Runners throw forge::Error for bad input; main() prints it as one line.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

#include "forge/models/pretrained.h"

namespace forge::cli {

struct Command {
  CLI::App* app = nullptr;   // the parsed subcommand
  std::function<int()> run;  // its exit status
};
using Commands = std::vector<Command>;

void add_train_command(CLI::App& app, Commands& commands);
void add_bench_command(CLI::App& app, Commands& commands);
void add_tokenizer_command(CLI::App& app, Commands& commands);
void add_convert_command(CLI::App& app, Commands& commands);
void add_data_command(CLI::App& app, Commands& commands);
void add_eval_command(CLI::App& app, Commands& commands);
void add_generate_command(CLI::App& app, Commands& commands);
void add_plan_command(CLI::App& app, Commands& commands);
void add_launch_command(CLI::App& app, Commands& commands);
void add_report_command(CLI::App& app, Commands& commands);
// plan estimate | search | calibrate (cmd_plan_model.cpp), added to `forge plan`.
void add_plan_model_subcommands(CLI::App* plan,
                                std::vector<std::pair<CLI::App*, std::function<int()>>>& runners);

// The commands that read a model (generate, eval, convert) read a checkpoint series the same way
// (models::SeriesReading): --allow-older-checkpoint accepts the newest step that loads when the newest is
// damaged, and the step read is named on standard error ("forge generate: reading checkpoint DIR at step 40
// (step-00000040)" plus what was passed over).
void add_series_reading_flag(CLI::App* command, models::SeriesReading& reading);
void say_source(const char* command, const models::PretrainedDir& source);

}  // namespace forge::cli
