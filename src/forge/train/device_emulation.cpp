#include "forge/train/device_emulation.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/error.h"

namespace forge::train {
namespace {

class EmulatedDeviceCommunicator;

// A send or receive on an emulated device communicator: the host communicator's non-blocking operation on a
// host copy of the message (a send's taken when it is posted, a receive's written to the device when it
// completes), started when its group is (see EmulatedDeviceCommunicator).
class EmulatedTransfer final : public comm::Work {
 public:
  using Start = std::function<comm::Request(void* staging)>;
  EmulatedTransfer(EmulatedDeviceCommunicator& owner, const char* op, int peer, void* device, int64_t bytes,
                   Start start)
      : owner_(&owner),
        op_(op),
        peer_(peer),
        device_(device),
        staging_(static_cast<size_t>(bytes)),
        start_(std::move(start)) {}
  // Launches the owner's posted group (as a test on a NCCL communicator does) and drives every emulated
  // communicator's transfers (a GPU runs all its streams while the host waits).
  bool test() override;
  const char* operation() const override { return op_; }
  std::string description() const override {
    return fmt::format("{} {} rank {}", op_, std::string(op_) == "send" ? "to" : "from", peer_);
  }
  void* staging() { return staging_.data(); }
  // Starts the transfer if it has not started; true once its message has arrived (or left). The request
  // completes with its whole group (complete()), as a NCCL group's operations share one event.
  bool advance();
  void complete() { done_ = true; }
  // Its message lands in the staging buffer only (the destination may be gone: an exception unwound it).
  void abandon() { device_ = nullptr; }

 private:
  EmulatedDeviceCommunicator* owner_;
  const char* op_;
  int peer_;
  void* device_;  // a receive's destination
  std::vector<std::byte> staging_;
  Start start_;
  comm::Request host_;
  bool started_ = false, arrived_ = false, done_ = false;
};

class EmulatedDeviceCommunicator final : public comm::Communicator {
 public:
  EmulatedDeviceCommunicator(std::unique_ptr<comm::Communicator> host, std::string name)
      : host_(std::move(host)) {
    rank_ = host_->rank(), size_ = host_->size(), world_rank_ = host_->world_rank();
    name_ = std::move(name);
    timeout_s_ = host_->timeout_seconds();
    live().push_back(this);
  }

  const char* backend() const override { return "emulated-nccl"; }

  comm::Request all_reduce(void* buf, int64_t count, comm::Type type, comm::ReduceOp op) override {
    check("all_reduce", buf, "buffer");
    return run([&] { return host_->all_reduce(buf, count, type, op); });
  }
  comm::Request all_gather(const void* send, void* recv, int64_t count, comm::Type type) override {
    check("all_gather", send, "send"), check("all_gather", recv, "recv");
    return run([&] { return host_->all_gather(send, recv, count, type); });
  }
  comm::Request all_gatherv(const void* send, void* recv, std::span<const int64_t> counts,
                            comm::Type type) override {
    check("all_gatherv", send, "send"), check("all_gatherv", recv, "recv");
    return run([&] { return host_->all_gatherv(send, recv, counts, type); });
  }
  comm::Request reduce_scatter(const void* send, void* recv, int64_t count, comm::Type type,
                               comm::ReduceOp op) override {
    check("reduce_scatter", send, "send"), check("reduce_scatter", recv, "recv");
    return run([&] { return host_->reduce_scatter(send, recv, count, type, op); });
  }
  comm::Request all_to_all(const void* send, void* recv, int64_t count, comm::Type type) override {
    check("all_to_all", send, "send"), check("all_to_all", recv, "recv");
    return run([&] { return host_->all_to_all(send, recv, count, type); });
  }
  comm::Request all_to_allv(const void* send, std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_displs, void* recv,
                            std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                            comm::Type type) override {
    check("all_to_allv", send, "send"), check("all_to_allv", recv, "recv");
    return run([&] {
      return host_->all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
    });
  }
  comm::Request send(const void* buf, int64_t count, comm::Type type, int peer, int tag) override {
    check("send", buf, "buffer");
    if (EmulatedDevice::check_only() || count == 0) return {};
    const int64_t bytes = count * static_cast<int64_t>(comm::type_size(type));
    auto work = std::make_shared<EmulatedTransfer>(
        *this, "send", peer, nullptr, bytes,
        [=, this](void* staging) { return host_->send(staging, count, type, peer, tag); });
    {
      EmulatedDevice::Access open;
      std::memcpy(work->staging(), buf, static_cast<size_t>(bytes));
    }
    return post(std::move(work));
  }
  comm::Request recv(void* buf, int64_t count, comm::Type type, int peer, int tag) override {
    check("recv", buf, "buffer");
    if (EmulatedDevice::check_only() || count == 0) return {};
    const int64_t bytes = count * static_cast<int64_t>(comm::type_size(type));
    auto work = std::make_shared<EmulatedTransfer>(*this, "recv", peer, buf, bytes, [=, this](void* staging) {
      return host_->recv(staging, count, type, peer, tag);
    });
    return post(std::move(work));
  }

