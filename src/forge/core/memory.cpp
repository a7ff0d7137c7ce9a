#include "forge/core/memory.h"

#include <unistd.h>

#include <algorithm>
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
