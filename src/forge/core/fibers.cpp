#include "forge/core/fibers.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstddef>
#include <exception>

#include "forge/core/error.h"

namespace forge {
namespace {

// A model's forward or backward keeps little on the stack (tensors live on the heap), but oneDNN and the
// kernels' scratch may take some: 8 MiB, a thread's default, reserved lazily by the kernel. A guard page
// below it turns an overflow into a fault instead of silent corruption.
constexpr size_t kStackBytes = size_t{8} << 20;

struct Fiber {
  ucontext_t context{};
  void* mapping = nullptr;
  size_t mapping_bytes = 0;
  const std::function<void()>* work = nullptr;
  bool done = false;
  std::exception_ptr error;
};

struct Pair {
  ucontext_t caller{};
  Fiber fibers[2];
  int running = -1;  // index of the fiber that runs, -1: the caller
};

thread_local Pair* g_pair = nullptr;
thread_local int64_t g_switches = 0;

void fiber_main() {
  Pair& p = *g_pair;
  Fiber& f = p.fibers[p.running];
  try {
    (*f.work)();
  } catch (...) {
    f.error = std::current_exception();
  }
  f.done = true;
  swapcontext(&f.context, &p.caller);  // never resumed
}

void make_fiber(Fiber& f, const std::function<void()>& work) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  f.mapping_bytes = kStackBytes + page;
  f.mapping = mmap(nullptr, f.mapping_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (f.mapping == MAP_FAILED) fail("run_interleaved: cannot map a fiber stack of {} bytes", f.mapping_bytes);
  mprotect(f.mapping, page, PROT_NONE);  // the guard (stacks grow down)
  FORGE_CHECK(getcontext(&f.context) == 0, "run_interleaved: getcontext failed");
  f.context.uc_stack.ss_sp = static_cast<char*>(f.mapping) + page;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  f.work = &work;
  makecontext(&f.context, fiber_main, 0);
}

}  // namespace

void run_interleaved(const std::function<void()>& first, const std::function<void()>& second) {
  FORGE_CHECK(g_pair == nullptr, "run_interleaved inside an interleaved fiber");
  Pair pair;
  make_fiber(pair.fibers[0], first);
  make_fiber(pair.fibers[1], second);
  g_pair = &pair;
  int next = 0;
  std::exception_ptr error;
  while (!pair.fibers[0].done || !pair.fibers[1].done) {
    if (pair.fibers[next].done) next = 1 - next;
    pair.running = next;
    swapcontext(&pair.caller, &pair.fibers[next].context);
    if (pair.fibers[next].error) {
      error = pair.fibers[next].error;
      break;
    }
    next = 1 - next;
  }
  g_pair = nullptr;
  pair.running = -1;
  if (error) {
    // The other fiber may hold live objects on its stack (buffers a transfer still writes into): its stack is
    // left mapped.
    for (Fiber& f : pair.fibers)
      if (f.done) munmap(f.mapping, f.mapping_bytes);
    std::rethrow_exception(error);
  }
  for (Fiber& f : pair.fibers) munmap(f.mapping, f.mapping_bytes);
}

bool has_partner() {
  return g_pair != nullptr && g_pair->running >= 0 && !g_pair->fibers[1 - g_pair->running].done;
}

int64_t fiber_switches() { return g_switches; }

void yield_to_partner() {
  if (!has_partner()) return;
  Fiber& self = g_pair->fibers[g_pair->running];
  ++g_switches;
  swapcontext(&self.context, &g_pair->caller);
}

}  // namespace forge