  // Transfers nobody waited for still own their peers' messages: finished, as NCCL's destroy would wait.
  ~EmulatedDeviceCommunicator() override {
    // While an exception unwinds, the destinations of receives nobody waited for may be freed already (the
    // activations of the step that threw): every communicator's pending receives are abandoned first.
    if (std::uncaught_exceptions() > 0)
      for (EmulatedDeviceCommunicator* c : live()) {
        for (const auto& t : c->posted_) t->abandon();
        for (const auto& group : c->launched_)
          for (const auto& t : group) t->abandon();
      }
    drain("destroyed");
    std::erase(live(), this);
  }
  comm::Request broadcast(void* buf, int64_t count, comm::Type type, int root) override {
    check("broadcast", buf, "buffer");
    return run([&] { return host_->broadcast(buf, count, type, root); });
  }
  comm::Request barrier() override {
    return run([&] { return host_->barrier(); });
  }

  // The posted group starts after the ones launched before it.
  void launch() {
    if (!posted_.empty()) launched_.push_back(std::move(posted_)), posted_.clear();
  }
  // Moves every live emulated communicator's groups along: each starts its oldest group's transfers and
  // retires the group once all have completed, then the next.
  static void progress_all() {
    for (EmulatedDeviceCommunicator* c : live())
      while (!c->launched_.empty()) {
        bool all = true;
        for (const auto& t : c->launched_.front()) all = t->advance() && all;
        if (!all) break;
        for (const auto& t : c->launched_.front()) t->complete();
        c->launched_.pop_front();
      }
  }

  std::unique_ptr<comm::Communicator> split(int color, int key, std::string name) override {
    std::unique_ptr<comm::Communicator> child = host_->split(color, key, name);
    if (!child) return nullptr;
    return std::make_unique<EmulatedDeviceCommunicator>(std::move(child), std::move(name));
  }

  [[noreturn]] void abort(const std::string& message) override {
    host_->abort(message);
    std::abort();  // not reached: the host communicator's abort ends the job
  }

 private:
  // NCCL reads and writes device memory only: a host buffer here is the bug a GPU run would hit.
  void check(const char* op, const void* p, const char* what) const {
    if (p != nullptr && !EmulatedDevice::is_device_memory(p))
      fail("{} on the emulated nccl communicator '{}': the {} buffer {} is not device memory", op, name_,
           what, p);
  }
  // Launches what was posted and waits until every transfer of this communicator has completed.
  void drain(const char* when) {
    launch();
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      progress_all();
      if (launched_.empty()) return;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_)
        host_->abort(
            fmt::format("the emulated nccl communicator '{}' was {} with {} groups of sends and "
                        "receives in flight for {:.0f} s",
                        name_, when, launched_.size(), waited));
      std::this_thread::yield();
    }
  }
  // A collective runs after the sends and receives posted before it, as on the communicator's stream.
  template <typename Issue>
  comm::Request run(Issue&& issue) {
    if (EmulatedDevice::check_only())
      return {};  // a dry run moves no data (device memory is never committed)
    drain("in a collective");
    EmulatedDevice::Access open;
    issue().wait();
    return {};
  }

  comm::Request post(std::shared_ptr<EmulatedTransfer> work) {
    posted_.push_back(work);
    return {std::move(work), this};
  }
  // The emulated communicators alive in this process (the emulation's one thread creates and drives them).
  static std::vector<EmulatedDeviceCommunicator*>& live() {
    static std::vector<EmulatedDeviceCommunicator*> communicators;
    return communicators;
  }

  std::unique_ptr<comm::Communicator> host_;
  std::vector<std::shared_ptr<EmulatedTransfer>> posted_;                // the group not yet launched
  std::deque<std::vector<std::shared_ptr<EmulatedTransfer>>> launched_;  // groups in flight, oldest first
};

bool EmulatedTransfer::test() {
  if (done_) return true;
  owner_->launch();
  EmulatedDeviceCommunicator::progress_all();
  return done_;
}

bool EmulatedTransfer::advance() {
  if (!started_) host_ = start_(staging_.data()), started_ = true;
  if (arrived_) return true;
  if (!host_.test()) return false;
  if (device_ != nullptr) {
    EmulatedDevice::Access open;
    std::memcpy(device_, staging_.data(), staging_.size());
  }
  arrived_ = true;
  return true;
}

std::unique_ptr<comm::Communicator> make_emulated(comm::Communicator& bootstrap, std::string name) {
  return std::make_unique<EmulatedDeviceCommunicator>(bootstrap.split(0, bootstrap.rank(), name), name);
}

}  // namespace

DeviceEmulation::DeviceEmulation(EmulatedDevice::Mode mode) : device_(mode) {
  comm::override_device_communicators(make_emulated);
}

DeviceEmulation::~DeviceEmulation() { comm::override_device_communicators(nullptr); }

}  // namespace forge::train
