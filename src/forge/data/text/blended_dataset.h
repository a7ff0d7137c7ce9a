// Blends of GPT datasets, as Megatron-LM's BlendedDataset, and the blend strings that name them.
//
// Weights are normalised to sum to 1. Global sample i goes to the dataset whose achieved count lags its
// target the most: argmax_k (w_k * (i + 1) - c_k), c_k = samples given to dataset k before i, ties to the
// lowest k; it is that dataset's sample c_k. The assignment is greedy and depends only on i and the weights
// (never on a total sample count). After n samples no dataset is ahead of its share by a whole sample
// (c_k < w_k * n + 1: the chosen dataset's lag is positive before it is served) and none falls far behind:
// with two or three datasets |c_k - w_k * n| < 1; with more, the lag can slightly exceed one sample
// (measured up to 1.3 with 16 datasets; Megatron's rule behaves the same). Counts
// are snapshotted every 4096 samples and replayed within a chunk, so any index is served in O(4096 * K)
// without a per-sample table, and reading forward costs O(K) per sample. (Megatron's helper uses
// max(i, 1) in place of i + 1, and numpy's shuffles in its datasets, so its order is not forge's bit for
// bit.)
//
// Blend strings follow Megatron's --data-path: "PREFIX" (one dataset) or "W1 PREFIX1 W2 PREFIX2 ..." with
// positive weights; whitespace-separated.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/data/text/gpt_dataset.h"

namespace forge::data {

struct BlendComponent {
  double weight = 1;  // normalised
  std::string prefix;
};

// Throws forge::Error naming the blend string and the offending word when it is malformed (an odd number
// of words, a weight that is not a positive number, an empty string).
std::vector<BlendComponent> parse_blend(std::string_view blend);

class BlendedDataset {
 public:
  // Every dataset must have the same seq_len; weights must be positive (they are normalised).
  // num_samples > 0 bounds the global sample index (0: unbounded).
  BlendedDataset(std::vector<std::shared_ptr<const GptDataset>> datasets, std::vector<double> weights,
                 int64_t num_samples = 0);

  int64_t seq_len() const { return seq_len_; }
  size_t num_datasets() const { return datasets_.size(); }
  const GptDataset& dataset(size_t k) const { return *datasets_[k]; }
  const std::vector<double>& weights() const { return weights_; }

  // {dataset k, sample index within dataset k} that global sample `index` reads.
  std::pair<size_t, int64_t> locate(int64_t index) const;
  // input_ids and targets: [T] each.
  void sample(int64_t index, int32_t* input_ids, int32_t* targets) const;
  // Rows b = 0..batch-1 are global samples first_index + b; input_ids and targets are [batch, T].
  void batch(int64_t first_index, int64_t batch, int32_t* input_ids, int32_t* targets) const;

 private:
  static constexpr int64_t kChunk = 4096;
  size_t choose(int64_t index, const std::vector<int64_t>& counts) const;
  // Counts at the start of chunk c (computed on demand, under the mutex).
  std::vector<int64_t> chunk_counts(int64_t chunk) const;
  // Assignments for samples [first, first + n) appended to `out`.
  void locate_range(int64_t first, int64_t n, std::vector<std::pair<size_t, int64_t>>& out) const;

  std::vector<std::shared_ptr<const GptDataset>> datasets_;
  std::vector<double> weights_;
  int64_t seq_len_ = 0, num_samples_ = 0;
  mutable std::mutex mutex_;
  mutable std::vector<std::vector<int64_t>> snapshots_;  // snapshots_[c]: counts before sample c * kChunk
  mutable int64_t cursor_index_ = 0;                     // counts before sample cursor_index_
  mutable std::vector<int64_t> cursor_counts_;
};

// Opens the datasets of a blend string (each prefix once), takes part `split` of each by the split string
// (e.g. "969,30,1"), and blends them with the blend's weights. `config` applies to every component, except
// that components are unbounded and config.num_samples bounds the blend. A component whose split part
// holds no tokens is an error naming the prefix and the split.
std::unique_ptr<BlendedDataset> open_blended_gpt_dataset(std::string_view blend, std::string_view split,
                                                         DataSplit which, const GptDatasetConfig& config);

}  // namespace forge::data
