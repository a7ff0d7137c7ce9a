#include "forge/core/fibers.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "forge/core/error.h"

namespace forge::fibers_test {
namespace {

TEST(Fibers, TakeTurnsAtEveryYield) {
  std::vector<std::string> trace;
  const int64_t switches = fiber_switches();
  run_interleaved(
      [&] {
        trace.push_back("a0");
        EXPECT_TRUE(has_partner());
        yield_to_partner();
        trace.push_back("a1");
        yield_to_partner();
        trace.push_back("a2");
      },
      [&] {
        trace.push_back("b0");
        yield_to_partner();
        trace.push_back("b1");
        yield_to_partner();  // a ends during this turn: b runs on
        trace.push_back("b2");
        EXPECT_FALSE(has_partner());
        yield_to_partner();  // nothing to switch to
        trace.push_back("b3");
      });
  EXPECT_EQ(trace, (std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "b2", "b3"}));
  EXPECT_EQ(fiber_switches() - switches, 4);  // the last yield had no partner
  EXPECT_FALSE(has_partner());
}

TEST(Fibers, YieldOutsideAPairDoesNothing) {
  EXPECT_FALSE(has_partner());
  yield_to_partner();
  int calls = 0;
  run_interleaved([&] { ++calls; }, [&] { ++calls; });
  EXPECT_EQ(calls, 2);
}

TEST(Fibers, DeepStacksAndManyPairs) {
  // Each fiber has its own stack: locals survive the other's turns; a few hundred KiB of stack is fine.
  for (int pair = 0; pair < 100; ++pair) {
    long a_sum = 0, b_sum = 0;
    run_interleaved(
        [&] {
          std::vector<char> heap(1 << 16);
          volatile char stack[256 << 10];
          for (int i = 0; i < 10; ++i) {
            stack[i * 1000] = static_cast<char>(i);
            yield_to_partner();
            a_sum += stack[i * 1000];
          }
        },
        [&] {
          volatile char stack[128 << 10];
          for (int i = 0; i < 10; ++i) {
            stack[i * 500] = static_cast<char>(2 * i);
            yield_to_partner();
            b_sum += stack[i * 500];
          }
        });
    ASSERT_EQ(a_sum, 45);
    ASSERT_EQ(b_sum, 90);
  }
}

TEST(Fibers, AnExceptionEndsThePairAndReachesTheCaller) {
  bool b_ran = false;
  EXPECT_THROW(run_interleaved(
                   [&] {
                     yield_to_partner();
                     throw std::runtime_error("first failed");
                   },
                   [&] {
                     b_ran = true;
                     yield_to_partner();
                     yield_to_partner();
                     ADD_FAILURE() << "the pair should have ended at the exception";
                   }),
               std::runtime_error);
  EXPECT_TRUE(b_ran);
  EXPECT_FALSE(has_partner());
  int calls = 0;  // usable again afterwards
  run_interleaved([&] { ++calls; }, [&] { ++calls; });
  EXPECT_EQ(calls, 2);
}

TEST(Fibers, NotReentrant) {
  std::string message;
  run_interleaved(
      [&] {
        try {
          run_interleaved([] {}, [] {});
        } catch (const Error& e) {
          message = e.what();
        }
      },
      [] {});
  EXPECT_NE(message.find("inside an interleaved fiber"), std::string::npos) << message;
}

}  // namespace
}  // namespace forge::fibers_test
