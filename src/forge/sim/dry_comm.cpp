#include "forge/sim/dry_comm.h"

#include <cstring>
#include <numeric>

#include "forge/core/error.h"
#include "forge/kernels/emulated_device.h"

namespace forge::sim {
namespace {

class DryCommunicator final : public comm::Communicator {
 public:
  DryCommunicator(DryGroup group, std::shared_ptr<CommLog> log, std::vector<DryGroup> splits)
      : log_(std::move(log)), splits_(std::move(splits)) {
    name_ = std::move(group.name);
    size_ = group.size, rank_ = group.rank;
    timeout_s_ = 0;
  }
  const char* backend() const override { return "dry"; }

  comm::Request all_reduce(void*, int64_t count, comm::Type type, comm::ReduceOp) override {
    return note("all_reduce", count * static_cast<int64_t>(comm::type_size(type)));
  }
  void all_reduce_blocking(void*, int64_t count, comm::Type type, comm::ReduceOp) override {
    note("all_reduce", count * static_cast<int64_t>(comm::type_size(type)), true);
  }
  comm::Request all_gather(const void*, void*, int64_t count, comm::Type type) override {
    return note("all_gather", count * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request all_gatherv(const void*, void*, std::span<const int64_t> counts, comm::Type type) override {
    const int64_t mine = counts.empty() ? 0 : counts[static_cast<size_t>(rank_) % counts.size()];
    return note("all_gather", mine * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request reduce_scatter(const void*, void*, int64_t count, comm::Type type, comm::ReduceOp) override {
    return note("reduce_scatter", count * size_ * static_cast<int64_t>(comm::type_size(type)));
  }
  // Host buffers on a dry device (the expert counts' exchange: nn/expert_parallel.h) are answered as if every
  // rank behaved like this one: each sends this rank what this rank sends itself.
  comm::Request all_to_all(const void* send, void* recv, int64_t count, comm::Type type) override {
    const size_t block = static_cast<size_t>(count) * comm::type_size(type);
    if (EmulatedDevice::check_only() && send && recv && !EmulatedDevice::is_device_memory(send) &&
        !EmulatedDevice::is_device_memory(recv))
      for (int s = 0; s < size_; ++s)
        std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(s) * block,
                    static_cast<const char*>(send) + static_cast<size_t>(rank_) * block, block);
    return note("all_to_all", count * size_ * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request all_to_allv(const void*, std::span<const int64_t> send_counts, std::span<const int64_t>,
                            void*, std::span<const int64_t>, std::span<const int64_t>,
                            comm::Type type) override {
    const int64_t total = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
    return note("all_to_all", total * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request send(const void*, int64_t count, comm::Type type, int, int) override {
    return note("send", count * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request recv(void*, int64_t count, comm::Type type, int, int) override {
    return note("recv", count * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request broadcast(void*, int64_t count, comm::Type type, int) override {
    return note("broadcast", count * static_cast<int64_t>(comm::type_size(type)));
  }
  comm::Request barrier() override { return note("barrier", 0); }

  std::unique_ptr<comm::Communicator> split(int color, int, std::string name) override {
    if (color < 0) return nullptr;
    for (const DryGroup& g : splits_)
      if (g.name == name) return std::make_unique<DryCommunicator>(g, log_, splits_);
    fail("simulated rank: no size known for the group '{}'", name);
  }
  [[noreturn]] void abort(const std::string& message) override { fail("{}", message); }

 private:
  comm::Request note(const char* op, int64_t bytes, bool blocking = false) {
    if (size_ > 1) log_->events.push_back({op, name_, size_, bytes, blocking});
    return {};
  }
  std::shared_ptr<CommLog> log_;
  std::vector<DryGroup> splits_;
};

}  // namespace

std::unique_ptr<comm::Communicator> make_dry_communicator(DryGroup group, std::shared_ptr<CommLog> log,
                                                          std::vector<DryGroup> splits) {
  return std::make_unique<DryCommunicator>(std::move(group), std::move(log), std::move(splits));
}

}  // namespace forge::sim
