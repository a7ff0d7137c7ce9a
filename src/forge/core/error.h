// Errors. At the configuration and API boundary forge throws forge::Error with a message that names the
// bad input; the command line prints it as one line and exits non-zero. Inside the runtime, FORGE_CHECK
// guards invariants with file:line.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace forge {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// An error that recurs identically however often the work is retried (a request larger than memory, a token
// id outside the vocabulary): the trainer stops at once rather than rolling back to try again.
class PermanentError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
[[noreturn]] void fail_permanently(fmt::format_string<Args...> format, Args&&... args) {
  throw PermanentError(fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace forge

#define FORGE_CHECK(cond, ...)                                                                              \
  do {                                                                                                      \
    if (!(cond)) {                                                                                          \
      throw ::forge::Error(                                                                                 \
          fmt::format("{}:{}: check failed: {}: {}", __FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__))); \
    }                                                                                                       \
  } while (0)
