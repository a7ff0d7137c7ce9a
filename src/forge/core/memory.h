// Allocator statistics: live and peak bytes of all CPU tensor storage in the process (like
// torch.cuda.max_memory_allocated). Peak activation memory of a step = peak during the step minus what
// was live before it.
#pragma once

#include <cstdint>

namespace forge {

struct MemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};

MemoryStats memory_stats();
void reset_peak_memory();  // peak := live

// Memory this process may use on the host: the physical memory, or the cgroup's limit when lower.
int64_t host_memory_bytes();

}  // namespace forge
