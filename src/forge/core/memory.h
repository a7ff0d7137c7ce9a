// Allocator statistics: live and peak bytes of all CPU tensor storage in the process (like
// torch.cuda.max_memory_allocated). Peak activation memory of a step = peak during the step minus what
// was live before it.
#pragma once

#include <cstddef>
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

// memcpy of host memory by every OpenMP thread, in chunks: a large copy (a snapshot of the state, the copy a
// background checkpoint save writes from) runs at the machine's memory bandwidth rather than one core's.
void copy_host_parallel(void* destination, const void* source, size_t bytes);

}  // namespace forge
