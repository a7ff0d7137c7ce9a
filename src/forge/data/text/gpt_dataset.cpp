#include "forge/data/text/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "forge/core/error.h"
#include "forge/core/int128.h"
#include "forge/data/text/byte_sampler.h"

namespace forge::data {
namespace {

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;
// Stream tags, so the document and sample shuffles of one seed are unrelated.
constexpr uint64_t kDocumentTag = 0x646f63756d656e74ull;  // "document"
constexpr uint64_t kSampleTag = 0x73616d706c657321ull;    // "samples!"
constexpr size_t kCachedEpochs = 3, kCachedBlocks = 2;

uint64_t derive_key(uint64_t seed, uint64_t tag, int64_t index) {
  return splitmix64(splitmix64(splitmix64(seed) ^ tag) + static_cast<uint64_t>(index));
}

// The splitmix64 stream: output k is splitmix64(key + k * gamma).
class SplitMixStream {
 public:
  explicit SplitMixStream(uint64_t key) : state_(key) {}
  uint64_t next() {
    const uint64_t out = splitmix64(state_);
    state_ += kGoldenGamma;
    return out;
  }
  // Uniform in [0, range) without bias (Lemire's multiply-shift with rejection).
  uint64_t below(uint64_t range) {
    uint128 product = static_cast<uint128>(next()) * range;
    uint64_t low = static_cast<uint64_t>(product);
    if (low < range) {
      const uint64_t threshold = (0 - range) % range;
      while (low < threshold) {
        product = static_cast<uint128>(next()) * range;
        low = static_cast<uint64_t>(product);
      }
    }
    return static_cast<uint64_t>(product >> 64);
  }

 private:
  uint64_t state_;
};

template <typename Cache, typename Make>
auto cached(Cache& cache, int64_t key, size_t capacity, Make&& make) {
  for (auto it = cache.begin(); it != cache.end(); ++it)
    if (it->first == key) {
      cache.splice(cache.begin(), cache, it);
      return cache.front().second;
    }
  cache.emplace_front(key, make());
  if (cache.size() > capacity) cache.pop_back();
  return cache.front().second;
}

}  // namespace

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t key) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i;
  SplitMixStream stream(key);
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(p[static_cast<size_t>(i)], p[stream.below(static_cast<uint64_t>(i) + 1)]);
  return p;
}

std::vector<DocumentRange> split_document_ranges(std::string_view split, int64_t num_documents) {
  if (num_documents < 0) fail("split '{}': negative document count {}", split, num_documents);
  const char separator = split.find('/') != std::string_view::npos ? '/' : ',';
  std::vector<double> weights;
  size_t start = 0;
  while (true) {
    const size_t end = split.find(separator, start);
    std::string part(
        split.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    part.erase(0, part.find_first_not_of(" \t"));
    part.erase(part.find_last_not_of(" \t") + 1);
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (part.empty() || used != part.size() || !std::isfinite(value) || value < 0)
      fail("split '{}': '{}' is not a non-negative number (expected e.g. \"969,30,1\")", split, part);
    weights.push_back(value);
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  if (weights.size() > 3)
    fail("split '{}': at most three parts (train, valid, test), got {}", split, weights.size());
  weights.resize(3, 0.0);
  const double total = weights[0] + weights[1] + weights[2];
  if (total <= 0) fail("split '{}': the weights sum to zero", split);
  std::vector<DocumentRange> ranges;
  double bookend = 0;
  // Python's round() (ties to even), as Megatron computes the bookends.
  auto position = [num_documents](double fraction) {
    return std::clamp<int64_t>(
        static_cast<int64_t>(std::nearbyint(fraction * static_cast<double>(num_documents))), 0,
        num_documents);
  };
  for (double w : weights) {
    const double next = bookend + w / total;
    ranges.push_back({position(bookend), position(next)});
    bookend = next;
  }
  return ranges;
}

std::string_view data_split_name(DataSplit split) {
  switch (split) {
    case DataSplit::train:
      return "train";
    case DataSplit::valid:
      return "valid";
    case DataSplit::test:
      return "test";
  }
  return "unknown";
}

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange documents,
                       GptDatasetConfig config)
    : data_(std::move(data)), documents_(documents), config_(config) {
  if (!data_) fail("GPT dataset: no indexed dataset given");
  const std::string& name = data_->prefix();
  if (config_.seq_len < 1)
    fail("GPT dataset '{}': seq_len must be at least 1, got {}", name, config_.seq_len);
  if (config_.num_samples < 0)
    fail("GPT dataset '{}': num_samples must be >= 0, got {}", name, config_.num_samples);
  if (!indexed_dtype_is_integer(data_->dtype()))
    fail("GPT dataset '{}': tokens are {}, not integer ids", name, indexed_dtype_name(data_->dtype()));
  if (documents_.begin < 0 || documents_.end > data_->num_sequences() || documents_.begin > documents_.end)
    fail("GPT dataset '{}': documents [{}, {}) are outside the dataset's {} sequences", name,
         documents_.begin, documents_.end, data_->num_sequences());
  for (int64_t s = documents_.begin; s < documents_.end; ++s) tokens_per_epoch_ += data_->sequence_length(s);
  if (tokens_per_epoch_ == 0)
    fail("GPT dataset '{}': documents [{}, {}) hold no tokens", name, documents_.begin, documents_.end);
  samples_per_epoch_ = std::max<int64_t>(1, (tokens_per_epoch_ - 1) / config_.seq_len);
}

int64_t GptDataset::epochs_for_samples(int64_t n) const {
  if (n <= 0) return 0;
  return (n * config_.seq_len + 1 + tokens_per_epoch_ - 1) / tokens_per_epoch_;
}

void GptDataset::check_index(int64_t index) const {
  if (index < 0) fail("GPT dataset '{}': negative sample index {}", data_->prefix(), index);
  if (config_.num_samples > 0 && index >= config_.num_samples)
    fail("GPT dataset '{}': sample {} is past the {} samples it was built for", data_->prefix(), index,
         config_.num_samples);
  if (index > std::numeric_limits<int64_t>::max() / 2 / (config_.seq_len + samples_per_epoch_))
    fail("GPT dataset '{}': sample index {} is too large", data_->prefix(), index);
}

std::shared_ptr<const GptDataset::EpochTable> GptDataset::epoch_table(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached(epochs_, epoch, kCachedEpochs, [&] {
    auto table = std::make_shared<EpochTable>();
    const int64_t n = documents_.size();
    if (config_.shuffle) {
      table->order = seeded_permutation(n, derive_key(config_.seed, kDocumentTag, epoch));
      for (auto& d : table->order) d += documents_.begin;
    } else {
      table->order.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) table->order[static_cast<size_t>(i)] = documents_.begin + i;
    }
    table->ends.resize(static_cast<size_t>(n));
    int64_t end = 0;
    for (int64_t p = 0; p < n; ++p) {
      end += data_->sequence_length(table->order[static_cast<size_t>(p)]);
      table->ends[static_cast<size_t>(p)] = end;
    }
    return std::shared_ptr<const EpochTable>(std::move(table));
  });
}

