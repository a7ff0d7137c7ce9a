// How much host memory a model being built may take: this machine's (core/memory.h, host_memory_bytes), or
// no bound on a dry device (kernels/emulated_device.h, Mode::check_only), which initialises nothing on the
// host, so that a model far larger than this machine can be traced.
#pragma once

#include <cstdint>

namespace forge {

int64_t model_host_memory_bytes();

}  // namespace forge
