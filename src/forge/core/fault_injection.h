// Test-only fault injection: named points in code whose failure must be survivable (the steps of a
// checkpoint save) where a test can kill the process, to prove that a crash at any of them loses nothing.
//
//   FORGE_TEST_KILL_AT=<point>[:<n>][@<rank>]   SIGKILL the process the n-th time (default 1st) it reaches
//                                               <point>, on world rank <rank> only (default: any rank)
//   FORGE_TEST_FAIL_AT=<point>[:<n>][@<rank>]   throw forge::Error there instead (as a full disk or an I/O
//                                               error would), to test that errors lose nothing either
//
// Unset (always, outside tests), kill_point costs one cached branch; fail_point one atomic load more.
#pragma once

#include <string>
#include <string_view>

namespace forge {

// Kills this process with SIGKILL when FORGE_TEST_KILL_AT names `point` (see above). `rank`: this
// process's world rank.
void kill_point(std::string_view point, int rank = 0);
// Throws forge::Error "<point>: injected failure (FORGE_TEST_FAIL_AT)" when FORGE_TEST_FAIL_AT names it.
void fail_point(std::string_view point, int rank = 0);

// Arms `point` to throw forge::Error(message) the next time this process reaches it (once), whatever
// FORGE_TEST_FAIL_AT says: the trainer's fault injection (train/faults.h) uses it for a full disk during a
// save. Thread-safe (a background checkpoint write reaches its points on another thread).
void arm_fail_point(std::string_view point, std::string message);

}  // namespace forge
