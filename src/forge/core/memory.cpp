#include "forge/core/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

namespace forge {

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  int64_t bytes = pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size
                                             : std::numeric_limits<int64_t>::max();
  // A container's limit (cgroup v2, then v1). "max" (v2's no limit) does not parse; v1's no limit is a huge
  // number, above the physical memory.
  for (const char* limit_file :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(limit_file);
    long long limit = 0;
    if (in >> limit && limit > 0) bytes = std::min<int64_t>(bytes, limit);
  }
  return bytes;
}

}  // namespace forge

namespace forge {

void copy_host_parallel(void* destination, const void* source, size_t bytes) {
  constexpr size_t kChunk = size_t{4} << 20;  // small copies stay on the calling thread
  auto* to = static_cast<char*>(destination);
  const auto* from = static_cast<const char*>(source);
  if (bytes <= kChunk) {
    if (bytes > 0) std::memcpy(to, from, bytes);
    return;
  }
  const int64_t chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    std::memcpy(to + begin, from + begin, std::min(kChunk, bytes - begin));
  }
}

}  // namespace forge
