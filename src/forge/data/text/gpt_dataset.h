// GPT training samples from a Megatron indexed dataset, with Megatron-core's three indices:
//
//   document index  the documents of a range (e.g. the train part of a "969,30,1" split), repeated epoch
//                   after epoch; each epoch is a permutation drawn from (seed, epoch), or the documents
//                   in order when shuffling is off. Concatenated, the epochs form one token stream.
//   sample index    sample window w covers stream tokens [w*T, w*T + T] (T + 1 tokens), so consecutive
//                   windows overlap by one token and every token of the stream is the target of exactly
//                   one window. Windows cross document and epoch boundaries freely (packing).
//   shuffle index   samples are served in a permuted order: the sample indices are cut into blocks of
//                   samples_per_epoch() and each block is a permutation, drawn from (seed, block), of the
//                   same number of consecutive windows. With shuffling off, sample i is window i.
//
// As in Megatron-LM a "document" here is a sequence of the indexed dataset (GPT data has one sequence per
// document). The order depends only on (seed, sample index): never on the number of samples a run asks
// for, on batching, or on how many samples were read before, so a longer or resumed run sees the same
// samples at the same indices. Per-epoch and per-block tables are computed on first use and a few are kept
// (memory O(documents + samples per epoch)); every method is safe to call from several threads.
//
// Differences from Megatron-LM, which shuffles the documents of all epochs together and the samples of all
// epochs together (numpy's RandomState): forge shuffles per epoch and per block with its own splitmix64
// generator, so its order is not numpy's bit for bit, but the same (seed, index) always gives the same
// sample and every epoch covers every document exactly once.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/data/text/indexed_dataset.h"

namespace forge::data {

// Sequences [begin, end) of an indexed dataset.
struct DocumentRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// Megatron's split string ("969,30,1", "99,1", "1"): up to three non-negative weights for train, valid and
// test, normalised; part k covers [round(c_k * n), round(c_{k+1} * n)) where c are the cumulative
// normalised weights (missing parts weigh 0). Throws forge::Error naming the string when it is malformed.
std::vector<DocumentRange> split_document_ranges(std::string_view split, int64_t num_documents);

enum class DataSplit { train = 0, valid = 1, test = 2 };
std::string_view data_split_name(DataSplit split);

struct GptDatasetConfig {
  int64_t seq_len = 0;  // T: each sample has T input ids and T targets
  uint64_t seed = 1234;
  bool shuffle = true;      // false: documents in order, samples in order
  int64_t num_samples = 0;  // 0: unbounded; else sample(i) requires i < num_samples
  // > 0: every token read must be an id in [0, vocab_size); one outside is an error naming the .bin file,
  // the document, the position in it, the id and vocab_name (e.g. "the model's vocabulary").
  int64_t vocab_size = 0;
  std::string vocab_name = "the vocabulary";
};

class GptDataset {
 public:
  // Throws forge::Error when the range is outside the dataset or holds no tokens, the dtype is not an
  // integer type, or seq_len < 1.
  GptDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange documents, GptDatasetConfig config);

  const IndexedDataset& data() const { return *data_; }
  const GptDatasetConfig& config() const { return config_; }
  DocumentRange documents() const { return documents_; }
  int64_t seq_len() const { return config_.seq_len; }
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // Whole windows inside one epoch's tokens: floor((tokens_per_epoch - 1) / T), at least 1. Also the size
  // of a shuffle block.
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  // Epochs of the stream that windows [0, n) touch: ceil((n * T + 1) / tokens_per_epoch). (The first n
  // samples read these windows when n is a multiple of samples_per_epoch() or shuffling is off.)
  int64_t epochs_for_samples(int64_t n) const;

  // Sample `index`: input_ids[t] = stream[w*T + t], targets[t] = stream[w*T + t + 1] for t < T, where w
  // is the window the shuffle index assigns to `index`.
  void sample(int64_t index, int32_t* input_ids, int32_t* targets) const;
  // Rows b = 0..batch-1 are samples first_index + b; input_ids and targets are [batch, T] row-major.
  void batch(int64_t first_index, int64_t batch, int32_t* input_ids, int32_t* targets) const;

  // The window (position in the stream, in units of T) that sample `index` reads.
  int64_t window_of_sample(int64_t index) const;
  // Reads `count` consecutive stream tokens from position `start`.
  void read_stream(int64_t start, int64_t count, int32_t* out) const;
  // The document (sequence) order of one epoch.
  std::vector<int64_t> epoch_documents(int64_t epoch) const;

 private:
  struct EpochTable {
    std::vector<int64_t> order;  // sequence ids in stream order
    std::vector<int64_t> ends;   // ends[p]: stream offset (within the epoch) where document p ends
  };
  std::shared_ptr<const EpochTable> epoch_table(int64_t epoch) const;
  std::shared_ptr<const std::vector<int64_t>> block_permutation(int64_t block) const;
  void check_index(int64_t index) const;

  std::shared_ptr<const IndexedDataset> data_;
  DocumentRange documents_;
  GptDatasetConfig config_;
  int64_t tokens_per_epoch_ = 0, samples_per_epoch_ = 0;

  mutable std::mutex mutex_;
  mutable std::list<std::pair<int64_t, std::shared_ptr<const EpochTable>>> epochs_;  // most recent first
  mutable std::list<std::pair<int64_t, std::shared_ptr<const std::vector<int64_t>>>> blocks_;
};

// A uniformly random permutation of [0, n) (Fisher-Yates) from a splitmix64 stream seeded with `key`.
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t key);

}  // namespace forge::data
