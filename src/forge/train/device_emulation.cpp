#include "forge/train/device_emulation.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
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

// A send or receive on an emulated device communicator. It starts (the host communicator's non-blocking
// operation on a host copy of the message: a send's taken when it is posted, a receive's written to the
// device when it completes) only once every transfer posted before it on the same communicator has completed,
// as operations on one NCCL communicator's stream run one after another.
class EmulatedTransfer final : public comm::Work {
 public:
  using Start = std::function<comm::Request(void* staging)>;
  EmulatedTransfer(const char* op, int peer, void* device, int64_t bytes, Start start)
      : op_(op),
        peer_(peer),
        device_(device),
        staging_(static_cast<size_t>(bytes)),
        start_(std::move(start)) {}
  bool test() override;  // drives every emulated communicator's transfers (the device runs on its own)
  const char* operation() const override { return op_; }
  std::string description() const override {
    return fmt::format("{} {} rank {}", op_, std::string(op_) == "send" ? "to" : "from", peer_);
  }
  void* staging() { return staging_.data(); }
  // Starts the transfer if it has not started; true once it has completed.
  bool advance();

 private:
  const char* op_;
  int peer_;
  void* device_;  // a receive's destination
  std::vector<std::byte> staging_;
  Start start_;
  comm::Request host_;
  bool started_ = false, done_ = false;
};

// A communicator over emulated device memory: the host communicator it wraps (a duplicate of make_nccl's
// bootstrap) runs every collective to completion with device memory open, after checking that the buffers
// are device memory; collectives are therefore complete when they return and nothing overlaps. Sends and
// receives stay in flight, as NCCL's do, and run one after another in the order they were posted (see
// EmulatedTransfer), as on one NCCL communicator's stream: so messages that would deadlock on NCCL's streams
// deadlock here too (and time out with the usual line), rather than passing on MPI's looser ordering. Waiting
// on any transfer moves every communicator's queue along, as a GPU runs every stream while the host waits.
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
    auto work = std::make_shared<EmulatedTransfer>("send", peer, nullptr, bytes, [=, this](void* staging) {
      return host_->send(staging, count, type, peer, tag);
    });
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
    auto work = std::make_shared<EmulatedTransfer>("recv", peer, buf, bytes, [=, this](void* staging) {
      return host_->recv(staging, count, type, peer, tag);
    });
    return post(std::move(work));
  }

  // Moves every live emulated communicator's queue of transfers along: each starts its oldest transfer and
  // retires it once complete, then the next.
  static void progress_all() {
    for (EmulatedDeviceCommunicator* c : live())
      while (!c->in_flight_.empty() && c->in_flight_.front()->advance()) c->in_flight_.pop_front();
  }

  // Transfers nobody waited for still own their peers' messages: finished, as NCCL's destroy would wait.
  ~EmulatedDeviceCommunicator() override {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      progress_all();
      if (in_flight_.empty()) break;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_)
        host_->abort(
            fmt::format("the emulated nccl communicator '{}' was destroyed with {} transfers in flight "
                        "for {:.0f} s",
                        name_, in_flight_.size(), waited));
      std::this_thread::yield();
    }
    std::erase(live(), this);
  }
  comm::Request broadcast(void* buf, int64_t count, comm::Type type, int root) override {
    check("broadcast", buf, "buffer");
    return run([&] { return host_->broadcast(buf, count, type, root); });
  }
  comm::Request barrier() override {
    return run([&] { return host_->barrier(); });
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
  template <typename Issue>
  comm::Request run(Issue&& issue) {
    if (EmulatedDevice::check_only())
      return {};  // a dry run moves no data (device memory is never committed)
    EmulatedDevice::Access open;
    issue().wait();
    return {};
  }

  comm::Request post(std::shared_ptr<EmulatedTransfer> work) {
    in_flight_.push_back(work);
    progress_all();  // an idle communicator starts it at once
    return {std::move(work), this};
  }
  // The emulated communicators alive in this process (the emulation's one thread creates and drives them).
  static std::vector<EmulatedDeviceCommunicator*>& live() {
    static std::vector<EmulatedDeviceCommunicator*> communicators;
    return communicators;
  }

  std::unique_ptr<comm::Communicator> host_;
  std::deque<std::shared_ptr<EmulatedTransfer>> in_flight_;  // posted sends and receives, oldest first
};

bool EmulatedTransfer::test() {
  if (!done_) EmulatedDeviceCommunicator::progress_all();
  return done_;
}

bool EmulatedTransfer::advance() {
  if (!started_) host_ = start_(staging_.data()), started_ = true;
  if (done_) return true;
  if (!host_.test()) return false;
  if (device_ != nullptr) {
    EmulatedDevice::Access open;
    std::memcpy(device_, staging_.data(), staging_.size());
  }
  done_ = true;
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
