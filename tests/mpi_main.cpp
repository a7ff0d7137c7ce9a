// main() of the multi-process test binaries (test_<layer>_mpi, run by mpirun): initialises MPI through
// comm::world, lets only rank 0 print GoogleTest's report (other ranks print failures only), and makes
// every rank exit with the same status: a failure on any rank fails the run.
#include <gtest/gtest.h>

#include "forge/comm/comm.h"

namespace {
// Prints nothing but failed assertions (ranks other than 0).
class FailuresOnly : public ::testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  forge::comm::Communicator& world = forge::comm::world(/*force_mpi=*/true);
  world.set_timeout_seconds(120);  // a test that deadlocks is reported, not waited on
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(world.rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  const double any = forge::comm::all_reduce_max(world, static_cast<double>(failed));
  forge::comm::finalize();
  return any > 0 ? 1 : 0;
}
