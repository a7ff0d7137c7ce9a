// Pipeline schedules as data: the generators' lists replayed under unit costs against the published bubble
// and memory oracles (REFERENCE: DualPipe README, Zero Bubble paper), every list proven free of deadlock
// and complete, and the replay's own checks shown to catch broken lists.
#include "forge/parallel/pipeline/schedule.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "forge/core/error.h"
#include "forge/parallel/pipeline/replay.h"

namespace forge::pipeline::schedule_test {
namespace {

Schedule make(const std::string& name, int ranks, int micro_batches, int vpp = 1) {
  return make_schedule({schedule_kind(name), ranks, micro_batches, vpp});
}

std::string error_of(const ScheduleRequest& q) {
  try {
    make_schedule(q);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string replay_error(const Schedule& s) {
  try {
    replay(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// F = I = W = 1, B = 2; the overlapped pair costs `pair`.
Costs unit_costs(double pair = -1) {
  Costs c;
  c.uniform.forward_backward = pair;
  return c;
}

TEST(PipelineSchedule, OneFOneBIdlesPMinusOneTimesFPlusBOnEveryRank) {
  const Replay r = replay(make("1f1b", 8, 16), unit_costs());
  EXPECT_DOUBLE_EQ(r.makespan, 16 * 3 + 21);
  for (int rank = 0; rank < 8; ++rank) EXPECT_DOUBLE_EQ(r.idle(rank), 21) << "rank " << rank;
  EXPECT_EQ(r.ranks[0].peak_activations, 8);  // rank r holds P - r micro-batches
  EXPECT_EQ(r.ranks[7].peak_activations, 1);
}

TEST(PipelineSchedule, ZbH1IdlesPMinusOneTimesFPlusBMinusTwoWAtOneFOneBMemory) {
  const Schedule s = make("zb-h1", 8, 16);
  const Replay r = replay(s, unit_costs());
  for (int rank = 0; rank < 8; ++rank) EXPECT_DOUBLE_EQ(r.idle(rank), 7) << "rank " << rank;
  EXPECT_LE(r.max_peak_activations(), 8);  // 1F1B's peak
  for (const auto& list : s.actions)
    EXPECT_TRUE(
        std::any_of(list.begin(), list.end(), [](const Action& a) { return a.op == Op::backward_weight; }));
}

TEST(PipelineSchedule, InterleavedDividesTheBubbleByTheChunksPerRank) {
  for (int vpp : {2, 4}) {
    const Replay r = replay(make("interleaved", 4, 8, vpp), unit_costs());
    // Unit costs per chunk: a chunk is 1/vpp of a 1F1B stage, so (P-1)(F+B) chunk units is 1/vpp of 1F1B.
    for (int rank = 0; rank < 4; ++rank)
      EXPECT_DOUBLE_EQ(r.idle(rank), 3 * 3) << "vpp " << vpp << " rank " << rank;
  }
}

TEST(PipelineSchedule, ZbvIdlesAtMostPMinusOneTimesFPlusBMinusTwoWInChunkUnits) {
  for (int ranks : {1, 2, 4, 7, 8}) {
    for (int m : {2 * ranks, 2 * ranks + 1, 3 * ranks, 4 * ranks + 3}) {
      const Replay r = replay(make("zbv", ranks, m), unit_costs());
      EXPECT_LE(r.max_idle(), (ranks - 1) * (1 + 2 - 2) + 1e-9) << "P " << ranks << " m " << m;
      // Chunks are half stages: 1F1B's P stages, and one chunk more at the turn of the V.
      EXPECT_LE(r.max_peak_activations(), 2 * ranks + 1) << "P " << ranks << " m " << m;
    }
  }
}

// DualPipe README: bubble (S/2 - 1)(F&B + B - 3W), peak activations S + 1 chunks, S the stage count.
void expect_dualpipe_oracles(const std::string& name, int ranks, int m) {
  const Schedule s = make(name, ranks, m);
  const int stages = s.placement.stages;
  for (double pair : {3.0, 2.5}) {
    const Replay r = replay(s, unit_costs(pair));
    EXPECT_LE(r.max_idle(), (stages / 2 - 1) * (pair + 2 - 3) + 1e-9)
        << name << " P " << ranks << " m " << m << " F&B " << pair;
    EXPECT_LE(r.max_peak_activations(), stages + 1) << name << " P " << ranks << " m " << m;
  }
}

TEST(PipelineSchedule, DualPipeMeetsItsBubbleAndMemoryBounds) {
  for (int ranks : {2, 4, 6, 8})
    for (int m : {2 * ranks, 2 * ranks + 2, 4 * ranks}) expect_dualpipe_oracles("dualpipe", ranks, m);
}

TEST(PipelineSchedule, DualPipeVMeetsItsBubbleAndMemoryBounds) {
  for (int ranks : {1, 2, 3, 4, 8})
    for (int m : {2 * ranks, 2 * ranks + 1, 4 * ranks}) expect_dualpipe_oracles("dualpipev", ranks, m);
}

TEST(PipelineSchedule, DualPipeOverlapsForwardAndBackwardInPairs) {
  const Schedule s = make("dualpipe", 4, 8);
  for (const auto& list : s.actions)
    EXPECT_TRUE(
        std::any_of(list.begin(), list.end(), [](const Action& a) { return a.op == Op::forward_backward; }));
  // Without a real overlap DualPipeV has twice ZB-V's bubble (REFERENCE): both in chunk units, F&B = F + B.
  const Replay v = replay(make("dualpipev", 4, 16), unit_costs(3));
  const Replay zbv = replay(make("zbv", 4, 16), unit_costs());
  EXPECT_GT(v.max_idle(), zbv.max_idle());
}

TEST(PipelineSchedule, EveryGeneratedListIsCompleteAndFreeOfDeadlock) {
  int checked = 0;
  for (ScheduleKind kind : schedule_kinds()) {
    const std::string name = schedule_name(kind);
    for (int ranks = 1; ranks <= 8; ++ranks) {
      for (int m = 1; m <= 4 * ranks + 3; ++m) {
        for (int vpp : name == "interleaved" ? std::vector<int>{2, 3, 5} : std::vector<int>{1})
          for (bool pairs :
               name == "interleaved" ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
            const ScheduleRequest q{kind, ranks, m, vpp, pairs};
            if (!schedule_refusal(q).empty()) continue;
            Schedule s;
            ASSERT_NO_THROW(s = make_schedule(q)) << name << " P " << ranks << " m " << m << " vpp " << vpp;
            ASSERT_NO_THROW(replay(s)) << name << " P " << ranks << " m " << m << " vpp " << vpp;
            // Each chunk's forward count equals its backward count (the replay checks each one ran once).
            for (int r = 0; r < ranks; ++r) {
              for (int c = 0; c < s.placement.chunks; ++c) {
                int f = 0, b = 0;
                for (const Action& a : s.actions[r]) {
                  f += (a.op == Op::forward || a.op == Op::forward_backward) && a.chunk == c;
                  b += (a.op == Op::backward || a.op == Op::backward_input) && a.chunk == c;
                  b += a.op == Op::forward_backward && a.chunk_b == c;
                }
                EXPECT_EQ(f, b) << name << " P " << ranks << " m " << m << " rank " << r << " chunk " << c;
                EXPECT_EQ(f, static_cast<int>(s.placement.micro_batches_of(r, c).size()));
              }
            }
            ++checked;
          }
      }
    }
  }
  EXPECT_GT(checked, 400);
}

// Expert parallelism's overlap under the interleaved schedule (Megatron's combined 1F1B): the steady state's
// forwards and backwards as overlapped pairs. A pair takes both inputs before it starts; the pairing keeps
// only pairs that never lengthen the step when they hide nothing (F&B = F + B), so with any real overlap
// (F&B = 2.5 < 3) the step is no longer, and shorter as soon as there are steady-state pairs to make; the
// activations held are those of the unpaired list, and no pair holds a backward that needs its own forward.
TEST(PipelineSchedule, InterleavedPairsNeverLengthenTheStep) {
  for (int ranks : {2, 3, 4, 8})
    for (int vpp : {2, 3})
      for (int m : {ranks, 2 * ranks, 4 * ranks}) {
        SCOPED_TRACE(fmt::format("P {} vpp {} m {}", ranks, vpp, m));
        const Schedule plain = make("interleaved", ranks, m, vpp);
        const Schedule paired = make_schedule({ScheduleKind::interleaved, ranks, m, vpp, true});
        const Replay a = replay(plain, unit_costs()), b = replay(paired, unit_costs());
        EXPECT_LE(b.makespan, a.makespan);
        EXPECT_EQ(b.max_peak_activations(), a.max_peak_activations());
        const Replay gain_a = replay(plain, unit_costs(2.5)), gain_b = replay(paired, unit_costs(2.5));
        EXPECT_LE(gain_b.makespan, gain_a.makespan);
        int pairs = 0;
        for (const auto& list : paired.actions)
          for (const Action& a : list)
            if (a.op == Op::forward_backward) {
              ++pairs;
              EXPECT_FALSE(a.chunk == a.chunk_b && a.micro_batch == a.micro_batch_b) << to_string(a, true);
            }
        if (m >= 2 * ranks) {
          EXPECT_GT(pairs, 0);
          EXPECT_LT(gain_b.makespan, gain_a.makespan);
          for (const auto& list : paired.actions)
            EXPECT_TRUE(std::any_of(list.begin(), list.end(),
                                    [](const Action& a) { return a.op == Op::forward_backward; }));
        }
      }
  // The other schedules ignore the request: DualPipe's have pairs of their own, 1F1B's would serialise.
  EXPECT_EQ(make_schedule({ScheduleKind::one_f_one_b, 4, 8, 1, true}).actions, make("1f1b", 4, 8).actions);
}

TEST(PipelineSchedule, EveryMicroBatchPassesEveryStageInOrder) {
  const Schedule s = make("dualpipe", 4, 8);
  for (int m = 0; m < 8; ++m) {
    const Slot first = s.placement.locate(m, 0), last = s.placement.locate(m, 3);
    EXPECT_EQ(first.rank, m < 4 ? 0 : 3);  // the two directions enter at either end
    EXPECT_EQ(last.rank, m < 4 ? 3 : 0);
  }
  const Schedule v = make("dualpipev", 3, 6);
  EXPECT_EQ(v.placement.locate(0, 2), (Slot{2, 0}));
  EXPECT_EQ(v.placement.locate(0, 3), (Slot{2, 1}));  // the bottom of the V stays on the last rank
  EXPECT_EQ(v.placement.locate(0, 5), (Slot{0, 1}));
}

TEST(PipelineSchedule, CommunicationPairsUpBetweenRanks) {
  const Schedule s = make("1f1b", 2, 3);
  // Rank 0 posts each gradient's receive one action ahead of the backward that needs it.
  EXPECT_EQ(format_schedule(s, true),
            "rank 0: F0 sendA0>1 recvG0<1 F1 sendA1>1 B0 recvG1<1 F2 sendA2>1 recvG2<1 B1 B2\n"
            "rank 1: recvA0<0 F0 recvA1<0 B0 sendG0>0 F1 recvA2<0 B1 sendG1>0 F2 B2 sendG2>0\n");
  // The bottom of the V (stages 1 and 2 on rank 1) hands over without a message.
  const Schedule v = make("zbv", 2, 4);
  for (const Action& a : v.actions[1]) EXPECT_FALSE(is_send(a.op) && a.peer == 1);
  int sends = 0;
  for (const Action& a : v.actions[1]) sends += is_send(a.op);
  EXPECT_EQ(sends, 2 * 4);  // per micro-batch: stage 2's activation and stage 1's gradient, both to rank 0
}

TEST(PipelineSchedule, BadRequestsAreOneLineNamingTheSetting) {
  const auto expect_error = [](const ScheduleRequest& q, const std::string& part) {
    const std::string e = error_of(q);
    EXPECT_NE(e.find(part), std::string::npos) << "got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  expect_error({ScheduleKind::dualpipe, 3, 12}, "needs an even pp (got 3)");
  expect_error({ScheduleKind::dualpipe, 4, 6}, "at least 2 * pp = 8 (got 6)");
  expect_error({ScheduleKind::dualpipe, 4, 9}, "even number of micro-batches");
  expect_error({ScheduleKind::dualpipev, 4, 7}, "at least 2 * pp = 8 micro-batches per step (got 7)");
  expect_error({ScheduleKind::interleaved, 4, 6, 2}, "divisible by pp = 4 (got 6)");
  expect_error({ScheduleKind::interleaved, 4, 8, 1}, "vpp >= 2");
  expect_error({ScheduleKind::one_f_one_b, 4, 8, 2}, "vpp = 2 is only for schedule interleaved");
  expect_error({ScheduleKind::zbv, 4, 7}, "at least 2 * pp = 8 micro-batches per step (got 7)");
  std::string unknown;
  try {
    (void)schedule_kind("gpipe");
  } catch (const Error& e) {
    unknown = e.what();
  }
  EXPECT_NE(unknown.find("unknown pipeline schedule 'gpipe' (known: 1f1b, interleaved, zb-h1, zbv"),
            std::string::npos)
      << unknown;
  expect_error({ScheduleKind::one_f_one_b, 0, 8}, "pp must be >= 1 (got 0)");
  expect_error({ScheduleKind::one_f_one_b, 2, 0}, "micro-batches per step must be >= 1 (got 0)");
}

// The replay's own checks, on hand-broken lists.
TEST(PipelineReplay, ReportsADeadlockNamingEveryStuckRank) {
  Schedule s = make("1f1b", 2, 1);
  ASSERT_EQ(format_schedule(s, true), "rank 0: recvG0<1 F0 sendA0>1 B0\nrank 1: recvA0<0 F0 B0 sendG0>0\n");
  // Rank 0 waits for the gradient of micro-batch 0 before it sends the activation rank 1 needs for it.
  std::swap(s.actions[0][2], s.actions[0][3]);
  const std::string e = replay_error(s);
  EXPECT_NE(
      e.find("schedule 1f1b deadlocks: rank 0 at action 2 (B0) waits for the gradient of micro-batch 0 "
             "from rank 1; rank 1 at action 1 (F0) waits for the activation of micro-batch 0 from rank 0"),
      std::string::npos)
      << e;
}

TEST(PipelineReplay, CatchesMessagesOutOfOrderBetweenTwoRanks) {
  Schedule s = make("1f1b", 2, 2);
  // Rank 1 posts the receive for micro-batch 1 first; rank 0 sends micro-batch 0 first.
  s.actions[1] = {{Op::recv_activation, 0, 1, -1, -1, 0},
                  {Op::recv_activation, 0, 0, -1, -1, 0},
                  {Op::forward, 0, 0},
                  {Op::backward, 0, 0},
                  {Op::send_gradient, 0, 0, -1, -1, 0},
                  {Op::forward, 0, 1},
                  {Op::backward, 0, 1},
                  {Op::send_gradient, 0, 1, -1, -1, 0}};
  const std::string e = replay_error(s);
  EXPECT_NE(
      e.find("expects micro-batch 0 of stage 0, but rank 0 sent micro-batch 1 of stage 0 in that place"),
      std::string::npos)
      << e;
}

TEST(PipelineReplay, CatchesMissingAndRepeatedWork) {
  Schedule s = make("zb-h1", 2, 2);
  auto w = std::find_if(s.actions[0].begin(), s.actions[0].end(),
                        [](const Action& a) { return a.op == Op::backward_weight; });
  ASSERT_NE(w, s.actions[0].end());
  const Action weight = *w;
  s.actions[0].erase(w);
  EXPECT_NE(replay_error(s).find("never runs the W of micro-batch"), std::string::npos) << replay_error(s);
  s.actions[0].push_back(weight);
  s.actions[0].push_back(weight);
  EXPECT_NE(replay_error(s).find("twice"), std::string::npos) << replay_error(s);

  Schedule b = make("1f1b", 1, 2);
  b.actions[0] = {{Op::backward, 0, 0}, {Op::forward, 0, 0}};
  EXPECT_NE(replay_error(b).find("runs a backward before its forward"), std::string::npos) << replay_error(b);
  b.actions[0] = {{Op::forward, 0, 0}, {Op::backward, 0, 0}};
  EXPECT_NE(replay_error(b).find("never runs the forward of micro-batch 1"), std::string::npos)
      << replay_error(b);
}

TEST(PipelineReplay, CommunicationCostsDelayTheConsumer) {
  Costs c;
  c.latency = 0.5;
  c.send = 0.25;
  const Replay r = replay(make("1f1b", 2, 1), c);
  // F0 on rank 0 [0, 1], send [1, 1.25], arrives 1.75; rank 1 F0 [1.75, 2.75], B0 [2.75, 4.75], send to
  // 5.0, arrives 5.5; rank 0 B0 [5.5, 7.5].
  EXPECT_DOUBLE_EQ(r.makespan, 7.5);
  EXPECT_DOUBLE_EQ(r.ranks[0].busy, 1 + 0.25 + 2);
}

TEST(PipelineReplay, PerStageCostsSlowTheirStageOnly) {
  Costs c;
  c.per_stage.resize(2);
  c.per_stage[1].forward = 3;  // say, the loss head
  const Replay r = replay(make("1f1b", 2, 1), c);
  EXPECT_DOUBLE_EQ(r.makespan, 1 + 3 + 2 + 2);
}

// An overlapped F&B pair hides each half's transfers under the other's compute, all but the host's share of
// them, and lasts at least as long as the transfers; DualPipe's pairs get shorter by that much in the replay.
TEST(PipelineReplay, OverlappedPairsHideTheirTransfers) {
  // F 10 (4 of it transfers), B 20 (6): 20 of compute hides all 10 of transfers; half of them stay with a
  // host share of 0.5; all of them with 1.
  EXPECT_DOUBLE_EQ(overlapped_pair(10, 20, 4, 6, 0), 20);
  EXPECT_DOUBLE_EQ(overlapped_pair(10, 20, 4, 6, 0.5), 25);
  EXPECT_DOUBLE_EQ(overlapped_pair(10, 20, 4, 6, 1), 30);
  // Transfers longer than the compute: the pair lasts as long as they do.
  EXPECT_DOUBLE_EQ(overlapped_pair(5, 5, 4, 4, 0), 8);
  Costs plain;
  plain.uniform.forward_comm = 0.5, plain.uniform.backward_comm = 1;
  Costs paired = plain;
  paired.pair_host_share = 0;
  const Schedule s = make("dualpipe", 4, 8);
  const double serial = replay(s, plain).makespan, overlapped = replay(s, paired).makespan;
  EXPECT_LT(overlapped, serial);
  paired.pair_host_share = 1;  // nothing hidden
  EXPECT_DOUBLE_EQ(replay(s, paired).makespan, serial);
}

}  // namespace
}  // namespace forge::pipeline::schedule_test
