// How the commands that read a model name it and read a checkpoint series (commands.h).
#include <cstdio>

#include "commands.h"

namespace forge::cli {

void add_series_reading_flag(CLI::App* command, models::SeriesReading& reading) {
  command->add_flag("--allow-older-checkpoint", reading.allow_older,
                    "when the newest step of a checkpoint directory is damaged, read the newest step that "
                    "loads (the default refuses, naming the step and the damage)");
}

void say_source(const char* command, const models::PretrainedDir& source) {
  if (source.series.empty()) return;
  std::fprintf(stderr, "forge %s: reading %s%s\n", command, source.describe().c_str(),
               source.note.empty() ? "" : ("; " + source.note).c_str());
  std::fflush(stderr);
}

}  // namespace forge::cli
