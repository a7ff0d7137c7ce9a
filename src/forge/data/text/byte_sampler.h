// Batches of next-token training windows from a token array: byte-level tokens (token = byte value,
// vocabulary 256) or the int32 ids of a tokenized corpus.
//
// Training samples are random windows whose offset depends only on (seed, global sample index), so the
// data order is the same however samples are split into micro-batches, ranks or resumed runs.
// Evaluation uses consecutive non-overlapping windows, which cover the held-out text deterministically.
#pragma once

#include <cstdint>

namespace forge::data {

inline constexpr int64_t kByteVocabSize = 256;

// The splitmix64 finaliser: a bijective 64-bit mix with full avalanche.
uint64_t splitmix64(uint64_t x);

// Offset of training sample `sample_index`, uniform over [0, n - seq_len - 1]: element `sample_index` of
// the splitmix64 stream seeded by splitmix64(seed), mapped to the range by a 64x64->128-bit multiply
// (bias below range / 2^64, negligible). Requires n >= seq_len + 1.
int64_t sample_offset(uint64_t seed, int64_t sample_index, int64_t n, int64_t seq_len);

// Fills input_ids and targets, each [batch, seq_len] row-major: for sample b with global index
// first_sample_index + b and offset o, input = tokens[o, o + seq_len), targets = tokens[o + 1, o + seq_len].
// Throws forge::Error if the token array is shorter than seq_len + 1 or a size is not positive.
void sample_batch(const uint8_t* tokens, int64_t n, uint64_t seed, int64_t first_sample_index, int64_t batch,
                  int64_t seq_len, int32_t* input_ids, int32_t* targets);
void sample_batch(const int32_t* tokens, int64_t n, uint64_t seed, int64_t first_sample_index, int64_t batch,
                  int64_t seq_len, int32_t* input_ids, int32_t* targets);

// Number of windows sequential_batch can produce without wrapping: floor((n - 1) / seq_len).
int64_t num_sequential_windows(int64_t n, int64_t seq_len);

// Window k covers input tokens[k * seq_len, (k + 1) * seq_len) and the targets shifted by one. Batch row b
// is window (first_window + b) mod num_sequential_windows, so a caller asking for more windows than the
// text holds sees the text again rather than an error; callers that want each window once use
// num_sequential_windows to bound the count. Throws if the text is shorter than seq_len + 1.
void sequential_batch(const uint8_t* tokens, int64_t n, int64_t first_window, int64_t batch, int64_t seq_len,
                      int32_t* input_ids, int32_t* targets);
void sequential_batch(const int32_t* tokens, int64_t n, int64_t first_window, int64_t batch, int64_t seq_len,
                      int32_t* input_ids, int32_t* targets);

}  // namespace forge::data
