// Two pieces of work interleaved on one thread, each on its own stack (a fiber), taking turns at the points
// where one of them would otherwise wait on communication.
//
// What it is for: DualPipe's overlapped pair (parallel/pipeline/executor.h, Op::forward_backward) runs the
// forward of one micro-batch and the backward of another so that each one's all-to-all travels while the
// other computes (DeepSeek-V3 report, figure 4). The token dispatcher (nn/expert_parallel.h) yields to the
// partner right after launching a transfer's wait-point, instead of blocking; the partner computes until its
// own transfer, and yields back. The model code stays straight-line: no phase splitting, no callbacks.
//
// Why fibers and not threads: every MPI call, OpenMP team and CUDA context stays on the one thread that
// owns them (MPI_THREAD_FUNNELED suffices, no second OpenMP pool spins against the first), and only one
// fiber runs at a time, so the two pieces of work share every data structure without locks.
//
// Determinism: a switch happens at every yield_to_partner() call, never depending on timing (whether a
// transfer has already arrived, say). Every rank of a group therefore issues its collectives in the same
// order, which collectives on one communicator require.
#pragma once

#include <cstdint>
#include <functional>

namespace forge {

// Runs first and second as two fibers on this thread: first until its first yield_to_partner() (or its end),
// then second until its first, then first again, ...; once one has ended, the other runs on without
// switching. Returns when both have ended. An exception in either ends the pair: it is rethrown here, and the
// other fiber is abandoned where it stood (its stack is not unwound; the process is expected to report the
// error and exit). Not reentrant: calling it inside a fiber is an error.
void run_interleaved(const std::function<void()>& first, const std::function<void()>& second);

// Inside run_interleaved while the partner has not ended: switches to it, and returns when it yields back or
// ends. Anywhere else: does nothing.
void yield_to_partner();

// True inside a fiber of run_interleaved whose partner has not ended (yield_to_partner would switch).
bool has_partner();

// Switches yield_to_partner() made on this thread so far (for tests and benchmarks: did a pair interleave?).
int64_t fiber_switches();

}  // namespace forge
