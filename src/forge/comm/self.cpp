// The one-rank backend: no MPI call at all. Every collective over one rank is a copy (or nothing, in place),
// completes at once and returns a completed Request; a point-to-point message has no peer and is an error.
#include <cstring>

#include "forge/comm/comm.h"
#include "forge/comm/comm_internal.h"
#include "forge/core/error.h"

namespace forge::comm {
namespace {

// memmove: a one-rank all_gather may run in place (send is recv's only block).
void copy(void* dst, const void* src, int64_t count, Type type) {
  if (count > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(count) * type_size(type));
}

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) { name_ = std::move(name); }

  const char* backend() const override { return "self"; }

  Request all_reduce(void* buf, int64_t count, Type type, ReduceOp op) override {
    detail::check_count(*this, "all_reduce", count);
    detail::check_buffer(*this, "all_reduce", buf, count, "buffer");
    return {};
  }

  Request all_gather(const void* send, void* recv, int64_t count, Type type) override {
    check_copy("all_gather", send, recv, count);
    copy(recv, send, count, type);
    return {};
  }

  Request all_gatherv(const void* send, void* recv, std::span<const int64_t> counts, Type type) override {
    detail::check_per_rank(*this, "all_gatherv", counts, "counts");
    check_copy("all_gatherv", send, recv, counts[0]);
    copy(recv, send, counts[0], type);
    return {};
  }

  Request reduce_scatter(const void* send, void* recv, int64_t count, Type type, ReduceOp op) override {
    check_copy("reduce_scatter", send, recv, count);
    copy(recv, send, count, type);
    return {};
  }

  Request all_to_all(const void* send, void* recv, int64_t count, Type type) override {
    check_copy("all_to_all", send, recv, count);
    copy(recv, send, count, type);
    return {};
  }

  Request all_to_allv(const void* send, std::span<const int64_t> send_counts,
                      std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                      std::span<const int64_t> recv_displs, Type type) override {
    detail::check_per_rank(*this, "all_to_allv", send_counts, "send_counts");
    detail::check_per_rank(*this, "all_to_allv", send_displs, "send_displs");
    detail::check_per_rank(*this, "all_to_allv", recv_counts, "recv_counts");
    detail::check_per_rank(*this, "all_to_allv", recv_displs, "recv_displs");
    if (send_counts[0] != recv_counts[0])
      fail("comm: all_to_allv on {}: this rank sends itself {} elements but expects {}",
           detail::group_label(*this), send_counts[0], recv_counts[0]);
    check_copy("all_to_allv", send, recv, send_counts[0]);
    const size_t element = type_size(type);
    copy(static_cast<char*>(recv) + recv_displs[0] * element,
         static_cast<const char*>(send) + send_displs[0] * element, send_counts[0], type);
    return {};
  }

  Request send(const void* buf, int64_t count, Type type, int peer, int tag) override {
    no_peer("send", peer);
  }
  Request recv(void* buf, int64_t count, Type type, int peer, int tag) override { no_peer("recv", peer); }

  Request broadcast(void* buf, int64_t count, Type type, int root) override {
    detail::check_rank(*this, "broadcast", root, "root");
    detail::check_count(*this, "broadcast", count);
    detail::check_buffer(*this, "broadcast", buf, count, "buffer");
    return {};
  }

  Request barrier() override { return {}; }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    if (color < 0) return nullptr;
    auto child = std::make_unique<SelfCommunicator>(std::move(name));
    child->set_timeout_seconds(timeout_seconds());
    return child;
  }

  [[noreturn]] void abort(const std::string& message) override { detail::abort_job(message); }

 private:
  void check_copy(const char* op, const void* send, const void* recv, int64_t count) const {
    detail::check_count(*this, op, count);
    detail::check_buffer(*this, op, send, count, "send");
    detail::check_buffer(*this, op, recv, count, "recv");
  }

  [[noreturn]] void no_peer(const char* op, int peer) const {
    fail("comm: {} with peer {} on {}: the self backend has one rank and no peer to exchange messages with",
         op, peer, detail::group_label(*this));
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self(std::string name) {
  return std::make_unique<SelfCommunicator>(std::move(name));
}

}  // namespace forge::comm
