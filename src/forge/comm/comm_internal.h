// Shared by the comm backends (not part of the API): the timeout loop, the job abort, argument checks.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "forge/comm/comm.h"

namespace forge::comm::detail {

// "group 'dp' (rank 0 of 2, world rank 3)": who is speaking, for messages.
std::string group_label(const Communicator& c);

// "<work description> on <group label> did not complete within <timeout> s".
std::string timeout_message(const Work& work, const std::string& group_label, double timeout_s);
std::string timeout_message(const std::string& what, const std::string& group_label, double timeout_s);

// "rank R: MPI start-up did not complete within N s (parallel.timeout_s / FORGE_COMM_TIMEOUT); ...": what the
// watchdog of MPI_Init (phase "start-up") or MPI_Finalize (phase "shutdown") prints. rank < 0: not known.
std::string phase_timeout_message(std::string_view phase, int rank, double timeout_s);

// This process's rank as its launcher set it (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID),
// known before MPI_Init; -1 when none is set.
int launcher_rank();

// Ties a launched rank's life to its launcher's (mpirun, orted, srun's step daemon: the parent that started
// it, when launcher_rank() >= 0): SIGKILL when the launcher dies. OpenMPI gives each rank a process group of
// its own, so a SIGKILL of mpirun's group reached no rank: orphaned ranks trained on for seconds, committing
// checkpoints into a run directory that their killer (or a restarted job) took for the killed job's.
// Linux only (PR_SET_PDEATHSIG); elsewhere does nothing.
void die_with_launcher();

// Test-only fault injection: FORGE_FAULT_STALL="<point>:<rank>[,<point>:<rank>...]" makes that rank stop
// at that point for good (it sleeps, saying so on stderr), so tests can check that a stalled rank ends the
// job within the timeout instead of hanging it. Points: "before_init" (before MPI_Init) and
// "after_last_collective" (after finalize's barrier, before MPI_Finalize). Unset: does nothing.
void stall_if_injected(std::string_view point, int rank);

// Prints "forge: error: <message>" as one line on stderr and ends the job: MPI_Abort(MPI_COMM_WORLD, 1)
// when forge's MPI backend is running, exit(1) otherwise.
[[noreturn]] void abort_job(const std::string& message);
// The same line, then _Exit(1) without calling MPI: for watchdog threads (MPI_THREAD_FUNNELED lets only the
// main thread call MPI); mpirun then ends the job.
[[noreturn]] void exit_from_watchdog(const std::string& message);

// Polls work.test() with a short backoff (spin, then sleeps growing to a millisecond) until it completes.
// Returns false if timeout_s (> 0) passed first.
bool poll_until_complete(Work& work, double timeout_s);

// For a backend's Work destructor when the operation was never waited on: its buffers may still be in use,
// so complete it (under the timeout) or end the job. Never throws.
void complete_in_destructor(Work& work, const std::string& group_label, double timeout_s) noexcept;

// Argument checks at the API boundary (throw forge::Error naming the operation and the group).
void check_count(const Communicator& c, const char* op, int64_t count, const char* what = "count");
void check_per_rank(const Communicator& c, const char* op, std::span<const int64_t> values, const char* what);
void check_rank(const Communicator& c, const char* op, int rank, const char* what);
void check_buffer(const Communicator& c, const char* op, const void* buf, int64_t count, const char* what);

// make_nccl's backend (comm/nccl/nccl_comm.cpp, or nccl_unavailable.cpp where forge has no NCCL); make_nccl
// itself checks the bootstrap and the override first.
std::unique_ptr<Communicator> make_nccl_backend(Communicator& bootstrap, int cuda_device, std::string name,
                                                void* producer_stream);

}  // namespace forge::comm::detail
