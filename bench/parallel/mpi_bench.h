// What the MPI benchmarks of bench/parallel share: their stopwatch and median, a positive integer option's
// parsing, and a main that ends every rank with the one-line error.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/error.h"

namespace forge::bench {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// `value` of option `arg` of `tool` as a positive integer, or one line naming both.
inline int64_t positive_integer(const char* tool, const std::string& arg, const std::string& value) {
  try {
    size_t used = 0;
    const int64_t n = std::stoll(value, &used);
    if (used == value.size() && n > 0) return n;
  } catch (const std::exception&) {
  }
  fail("{}: {} takes a positive integer, not '{}'", tool, arg, value);
}

// Runs a benchmark's body; a forge::Error ends the job with its line (the other ranks do not wait).
inline int run_mpi_bench(int (*body)(int, char**), int argc, char** argv) {
  try {
    return body(argc, argv);
  } catch (const Error& e) {
    comm::world().abort(e.what());  // does not return
  }
  return 1;
}

}  // namespace forge::bench
