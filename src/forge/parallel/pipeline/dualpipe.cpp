// DualPipe and DualPipeV (DeepSeek-V3 technical report; deepseek-ai/DualPipe), as action lists.
//
// DualPipe feeds half of the micro-batches in at rank 0 and half at rank P-1, so every rank holds two
// chunks: stage r of the first direction and a mirrored copy of stage P-1-r for the second. DualPipeV is
// DualPipe cut in half: one direction over the V placement (stage r and stage 2P-1-r on rank r). Both run
// the same eight phases per rank; a rank's "phase 0" is the chunk whose micro-batches reach it first. The
// middle of the step overlaps the forward of one chunk with the backward of the other (F&B pairs), and the
// weight gradients of the first and last phases are deferred (zero bubble) into the gaps.
#include <deque>

#include "forge/core/error.h"
#include "forge/parallel/pipeline/generators.h"

namespace forge::pipeline {
namespace {

// One rank's program: F(phase), B(phase, deferring W), W(), FB(forward phase, backward phase).
class Program {
 public:
  Program(const Placement& p, int rank, std::vector<Action>& out, bool flip) : out_(out), flip_(flip) {
    for (int c = 0; c < 2; ++c) order_[c] = p.micro_batches_of(rank, c);
  }
  void F(int phase) { out_.push_back({Op::forward, chunk(phase), next_forward(phase)}); }
  void B(int phase, bool defer_w = false) {
    const int c = chunk(phase), m = next_backward(phase);
    if (defer_w) {
      out_.push_back({Op::backward_input, c, m});
      weights_.push_back({c, m});
    } else {
      out_.push_back({Op::backward, c, m});
    }
  }
  void W() {
    FORGE_CHECK(!weights_.empty(), "DualPipe program runs a W with none deferred");
    out_.push_back({Op::backward_weight, weights_.front().first, weights_.front().second});
    weights_.pop_front();
  }
  void FB(int forward_phase, int backward_phase) {
    const int cf = chunk(forward_phase), mf = next_forward(forward_phase);
    const int cb = chunk(backward_phase), mb = next_backward(backward_phase);
    out_.push_back({Op::forward_backward, cf, mf, cb, mb});
  }
  bool finished() const {
    return weights_.empty() && forward_[0] == order_[0].size() && forward_[1] == order_[1].size() &&
           backward_[0] == order_[0].size() && backward_[1] == order_[1].size();
  }

 private:
  int chunk(int phase) const { return flip_ ? 1 - phase : phase; }
  int next_forward(int phase) {
    const int c = chunk(phase);
    FORGE_CHECK(forward_[c] < order_[c].size(), "DualPipe program: chunk {} has no forward left", c);
    return order_[c][forward_[c]++];
  }
  int next_backward(int phase) {
    const int c = chunk(phase);
    FORGE_CHECK(backward_[c] < forward_[c], "DualPipe program: chunk {} backward before its forward", c);
    return order_[c][backward_[c]++];
  }
  std::vector<Action>& out_;
  bool flip_;
  std::vector<int> order_[2];
  size_t forward_[2] = {0, 0}, backward_[2] = {0, 0};
  std::deque<std::pair<int, int>> weights_;
};

}  // namespace

Schedule generate_dualpipe(int ranks, int micro_batches, bool v) {
  Schedule s;
  const int P = ranks;
  s.placement = {P, 2, v ? 2 * P : P, micro_batches, !v, {}};
  for (int r = 0; r < P; ++r) {
    s.placement.stage_of.push_back(r);
    s.placement.stage_of.push_back(v ? 2 * P - 1 - r : P - 1 - r);
  }
  s.actions.resize(P);
  // DualPipe runs the same program on the mirrored ranks r and P-1-r; DualPipeV has one direction over P
  // ranks that each hold both ends of the V.
  const int half_ranks = v ? P : P / 2;
  const int per_direction = v ? micro_batches : micro_batches / 2;
  for (int r = 0; r < P; ++r) {
    const int h = v ? r : std::min(r, P - 1 - r);
    const bool turn = v ? r == P - 1 : h == half_ranks - 1;  // where the two phases meet
    Program prog(s.placement, r, s.actions[r], !v && r >= P / 2);
    // 1: forwards of phase 0 fill the pipe.
    for (int i = 0; i < (half_ranks - h - 1) * 2; ++i) prog.F(0);
    // 2: forwards of both phases.
    for (int i = 0; i < h + 1; ++i) {
      prog.F(0);
      prog.F(1);
    }
    // 3: backward of phase 1 with its W right after, then its next forward.
    for (int i = 0; i < half_ranks - h - 1; ++i) {
      prog.B(1, true);
      prog.W();
      prog.F(1);
    }
    // 4: the steady state, forward of one phase overlapped with the backward of the other. At the turn the
    // first pair runs apart: its backward needs the forward it would overlap with.
    for (int i = 0; i < per_direction - 2 * half_ranks + h + 1; ++i) {
      if (i == 0 && turn) {
        prog.F(0);
        prog.B(1);
      } else {
        prog.FB(0, 1);
      }
      prog.FB(1, 0);
    }
    // 5: the last forwards of phase 1.
    for (int i = 0; i < half_ranks - h - 1; ++i) {
      prog.B(1);
      prog.FB(1, 0);
    }
    // 6: the remaining backwards of both phases; from the middle on they defer W.
    bool defer = false;
    for (int i = 0; i < h + 1; ++i) {
      if (i == (h + 1) / 2 && h % 2 == 1) defer = true;
      prog.B(1, defer);
      if (i == (h + 1) / 2 && h % 2 == 0) defer = true;
      prog.B(0, defer);
    }
    // 7: deferred W between the last backwards of phase 0.
    for (int i = 0; i < half_ranks - h - 1; ++i) {
      prog.W();
      prog.B(0, true);
    }
    // 8: the remaining W.
    for (int i = 0; i < h + 1; ++i) prog.W();
    FORGE_CHECK(prog.finished(), "DualPipe program of rank {} left work undone", r);
  }
  return s;
}

}  // namespace forge::pipeline
