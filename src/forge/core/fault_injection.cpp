#include "forge/core/fault_injection.h"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "forge/core/error.h"

namespace forge {
namespace {

struct FaultSpec {
  bool armed = false;
  std::string point;
  long nth = 1, rank = -1, seen = 0;
};

FaultSpec parse_spec(const char* variable) {
  FaultSpec spec;
  const char* env = std::getenv(variable);
  if (!env || !*env) return spec;
  std::string text(env);
  if (const size_t at = text.find('@'); at != std::string::npos) {
    spec.rank = std::strtol(text.c_str() + at + 1, nullptr, 10);
    text.resize(at);
  }
  if (const size_t colon = text.find(':'); colon != std::string::npos) {
    spec.nth = std::strtol(text.c_str() + colon + 1, nullptr, 10);
    text.resize(colon);
  }
  spec.point = text;
  spec.armed = true;
  return spec;
}

bool reached(FaultSpec& spec, std::string_view point, int rank) {
  if (!spec.armed || point != spec.point || (spec.rank >= 0 && spec.rank != rank)) return false;
  return ++spec.seen == spec.nth;
}

std::atomic<bool> g_armed{false};
std::mutex g_armed_mutex;
std::string g_armed_point, g_armed_message;

}  // namespace

void arm_fail_point(std::string_view point, std::string message) {
  std::lock_guard lock(g_armed_mutex);
  g_armed_point = point;
  g_armed_message = std::move(message);
  g_armed.store(true);
}

void fail_point(std::string_view point, int rank) {
  if (g_armed.load()) {
    std::unique_lock lock(g_armed_mutex);
    if (g_armed.load() && g_armed_point == point) {
      g_armed.store(false);
      const std::string message = std::move(g_armed_message);
      lock.unlock();
      fail("{}", message);
    }
  }
  static FaultSpec spec = parse_spec("FORGE_TEST_FAIL_AT");
  if (reached(spec, point, rank)) fail("{}: injected failure (FORGE_TEST_FAIL_AT)", point);
}

void kill_point(std::string_view point, int rank) {
  static FaultSpec spec = parse_spec("FORGE_TEST_KILL_AT");
  if (!reached(spec, point, rank)) return;
  std::fprintf(stderr, "forge: FORGE_TEST_KILL_AT: killed at %s (rank %d)\n", spec.point.c_str(), rank);
  std::fflush(stderr);
  std::raise(SIGKILL);
}

}  // namespace forge
