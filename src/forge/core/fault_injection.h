// Test-only fault injection: named points in code whose failure must be survivable (the steps of a
// checkpoint save) where a test can kill the process, to prove that a crash at any of them loses nothing.
//
//   FORGE_TEST_KILL_AT=<point>[:<n>][@<rank>]   SIGKILL the process the n-th time (default 1st) it reaches
//                                               <point>, on world rank <rank> only (default: any rank)
//   FORGE_TEST_FAIL_AT=<point>[:<n>][@<rank>]   throw forge::Error there instead (as a full disk or an I/O
//                                               error would), to test that errors lose nothing either
//
// Unset (always, outside tests), kill_point costs one cached branch.
#pragma once

#include <string_view>

namespace forge {

// Kills this process with SIGKILL when FORGE_TEST_KILL_AT names `point` (see above). `rank`: this
// process's world rank.
void kill_point(std::string_view point, int rank = 0);
// Throws forge::Error "<point>: injected failure (FORGE_TEST_FAIL_AT)" when FORGE_TEST_FAIL_AT names it.
void fail_point(std::string_view point, int rank = 0);

}  // namespace forge
