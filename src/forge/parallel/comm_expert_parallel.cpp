#include "forge/parallel/comm_expert_parallel.h"

#include "forge/core/error.h"

namespace forge::parallel {
namespace {

// A host transfer completes on the host; a device one in the device's stream order (the kernels queued
// after wait() run after it, and the host goes on).
class CommTransfer final : public nn::ExpertParallel::Transfer {
 public:
  CommTransfer(comm::Communicator* group, comm::Request request, bool on_device)
      : group_(group), request_(std::move(request)), on_device_(on_device) {}
  void wait() override {
    if (on_device_)
      group_->wait_on_stream(request_);
    else
      request_.wait();
  }
  void progress() override {
    if (!on_device_) request_.test();
  }

 private:
  comm::Communicator* group_;
  comm::Request request_;
  bool on_device_;
};

}  // namespace

void CommExpertParallel::exchange_counts(const int64_t* send, int64_t* recv, int64_t n) {
  group_->all_to_all(send, recv, n, comm::Type::i64).wait();
}

std::unique_ptr<nn::ExpertParallel::Transfer> CommExpertParallel::all_to_all_rows(
    const Tensor& send, std::span<const int64_t> send_rows, const Tensor& recv,
    std::span<const int64_t> recv_rows, int64_t cols) {
  const int n = size();
  FORGE_CHECK(static_cast<int>(send_rows.size()) == n && static_cast<int>(recv_rows.size()) == n,
              "expert all-to-all: {} and {} row counts for {} ranks", send_rows.size(), recv_rows.size(), n);
  FORGE_CHECK(send.dtype() == recv.dtype() && (send.dtype() == DType::f32 || send.dtype() == DType::bf16),
              "expert all-to-all moves fp32 or bf16 rows, the same on both sides");
  const bool on_device = send.device() != Device::cpu;
  comm::Communicator* group = on_device ? device_group_ : group_;
  FORGE_CHECK(group != nullptr, "expert parallelism: device rows, but the group has no device communicator");
  std::vector<int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  int64_t s = 0, r = 0;
  for (int j = 0; j < n; ++j) {
    send_counts[j] = send_rows[j] * cols, send_displs[j] = s, s += send_counts[j];
    recv_counts[j] = recv_rows[j] * cols, recv_displs[j] = r, r += recv_counts[j];
  }
  FORGE_CHECK(s <= send.numel() && r <= recv.numel(),
              "expert all-to-all: {} / {} elements in buffers of {} / {}", s, r, send.numel(), recv.numel());
  comm::Request request = group->all_to_allv(send.numel() > 0 ? send.raw() : nullptr, send_counts,
                                             send_displs, recv.numel() > 0 ? recv.raw() : nullptr,
                                             recv_counts, recv_displs, comm::type_of(send.dtype()));
  return std::make_unique<CommTransfer>(group, std::move(request), on_device);
}

}  // namespace forge::parallel
