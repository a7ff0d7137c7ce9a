// One background thread running submitted tasks in order (an offloaded optimizer's host updates, while the
// calling thread moves the next bucket to or from the device). A task's exception is rethrown by the wait
// that covers it; the destructor waits for what is queued, then joins.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace forge {

class WorkerThread {
 public:
  WorkerThread();
  ~WorkerThread();
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  // Queues a task; returns its ticket (0, 1, 2, ... in submission order).
  int64_t submit(std::function<void()> task);
  // Returns once the task of `ticket` and every earlier one has run; rethrows the first exception any of
  // them threw (once).
  void wait(int64_t ticket);
  void wait_all() { wait(submitted_ - 1); }
  int64_t submitted() const { return submitted_; }

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<std::function<void()>> queue_;
  int64_t submitted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace forge
