#include "forge/data/text/byte_sampler.h"

#include "forge/core/error.h"
#include "forge/core/int128.h"

namespace forge::data {
namespace {

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;  // splitmix64's stream increment

void check_sizes(const char* who, int64_t n, int64_t batch, int64_t seq_len) {
  if (batch <= 0) fail("{}: batch must be positive, got {}", who, batch);
  if (seq_len <= 0) fail("{}: seq_len must be positive, got {}", who, seq_len);
  if (n < seq_len + 1)
    fail(
        "{}: the text has {} tokens, fewer than seq_len + 1 = {}; use a larger corpus or a shorter "
        "data.seq_len",
        who, n, seq_len + 1);
}

template <typename Token>
void copy_window(const Token* window, int64_t seq_len, int32_t* input_ids, int32_t* targets) {
  for (int64_t t = 0; t < seq_len; ++t) {
    input_ids[t] = window[t];
    targets[t] = window[t + 1];
  }
}

}  // namespace

uint64_t splitmix64(uint64_t x) {
  x += kGoldenGamma;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

int64_t sample_offset(uint64_t seed, int64_t sample_index, int64_t n, int64_t seq_len) {
  // The sample_index-th output of a splitmix64 stream whose state starts at splitmix64(seed): nearby seeds
  // give unrelated streams, and any index is reachable in O(1) without replaying the stream.
  const uint64_t state = splitmix64(seed) + static_cast<uint64_t>(sample_index) * kGoldenGamma;
  const uint64_t random = splitmix64(state);
  const auto range = static_cast<uint64_t>(n - seq_len);  // offsets 0 .. n - seq_len - 1
  return static_cast<int64_t>((static_cast<uint128>(random) * range) >> 64);
}

namespace {

template <typename Token>
void sample_batch_impl(const Token* tokens, int64_t n, uint64_t seed, int64_t first_sample_index,
                       int64_t batch, int64_t seq_len, int32_t* input_ids, int32_t* targets) {
  check_sizes("sample_batch", n, batch, seq_len);
  if (first_sample_index < 0)
    fail("sample_batch: first_sample_index must be >= 0, got {}", first_sample_index);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t offset = sample_offset(seed, first_sample_index + b, n, seq_len);
    copy_window(tokens + offset, seq_len, input_ids + b * seq_len, targets + b * seq_len);
  }
}

}  // namespace

int64_t num_sequential_windows(int64_t n, int64_t seq_len) {
  if (seq_len <= 0 || n < 1) return 0;
  return (n - 1) / seq_len;
}

namespace {

template <typename Token>
void sequential_batch_impl(const Token* tokens, int64_t n, int64_t first_window, int64_t batch,
                           int64_t seq_len, int32_t* input_ids, int32_t* targets) {
  check_sizes("sequential_batch", n, batch, seq_len);
  if (first_window < 0) fail("sequential_batch: first_window must be >= 0, got {}", first_window);
  const int64_t windows = num_sequential_windows(n, seq_len);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t window = (first_window + b) % windows;
    copy_window(tokens + window * seq_len, seq_len, input_ids + b * seq_len, targets + b * seq_len);
  }
}

}  // namespace

void sample_batch(const uint8_t* tokens, int64_t n, uint64_t seed, int64_t first_sample_index, int64_t batch,
                  int64_t seq_len, int32_t* input_ids, int32_t* targets) {
  sample_batch_impl(tokens, n, seed, first_sample_index, batch, seq_len, input_ids, targets);
}
void sample_batch(const int32_t* tokens, int64_t n, uint64_t seed, int64_t first_sample_index, int64_t batch,
                  int64_t seq_len, int32_t* input_ids, int32_t* targets) {
  sample_batch_impl(tokens, n, seed, first_sample_index, batch, seq_len, input_ids, targets);
}
void sequential_batch(const uint8_t* tokens, int64_t n, int64_t first_window, int64_t batch, int64_t seq_len,
                      int32_t* input_ids, int32_t* targets) {
  sequential_batch_impl(tokens, n, first_window, batch, seq_len, input_ids, targets);
}
void sequential_batch(const int32_t* tokens, int64_t n, int64_t first_window, int64_t batch, int64_t seq_len,
                      int32_t* input_ids, int32_t* targets) {
  sequential_batch_impl(tokens, n, first_window, batch, seq_len, input_ids, targets);
}

}  // namespace forge::data
