#include "forge/core/worker_thread.h"

#include <utility>

namespace forge {

WorkerThread::WorkerThread() : thread_([this] { run(); }) {}

WorkerThread::~WorkerThread() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

int64_t WorkerThread::submit(std::function<void()> task) {
  int64_t ticket = 0;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ticket = submitted_++;
  }
  wake_.notify_one();
  return ticket;
}

void WorkerThread::wait(int64_t ticket) {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return finished_ > ticket; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void WorkerThread::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    ++finished_;
    done_.notify_all();
  }
}

}  // namespace forge
