// The forge command line: one subcommand per tools/forge/cmd_<name>.cpp (see commands.h). Every error is
// one line on stderr ("forge: error: ...") and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "commands.h"
#include "forge/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"forge: train large language models natively in C++ (LLaMA-family on CPU and GPU)", "forge"};
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Usage errors follow the same one-line rule as every other error (CLI11 would print two lines).
    std::fprintf(stderr, "forge: error: %s (see forge --help)\n", e.what());
    return e.get_exit_code() != 0 ? e.get_exit_code() : 2;
  }
  try {
    for (const auto& command : commands)
      if (*command.app) return command.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
