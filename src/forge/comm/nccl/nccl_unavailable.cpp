// Stands in for the nccl backend where forge was built without NCCL (CMake found no nccl.h, libnccl or CUDA
// runtime): callers need no #ifdef, they learn at run time that NCCL is not there.
#include "forge/comm/comm.h"
#include "forge/comm/comm_internal.h"
#include "forge/comm/nccl/device_memory.h"
#include "forge/core/error.h"

namespace forge::comm {

bool nccl_usable() { return false; }

std::unique_ptr<Communicator> detail::make_nccl_backend(Communicator&, int, std::string, void*) {
  fail(
      "make_nccl: forge was built without NCCL (CMake found no nccl.h, libnccl and CUDA runtime; "
      "see FORGE_NCCL)");
}

}  // namespace forge::comm

namespace forge::comm::nccl {

int device_count() { return 0; }

namespace {
[[noreturn]] void unavailable(const char* what) {
  fail("comm::nccl::{}: forge was built without NCCL and CUDA", what);
}
}  // namespace

void* device_alloc(int64_t bytes) { unavailable("device_alloc"); }
void device_free(void* ptr) {
  if (ptr) unavailable("device_free");
}
void copy_to_device(void* device_dst, const void* host_src, int64_t bytes) { unavailable("copy_to_device"); }
void copy_to_host(void* host_dst, const void* device_src, int64_t bytes) { unavailable("copy_to_host"); }

}  // namespace forge::comm::nccl
