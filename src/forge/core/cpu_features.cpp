#include "forge/core/cpu_features.h"

namespace forge {

bool cpu_has_native_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}

}  // namespace forge
