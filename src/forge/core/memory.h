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

}  // namespace forge
