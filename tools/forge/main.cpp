// The forge command line: one subcommand per tools/forge/cmd_<name>.cpp (see commands.h). Every error is
// one line on stderr ("forge: error: ...") and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/suggest.h"
#include "forge/models/model.h"
#include "forge/train/device_emulation.h"
using namespace forge::train;

int main(int argc, char** argv) {
  CLI::App app{
      "forge: train dense, mixture-of-experts and multimodal transformers natively in C++, on CPUs and "
      "NVIDIA GPUs, on one process or many (" +
          forge::models::family_names() + ")",
      "forge"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "forge 0.1.0");

  forge::cli::Commands commands;
  forge::cli::add_train_command(app, commands);
  forge::cli::add_bench_command(app, commands);
  forge::cli::add_tokenizer_command(app, commands);
  forge::cli::add_convert_command(app, commands);
  forge::cli::add_data_command(app, commands);
  forge::cli::add_eval_command(app, commands);
  forge::cli::add_generate_command(app, commands);
  forge::cli::add_plan_command(app, commands);
  forge::cli::add_launch_command(app, commands);
  forge::cli::add_report_command(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Usage errors follow the same rule as every other error: one line (CLI11 would print two) and exit
    // status 1 (not CLI11's 104-109), so scripts need to know a single failure code.
    std::string message = e.what();
    // "forge frobnicate" or "forge --frob": CLI11 says only that a subcommand is required; name the word.
    if (dynamic_cast<const CLI::RequiredError*>(&e) && app.get_subcommands().empty() && argc > 1) {
      const std::string_view word = argv[1];
      std::vector<std::string_view> names;
      for (const auto& command : commands) names.push_back(command.app->get_name());
      message = word.starts_with("-")
                    ? fmt::format("unknown option '{}'", word)
                    : fmt::format("unknown command '{}'{}", word, forge::did_you_mean(word, names));
    }
    std::fprintf(stderr, "forge: error: %s (see forge --help)\n", message.c_str());
    return 1;
  }
  int status = 0;
  // FORGE_EMULATE_DEVICE=1: --device cuda runs on the host under the device emulation
  // (train/device_emulation.h: the CPU kernels, device memory closed to host code, MPI standing in for NCCL),
  // to test every command's GPU code path on a machine without a GPU. Slow, and its speeds mean nothing.
  std::optional<forge::train::DeviceEmulation> emulation;
  try {
    if (const char* e = std::getenv("FORGE_EMULATE_DEVICE"); e && *e) {
      const std::string_view mode(e);
      if (mode != "1" && mode != "dry")
        forge::fail("FORGE_EMULATE_DEVICE={}: expected 1 (run on the host) or dry (check only)", mode);
      emulation.emplace(mode == "dry" ? forge::EmulatedDevice::Mode::check_only
                                      : forge::EmulatedDevice::Mode::run);
      std::fprintf(
          stderr, "forge: FORGE_EMULATE_DEVICE=%s: cuda is emulated on the host (%s)\n", e,
          mode == "dry" ? "a dry run: ops are checked, not computed; results are zeros" : "tests only");
    }
    for (const auto& command : commands)
      if (*command.app) {
        status = command.run();
        break;
      }
  } catch (const std::exception& e) {
    // Under mpirun the other ranks would wait for this one in their next collective: end the whole job
    // (one line, exit status 1) instead of leaving them to time out.
    if (forge::comm::launched_by_mpi() && forge::comm::world().size() > 1)
      forge::comm::world().abort(e.what());
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  }
  if (emulation && forge::EmulatedDevice::check_only())
    std::fprintf(stderr,
                 "forge: dry run: %lld device ops checked, peak device memory %.2f GiB (%lld bytes)\n",
                 static_cast<long long>(forge::EmulatedDevice::ops_run()),
                 static_cast<double>(forge::EmulatedDevice::peak_bytes()) / (1 << 30),
                 static_cast<long long>(forge::EmulatedDevice::peak_bytes()));
  forge::comm::finalize();
  return status;
}
