// Allocator statistics: live and peak bytes of all CPU tensor storage in the process (like
// torch.cuda.max_memory_allocated). Peak activation memory of a step = peak during the step minus what
// was live before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "forge/core/error.h"

namespace forge {

struct MemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};

MemoryStats memory_stats();
void reset_peak_memory();  // peak := live

// A cap on the live bytes of host tensors (0: none), as a device's capacity caps its memory: an allocation
// that would pass it throws OutOfMemory, naming `setting` (what set the cap, for the message), and allocates
// nothing. Lets a CPU run stand for a device of a given size (train.memory_limit_mb).
class OutOfMemory : public PermanentError {
 public:
  using PermanentError::PermanentError;
};
void set_host_memory_limit(int64_t bytes, std::string setting = {});
int64_t host_memory_limit();

// Sets the cap for its lifetime, then restores the one before.
class ScopedHostMemoryLimit {
 public:
  ScopedHostMemoryLimit(int64_t bytes, std::string setting);
  ~ScopedHostMemoryLimit();
  ScopedHostMemoryLimit(const ScopedHostMemoryLimit&) = delete;
  ScopedHostMemoryLimit& operator=(const ScopedHostMemoryLimit&) = delete;

 private:
  int64_t previous_;
  std::string previous_setting_;
};

// Memory this process may use on the host: the physical memory, or the cgroup's limit when lower.
int64_t host_memory_bytes();

// memcpy of host memory by every OpenMP thread, in chunks: a large copy (a snapshot of the state, the copy a
// background checkpoint save writes from) runs at the machine's memory bandwidth rather than one core's.
void copy_host_parallel(void* destination, const void* source, size_t bytes);

}  // namespace forge
