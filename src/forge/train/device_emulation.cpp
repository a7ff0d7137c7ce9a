#include "forge/train/device_emulation.h"

#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "forge/comm/comm.h"
#include "forge/core/error.h"

namespace forge::train {
namespace {

// A communicator over emulated device memory: the host communicator it wraps (a duplicate of make_nccl's
// bootstrap) runs every operation to completion with device memory open, after checking that the buffers are
// device memory. Operations are therefore complete when they return; nothing overlaps.
class EmulatedDeviceCommunicator final : public comm::Communicator {
 public:
  EmulatedDeviceCommunicator(std::unique_ptr<comm::Communicator> host, std::string name)
      : host_(std::move(host)) {
    rank_ = host_->rank(), size_ = host_->size(), world_rank_ = host_->world_rank();
    name_ = std::move(name);
    timeout_s_ = host_->timeout_seconds();
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
    return run([&] { return host_->send(buf, count, type, peer, tag); });
  }
  comm::Request recv(void* buf, int64_t count, comm::Type type, int peer, int tag) override {
    check("recv", buf, "buffer");
    return run([&] { return host_->recv(buf, count, type, peer, tag); });
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

  std::unique_ptr<comm::Communicator> host_;
};

std::unique_ptr<comm::Communicator> make_emulated(comm::Communicator& bootstrap, std::string name) {
  return std::make_unique<EmulatedDeviceCommunicator>(bootstrap.split(0, bootstrap.rank(), name), name);
}

}  // namespace

DeviceEmulation::DeviceEmulation(EmulatedDevice::Mode mode) : device_(mode) {
  comm::override_device_communicators(make_emulated);
}

DeviceEmulation::~DeviceEmulation() { comm::override_device_communicators(nullptr); }

}  // namespace forge::train
