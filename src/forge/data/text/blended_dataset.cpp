#include "forge/data/text/blended_dataset.h"

#include <cmath>
#include <map>
#include <sstream>

#include "forge/core/error.h"

namespace forge::data {

std::vector<BlendComponent> parse_blend(std::string_view blend) {
  std::vector<std::string> words;
  {
    std::istringstream in{std::string(blend)};
    for (std::string word; in >> word;) words.push_back(word);
  }
  if (words.empty()) fail("blend '{}': empty (expected PREFIX or \"W1 PREFIX1 W2 PREFIX2 ...\")", blend);
  if (words.size() == 1) return {{1.0, words[0]}};
  if (words.size() % 2 != 0)
    fail("blend '{}': {} words; expected PREFIX or weight/prefix pairs \"W1 PREFIX1 W2 PREFIX2 ...\"", blend,
         words.size());
  std::vector<BlendComponent> components;
  double total = 0;
  for (size_t i = 0; i < words.size(); i += 2) {
    const std::string& word = words[i];
    size_t used = 0;
    double weight = 0;
    try {
      weight = std::stod(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || !std::isfinite(weight) || weight <= 0)
      fail("blend '{}': '{}' is not a positive weight (expected \"W1 PREFIX1 W2 PREFIX2 ...\")", blend, word);
    components.push_back({weight, words[i + 1]});
    total += weight;
  }
  for (auto& c : components) c.weight /= total;
  return components;
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const GptDataset>> datasets,
                               std::vector<double> weights, int64_t num_samples)
    : datasets_(std::move(datasets)), weights_(std::move(weights)), num_samples_(num_samples) {
  if (datasets_.empty()) fail("blended dataset: no datasets");
  if (datasets_.size() != weights_.size())
    fail("blended dataset: {} datasets but {} weights", datasets_.size(), weights_.size());
  if (num_samples_ < 0) fail("blended dataset: num_samples must be >= 0, got {}", num_samples_);
  double total = 0;
  for (size_t k = 0; k < datasets_.size(); ++k) {
    if (!datasets_[k]) fail("blended dataset: dataset {} is missing", k);
    if (!std::isfinite(weights_[k]) || weights_[k] <= 0)
      fail("blended dataset: the weight of '{}' must be positive, got {}", datasets_[k]->data().prefix(),
           weights_[k]);
    if (datasets_[k]->seq_len() != datasets_[0]->seq_len())
      fail("blended dataset: '{}' has seq_len {} but '{}' has {}", datasets_[k]->data().prefix(),
           datasets_[k]->seq_len(), datasets_[0]->data().prefix(), datasets_[0]->seq_len());
    total += weights_[k];
  }
  for (double& w : weights_) w /= total;
  seq_len_ = datasets_[0]->seq_len();
  snapshots_.push_back(std::vector<int64_t>(datasets_.size(), 0));
  cursor_counts_ = snapshots_[0];
}

size_t BlendedDataset::choose(int64_t index, const std::vector<int64_t>& counts) const {
  const double target = static_cast<double>(index + 1);
  size_t best = 0;
  double best_lag = weights_[0] * target - static_cast<double>(counts[0]);
  for (size_t k = 1; k < weights_.size(); ++k) {
    const double lag = weights_[k] * target - static_cast<double>(counts[k]);
    if (lag > best_lag) best = k, best_lag = lag;
  }
  return best;
}

std::vector<int64_t> BlendedDataset::chunk_counts(int64_t chunk) const {
  std::lock_guard<std::mutex> lock(mutex_);
  while (static_cast<int64_t>(snapshots_.size()) <= chunk) {
    std::vector<int64_t> counts = snapshots_.back();
    const int64_t first = (static_cast<int64_t>(snapshots_.size()) - 1) * kChunk;
    for (int64_t i = first; i < first + kChunk; ++i) ++counts[choose(i, counts)];
    snapshots_.push_back(std::move(counts));
  }
  return snapshots_[static_cast<size_t>(chunk)];
}

void BlendedDataset::locate_range(int64_t first, int64_t n,
                                  std::vector<std::pair<size_t, int64_t>>& out) const {
  if (first < 0 || n < 0) fail("blended dataset: bad sample range at {} ({} samples)", first, n);
  if (num_samples_ > 0 && first + n > num_samples_)
    fail("blended dataset: samples up to {} requested, but it was built for {}", first + n - 1, num_samples_);
  // Start from the last position served when it is close behind (sequential reading costs O(K) per
  // sample), else from the chunk's snapshot.
  int64_t i = 0;
  std::vector<int64_t> counts;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (cursor_index_ <= first && first - cursor_index_ < kChunk) {
      i = cursor_index_;
      counts = cursor_counts_;
    }
  }
  if (counts.empty()) {
    const int64_t chunk = first / kChunk;
    counts = chunk_counts(chunk);
    i = chunk * kChunk;
  }
  for (; i < first; ++i) ++counts[choose(i, counts)];
  for (; i < first + n; ++i) {
    const size_t k = choose(i, counts);
    out.emplace_back(k, counts[k]++);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  cursor_index_ = i;
  cursor_counts_ = std::move(counts);
}

std::pair<size_t, int64_t> BlendedDataset::locate(int64_t index) const {
  std::vector<std::pair<size_t, int64_t>> out;
  locate_range(index, 1, out);
  return out[0];
}

void BlendedDataset::sample(int64_t index, int32_t* input_ids, int32_t* targets) const {
  const auto [k, within] = locate(index);
  datasets_[k]->sample(within, input_ids, targets);
}

void BlendedDataset::batch(int64_t first_index, int64_t batch, int32_t* input_ids, int32_t* targets) const {
  if (batch <= 0) fail("blended dataset: batch must be positive, got {}", batch);
  std::vector<std::pair<size_t, int64_t>> where;
  where.reserve(static_cast<size_t>(batch));
  locate_range(first_index, batch, where);
  for (int64_t b = 0; b < batch; ++b) {
    const auto [k, within] = where[static_cast<size_t>(b)];
    datasets_[k]->sample(within, input_ids + b * seq_len_, targets + b * seq_len_);
  }
}

std::unique_ptr<BlendedDataset> open_blended_gpt_dataset(std::string_view blend, std::string_view split,
                                                         DataSplit which, const GptDatasetConfig& config) {
  const std::vector<BlendComponent> components = parse_blend(blend);
  std::map<std::string, std::shared_ptr<const IndexedDataset>> opened;
  std::vector<std::shared_ptr<const GptDataset>> datasets;
  std::vector<double> weights;
  GptDatasetConfig component_config = config;
  component_config.num_samples = 0;
  for (const auto& c : components) {
    auto& data = opened[c.prefix];
    if (!data) data = std::make_shared<const IndexedDataset>(c.prefix);
    const DocumentRange range =
        split_document_ranges(split, data->num_sequences())[static_cast<size_t>(which)];
    int64_t tokens = 0;
    for (int64_t s = range.begin; s < range.end && tokens == 0; ++s) tokens += data->sequence_length(s);
    if (tokens == 0)
      fail("dataset '{}': the {} part of split '{}' (documents [{}, {}) of {}) holds no tokens", c.prefix,
           data_split_name(which), split, range.begin, range.end, data->num_sequences());
    datasets.push_back(std::make_shared<const GptDataset>(data, range, component_config));
    weights.push_back(c.weight);
  }
  return std::make_unique<BlendedDataset>(std::move(datasets), std::move(weights), config.num_samples);
}

}  // namespace forge::data
