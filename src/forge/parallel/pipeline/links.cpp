#include "forge/parallel/pipeline/links.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "forge/core/error.h"

namespace forge::pipeline {

const char* message_name(Message kind) { return kind == Message::activation ? "activation" : "gradient"; }

Links::Links(comm::Communicator& pp) : host_(&pp), rank_(pp.rank()), size_(pp.size()) {}

Links::Links(const Schedule& schedule, comm::Communicator& pp, const Factory& make)
    : rank_(pp.rank()), size_(pp.size()) {
  FORGE_CHECK(size_ == schedule.placement.ranks, "the pp communicator has {} ranks, schedule {} {}", size_,
              schedule.name, schedule.placement.ranks);
  // Every rank holds every rank's list, so all find the same channels, in the same order.
  std::set<std::tuple<int, int, int>> used;  // (kind, sender, receiver)
  for (int r = 0; r < static_cast<int>(schedule.actions.size()); ++r)
    for (const Action& a : schedule.actions[r]) {
      if (a.op == Op::send_activation) used.insert({static_cast<int>(Message::activation), r, a.peer});
      if (a.op == Op::send_gradient) used.insert({static_cast<int>(Message::gradient), r, a.peer});
    }
  std::set<std::pair<int, int>> pairs;
  for (const auto& [kind, sender, receiver] : used)
    pairs.insert({std::min(sender, receiver), std::max(sender, receiver)});
  // One host split per pair (collective over pp), then that pair's channels (collective over the pair): the
  // ranks take the pairs in one global order, so a rank in two pairs never waits on one that waits on it.
  for (const auto& [low, high] : pairs) {
    const bool mine = rank_ == low || rank_ == high;
    std::unique_ptr<comm::Communicator> pair =
        pp.split(mine ? 0 : -1, rank_, fmt::format("{}_{}_{}", pp.name(), low, high));
    if (!mine) continue;
    FORGE_CHECK(pair && pair->size() == 2, "pp pair {}-{}: the split has no two ranks", low, high);
    for (const auto& key : used) {
      const auto [kind, sender, receiver] = key;
      if (std::min(sender, receiver) != low || std::max(sender, receiver) != high) continue;
      channels_[key] = make(*pair, fmt::format("{}_{}_{}_{}", pp.name(),
                                               message_name(static_cast<Message>(kind)), sender, receiver));
    }
  }
}

Links::~Links() = default;

Link Links::find(Message kind, int sender, int receiver) const {
  const int other = sender == rank_ ? receiver : sender;
  if (host_) return {host_, other, static_cast<int>(kind)};
  auto it = channels_.find({static_cast<int>(kind), sender, receiver});
  FORGE_CHECK(it != channels_.end(), "pipeline rank {}: no {} channel from rank {} to rank {}", rank_,
              message_name(kind), sender, receiver);
  // The pair's split ranks its two members by pipeline rank.
  return {it->second.get(), other < rank_ ? 0 : 1, 0};
}

}  // namespace forge::pipeline
