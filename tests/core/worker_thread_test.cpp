// The background worker: tasks run in submission order on one other thread; a wait returns once its task
// and every earlier one ran, and rethrows (once) the first exception one of them threw; the destructor runs
// what is queued before joining.
#include "forge/core/worker_thread.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace forge::worker_thread_test {
namespace {

TEST(WorkerThread, RunsTasksInOrderOnAnotherThread) {
  std::vector<int> order(50, -1);
  std::atomic<int> next{0};
  std::atomic<bool> elsewhere{true};
  const std::thread::id caller = std::this_thread::get_id();
  WorkerThread worker;
  std::vector<int64_t> tickets;
  for (int i = 0; i < 50; ++i)
    tickets.push_back(worker.submit([&, i] {
      order[static_cast<size_t>(next++)] = i;
      if (std::this_thread::get_id() == caller) elsewhere = false;
    }));
  worker.wait(tickets[9]);
  EXPECT_GE(next.load(), 10);
  worker.wait_all();
  ASSERT_EQ(next.load(), 50);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  EXPECT_TRUE(elsewhere);
  EXPECT_EQ(worker.submitted(), 50);
}

TEST(WorkerThread, RethrowsATasksErrorOnceAndGoesOn) {
  WorkerThread worker;
  int ran = 0;
  worker.submit([&] { ++ran; });
  const int64_t bad = worker.submit([] { throw std::runtime_error("host update failed"); });
  const int64_t after = worker.submit([&] { ++ran; });
  try {
    worker.wait(bad);
    ADD_FAILURE() << "the task's error was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "host update failed");
  }
  worker.wait(after);  // reported once: later waits succeed
  EXPECT_EQ(ran, 2);
  worker.wait_all();  // nothing submitted yet is fine too
}

TEST(WorkerThread, TheDestructorRunsWhatIsQueued) {
  std::atomic<int> ran{0};
  {
    WorkerThread worker;
    for (int i = 0; i < 20; ++i) worker.submit([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 20);
  WorkerThread idle;  // nothing ever submitted
  idle.wait_all();
}

}  // namespace
}  // namespace forge::worker_thread_test
