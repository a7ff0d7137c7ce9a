// What a training run tells its user: lines on standard output, from the first rank only (every rank runs
// the same loop; one of them speaks). A run owns one and hands it to whatever prints.
#pragma once

#include <cstdarg>
#include <cstdio>

namespace forge::train {

class RunLog {
 public:
  explicit RunLog(bool leader) : leader_(leader) {}
  bool leader() const { return leader_; }  // this rank speaks (and writes the run's shared files)
  // printf-style; flushed at once, so that a line is out before a long step or a crash.
  __attribute__((format(printf, 2, 3))) void say(const char* format, ...) const {
    if (!leader_) return;
    va_list args;
    va_start(args, format);
    std::vprintf(format, args);
    va_end(args);
    std::fflush(stdout);
  }

 private:
  bool leader_;
};

}  // namespace forge::train
