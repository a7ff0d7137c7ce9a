// For the backends' support predicates (OpTable::supports_<op>, op_list.h): a refusal with its one-line
// reason.
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>

namespace forge::ops {

// Writes the reason into *reason when one is asked for (a caller that only asks whether pays for no
// formatting) and returns false: `if (bad) return refuse(reason, "op: ...", ...);`. A kernel runs its own
// predicate with a reason and fails with it: `if (std::string why; !supports_op(p, &why)) fail("{}", why);`.
template <typename... Args>
bool refuse(std::string* reason, fmt::format_string<Args...> format, Args&&... args) {
  if (reason) *reason = fmt::format(format, std::forward<Args>(args)...);
  return false;
}

// The usual refusal of a pointer the parameters need: "op: name is null" (the CUDA backend's wording).
inline bool pointer_set(const void* pointer, const char* op, const char* name, std::string* reason) {
  return pointer != nullptr || refuse(reason, "{}: {} is null", op, name);
}

}  // namespace forge::ops
