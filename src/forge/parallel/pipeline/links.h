// Where the pipeline executor's messages travel: for each kind of message (activations, gradients) and each
// pair of pipeline ranks, a communicator and the peer's rank in it.
//
// The replay (replay.h) proves a schedule free of deadlock for messages matched first in, first out per
// (sender, receiver, kind), with sends and receives that never wait for one another otherwise. MPI gives
// exactly that on one communicator, the kind as the tag. NCCL does not: a communicator runs its operations
// one after another on its stream, so a receive posted early (the executor posts them one compute action
// ahead) holds up every later send on the same communicator, and two ranks that each wait for the other's
// later send deadlock although the replay passed. On device memory every (kind, sender, receiver) the
// schedule uses therefore gets its own two-rank communicator: each then carries one FIFO of messages in one
// direction, the channel the replay's proof is about, and stream order on it is the FIFO order.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::pipeline {

enum class Message : int { activation = 0, gradient = 1 };
const char* message_name(Message kind);

struct Link {
  comm::Communicator* comm = nullptr;
  int peer = -1;  // the other rank's rank in comm
  int tag = 0;
};

class Links {
 public:
  // Host memory: every message over pp (its rank i is pipeline rank i), the kind as the tag.
  explicit Links(comm::Communicator& pp);
  // Device memory: a communicator for each (kind, sender, receiver) that the schedule's lists send on, made
  // by make(bootstrap, name) from a two-rank split of the host communicator pp. Collective over pp.
  using Factory = std::function<std::unique_ptr<comm::Communicator>(comm::Communicator& bootstrap,
                                                                    const std::string& name)>;
  Links(const Schedule& schedule, comm::Communicator& pp, const Factory& make);
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;
  ~Links();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // This rank sends a message of `kind` to pipeline rank `to`, or receives one from `from`. Fails with one
  // line when the pair has no channel (a device link the schedule never uses).
  Link to(Message kind, int to) const { return find(kind, rank_, to); }
  Link from(Message kind, int from) const { return find(kind, from, rank_); }
  // The number of communicators behind the links (1 on host memory).
  int communicators() const { return host_ ? 1 : static_cast<int>(channels_.size()); }

 private:
  Link find(Message kind, int sender, int receiver) const;

  comm::Communicator* host_ = nullptr;  // host memory: the one communicator
  int rank_ = 0, size_ = 1;
  // Device memory: (kind, sender, receiver) -> its communicator, where this rank is the sender or receiver.
  std::map<std::tuple<int, int, int>, std::unique_ptr<comm::Communicator>> channels_;
};

}  // namespace forge::pipeline