std::shared_ptr<const std::vector<int64_t>> GptDataset::block_permutation(int64_t block) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached(blocks_, block, kCachedBlocks, [&] {
    return std::make_shared<const std::vector<int64_t>>(
        seeded_permutation(samples_per_epoch_, derive_key(config_.seed, kSampleTag, block)));
  });
}

std::vector<int64_t> GptDataset::epoch_documents(int64_t epoch) const {
  if (epoch < 0) fail("GPT dataset '{}': negative epoch {}", data_->prefix(), epoch);
  return epoch_table(epoch)->order;
}

int64_t GptDataset::window_of_sample(int64_t index) const {
  check_index(index);
  if (!config_.shuffle) return index;
  const int64_t block = index / samples_per_epoch_, within = index % samples_per_epoch_;
  return block * samples_per_epoch_ + (*block_permutation(block))[static_cast<size_t>(within)];
}

void GptDataset::read_stream(int64_t start, int64_t count, int32_t* out) const {
  if (start < 0 || count < 0)
    fail("GPT dataset '{}': bad stream range at {} ({} tokens)", data_->prefix(), start, count);
  while (count > 0) {
    const int64_t epoch = start / tokens_per_epoch_, offset = start % tokens_per_epoch_;
    const auto table = epoch_table(epoch);
    const auto it = std::upper_bound(table->ends.begin(), table->ends.end(), offset);
    const size_t p = static_cast<size_t>(it - table->ends.begin());
    const int64_t document_start = p == 0 ? 0 : table->ends[p - 1];
    const int64_t take = std::min(count, table->ends[p] - offset);
    data_->read_tokens(table->order[p], offset - document_start, take, out);
    if (config_.vocab_size > 0)
      for (int64_t i = 0; i < take; ++i)
        if (out[i] < 0 || out[i] >= config_.vocab_size)
          fail_permanently("{}: document {}, position {}: token id {} is outside {} [0, {})",
                           indexed_bin_path(data_->prefix()), table->order[p], offset - document_start + i,
                           out[i], config_.vocab_name, config_.vocab_size);
    out += take;
    start += take;
    count -= take;
  }
}

void GptDataset::sample(int64_t index, int32_t* input_ids, int32_t* targets) const {
  const int64_t T = config_.seq_len;
  const int64_t start = window_of_sample(index) * T;
  read_stream(start, T, input_ids);
  std::copy(input_ids + 1, input_ids + T, targets);
  read_stream(start + T, 1, targets + T - 1);
}

void GptDataset::batch(int64_t first_index, int64_t batch, int32_t* input_ids, int32_t* targets) const {
  if (batch <= 0) fail("GPT dataset '{}': batch must be positive, got {}", data_->prefix(), batch);
  for (int64_t b = 0; b < batch; ++b)
    sample(first_index + b, input_ids + b * config_.seq_len, targets + b * config_.seq_len);
}

}  // namespace forge::data
