// 1F1B and interleaved 1F1B (Megatron-LM's schedules), as action lists.
#include <algorithm>

#include "forge/parallel/pipeline/generators.h"

namespace forge::pipeline {

Schedule generate_1f1b(int ranks, int micro_batches) {
  Schedule s;
  s.placement = {ranks, 1, ranks, micro_batches, false, {}};
  for (int r = 0; r < ranks; ++r) s.placement.stage_of.push_back(r);
  s.actions.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    std::vector<Action>& list = s.actions[r];
    const int warmup = std::min(ranks - 1 - r, micro_batches);
    for (int m = 0; m < warmup; ++m) list.push_back({Op::forward, 0, m});
    for (int i = 0; i < micro_batches - warmup; ++i) {
      list.push_back({Op::forward, 0, warmup + i});
      list.push_back({Op::backward, 0, i});
    }
    for (int m = micro_batches - warmup; m < micro_batches; ++m) list.push_back({Op::backward, 0, m});
  }
  return s;
}

Schedule generate_interleaved(int ranks, int vpp, int micro_batches) {
  Schedule s;
  s.placement = {ranks, vpp, ranks * vpp, micro_batches, false, {}};
  for (int r = 0; r < ranks; ++r)
    for (int c = 0; c < vpp; ++c) s.placement.stage_of.push_back(c * ranks + r);
  s.actions.resize(ranks);
  // The k-th forward of every rank runs chunk (k / P) % vpp on micro-batch (k / (P vpp)) P + k % P: groups of
  // P micro-batches go through each chunk in turn. Backwards visit the chunks in reverse.
  const int total = micro_batches * vpp;
  auto micro_batch_of = [&](int k) { return (k / (ranks * vpp)) * ranks + k % ranks; };
  auto forward = [&](int k) { return Action{Op::forward, (k / ranks) % vpp, micro_batch_of(k)}; };
  auto backward = [&](int k) { return Action{Op::backward, vpp - 1 - (k / ranks) % vpp, micro_batch_of(k)}; };
  for (int r = 0; r < ranks; ++r) {
    std::vector<Action>& list = s.actions[r];
    const int warmup = std::min((ranks - r - 1) * 2 + (vpp - 1) * ranks, total);
    for (int k = 0; k < warmup; ++k) list.push_back(forward(k));
    for (int i = 0; i < total - warmup; ++i) {
      list.push_back(forward(warmup + i));
      list.push_back(backward(i));
    }
    for (int k = total - warmup; k < total; ++k) list.push_back(backward(k));
  }
  return s;
}

}  // namespace forge::pipeline
