// 128-bit integers, for exact products of two 64-bit values: GCC's and Clang's extension, named once here
// under __extension__ so that -Wpedantic builds accept every use.
#pragma once

namespace forge {

__extension__ typedef __int128 int128;
__extension__ typedef unsigned __int128 uint128;

}  // namespace forge
