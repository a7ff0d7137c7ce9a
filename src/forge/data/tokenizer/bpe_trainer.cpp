#include "forge/data/tokenizer/bpe_trainer.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer_bpe.h"
#include "forge/data/tokenizer/tokenizer_impl.h"
#include "forge/data/tokenizer/tokenizer_regex.h"
#include "forge/data/tokenizer/tokenizer_text.h"

namespace forge::data {
namespace {

using ordered_json = nlohmann::ordered_json;

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}
int32_t pair_left(uint64_t key) { return static_cast<int32_t>(key >> 32); }
int32_t pair_right(uint64_t key) { return static_cast<int32_t>(key & 0xFFFFFFFFu); }

ordered_json byte_level_json(bool add_prefix_space, bool trim_offsets, bool use_regex) {
  ordered_json j;
  j["type"] = "ByteLevel";
  j["add_prefix_space"] = add_prefix_space;
  j["trim_offsets"] = trim_offsets;
  j["use_regex"] = use_regex;
  return j;
}

std::string resolve_pattern(const std::string& pattern) {
  if (pattern == "gpt2") return std::string(kGpt2SplitPattern);
  if (pattern == "llama3") return std::string(kLlama3SplitPattern);
  if (pattern.empty()) fail("BPE trainer: the pattern is empty (use gpt2, llama3 or a regular expression)");
  return pattern;
}

// The tokenizer.json around a vocabulary and merges, in the reference's key order.
ordered_json tokenizer_json(const BpeTrainerOptions& o, const std::vector<std::string>& id_to_token,
                            const std::vector<std::pair<int32_t, int32_t>>& merges) {
  ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  ordered_json added = ordered_json::array();
  for (const std::string& special : o.special_tokens) {
    const auto it = std::find(id_to_token.begin(), id_to_token.end(), special);
    ordered_json t;
    t["id"] = it - id_to_token.begin();
    t["content"] = special;
    t["single_word"] = false;
    t["lstrip"] = false;
    t["rstrip"] = false;
    t["normalized"] = false;
    t["special"] = true;
    if (std::none_of(added.begin(), added.end(),
                     [&](const ordered_json& a) { return a["content"] == special; }))
      added.push_back(t);
  }
  j["added_tokens"] = added;
  j["normalizer"] = nullptr;
  const bool gpt2 = o.pattern == "gpt2";
  if (gpt2) {
    j["pre_tokenizer"] = byte_level_json(false, true, true);
  } else {
    ordered_json split;
    split["type"] = "Split";
    split["pattern"]["Regex"] = resolve_pattern(o.pattern);
    split["behavior"] = "Isolated";
    split["invert"] = false;
    ordered_json seq;
    seq["type"] = "Sequence";
    seq["pretokenizers"] = ordered_json::array({split, byte_level_json(false, true, false)});
    j["pre_tokenizer"] = seq;
  }
  const ordered_json byte_level_post = byte_level_json(true, false, true);
  if (!o.bos_token.empty()) {
    const auto bos_id = std::find(id_to_token.begin(), id_to_token.end(), o.bos_token) - id_to_token.begin();
    auto special = [&](int type_id) {
      ordered_json s;
      s["SpecialToken"]["id"] = o.bos_token;
      s["SpecialToken"]["type_id"] = type_id;
      return s;
    };
    auto sequence = [&](const char* id, int type_id) {
      ordered_json s;
      s["Sequence"]["id"] = id;
      s["Sequence"]["type_id"] = type_id;
      return s;
    };
    ordered_json t;
    t["type"] = "TemplateProcessing";
    t["single"] = ordered_json::array({special(0), sequence("A", 0)});
    t["pair"] = ordered_json::array({special(0), sequence("A", 0), special(1), sequence("B", 1)});
    t["special_tokens"][o.bos_token]["id"] = o.bos_token;
    t["special_tokens"][o.bos_token]["ids"] = ordered_json::array({bos_id});
    t["special_tokens"][o.bos_token]["tokens"] = ordered_json::array({o.bos_token});
    ordered_json seq;
    seq["type"] = "Sequence";
    seq["processors"] = ordered_json::array({byte_level_post, t});
    j["post_processor"] = seq;
  } else {
    j["post_processor"] = byte_level_post;
  }
  j["decoder"] = byte_level_json(true, true, true);
  ordered_json model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = nullptr;
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = false;
  model["byte_fallback"] = false;
  model["ignore_merges"] = o.ignore_merges.value_or(o.pattern == "llama3");
  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < id_to_token.size(); ++id) vocab[id_to_token[id]] = id;
  model["vocab"] = std::move(vocab);
  ordered_json merge_list = ordered_json::array();
  for (const auto& [a, b] : merges)
    merge_list.push_back(ordered_json::array({id_to_token[a], id_to_token[b]}));
  model["merges"] = std::move(merge_list);
  j["model"] = std::move(model);
  return j;
}

// Counts the pre-tokenized words of the training text, in order of first appearance.
class WordCounter {
 public:
  explicit WordCounter(const Tokenizer& pre_tokenizer) : pre_tokenizer_(pre_tokenizer) {
    on_word_ = [this](std::string_view word, bool) {
      ++total_;
      const auto it = index_.find(word);
      if (it != index_.end()) {
        ++counts_[it->second];
      } else {
        index_.emplace(std::string(word), static_cast<int32_t>(words_.size()));
        words_.emplace_back(word);
        counts_.push_back(1);
      }
    };
  }
  void add(std::string_view text, std::string_view what) {
    tokenizer_text::check_utf8(text, what);
    ++sequences_;
    TokenizerAccess::pre_tokenize(pre_tokenizer_, text, on_word_);
  }
  const std::vector<std::string>& words() const { return words_; }
  const std::vector<int64_t>& counts() const { return counts_; }
  int64_t total() const { return total_; }
  int64_t sequences() const { return sequences_; }

 private:
  const Tokenizer& pre_tokenizer_;
  std::function<void(std::string_view, bool)> on_word_;
  TokenIdMap index_;
  std::vector<std::string> words_;  // raw bytes (their byte-level form is what gets merged)
  std::vector<int64_t> counts_;
  int64_t total_ = 0, sequences_ = 0;
};

// A candidate merge: a pair, its count when queued, and the words where it was seen.
struct QueuedPair {
  int64_t count;
  uint64_t pair;
  uint64_t sequence;  // queue order, for a deterministic order between identical entries
  std::vector<uint32_t> words;
};
struct QueueOrder {
  // Highest count first, then the smallest pair, then the earliest queued.
  bool operator()(const QueuedPair& a, const QueuedPair& b) const {
    if (a.count != b.count) return a.count < b.count;
    if (a.pair != b.pair) return a.pair > b.pair;
    return a.sequence > b.sequence;
  }
};

// Adds `index` to a sorted, duplicate-free word list (words are visited in increasing order).
void add_word(std::vector<uint32_t>& list, uint32_t index) {
  if (list.empty() || list.back() != index) list.push_back(index);
}

class Trainer {
 public:
  explicit Trainer(const BpeTrainerOptions& options) : options_(options) {
    if (options.vocab_size <= 0)
      fail("BPE trainer: vocab_size must be positive (got {})", options.vocab_size);
    if (options.min_frequency < 0) fail("BPE trainer: min_frequency must not be negative");
    tokenizer_text::check_utf8(options.pattern, "BPE trainer: the pattern");
    for (const std::string& s : options.special_tokens) {
      if (s.empty()) fail("BPE trainer: a special token is empty");
      tokenizer_text::check_utf8(s, fmt::format("special token '{}'", s));
    }
    if (!options.bos_token.empty() && std::find(options.special_tokens.begin(), options.special_tokens.end(),
                                                options.bos_token) == options.special_tokens.end())
      fail("BPE trainer: bos_token '{}' is not one of the special tokens", options.bos_token);
    // The pre-tokenizer the trained tokenizer will have, with an empty model, splits the training text.
    BpeTrainerOptions skeleton_options = options;
    skeleton_options.bos_token.clear();
    std::vector<std::string> unique_ids;
    for (const std::string& s : options.special_tokens)
      if (std::find(unique_ids.begin(), unique_ids.end(), s) == unique_ids.end()) unique_ids.push_back(s);
    skeleton_.emplace(Tokenizer::from_json_text(tokenizer_json(skeleton_options, unique_ids, {}).dump(),
                                                fmt::format("BPE trainer (pattern '{}')", options.pattern)));
    counter_.emplace(*skeleton_);
  }

  void add_text(std::string_view text, std::string_view what) { counter_->add(text, what); }

  Tokenizer finish(BpeTrainerStats* stats, std::chrono::steady_clock::time_point started);

 private:
  int32_t token_id(const std::string& token) {
    const auto it = token_ids_.find(token);
    if (it != token_ids_.end()) return it->second;
    const auto id = static_cast<int32_t>(id_to_token_.size());
    token_ids_.emplace(token, id);
    id_to_token_.push_back(token);
    return id;
  }
  // Merges every occurrence of `pair` in word `w` (left to right) and records the pair count changes.
  void merge_word(uint32_t w, uint64_t pair, int32_t replacement,
                  std::vector<std::pair<uint64_t, int32_t>>& changes);

  const BpeTrainerOptions& options_;
  std::optional<Tokenizer> skeleton_;
  std::optional<WordCounter> counter_;
  TokenIdMap token_ids_;
  std::vector<std::string> id_to_token_;
  std::vector<std::vector<int32_t>> symbols_;  // per distinct word
};

void Trainer::merge_word(uint32_t w, uint64_t pair, int32_t replacement,
                         std::vector<std::pair<uint64_t, int32_t>>& changes) {
  std::vector<int32_t>& s = symbols_[w];
  const int32_t a = pair_left(pair), b = pair_right(pair);
  for (size_t i = 0; i + 1 < s.size(); ++i) {
    if (s[i] != a || s[i + 1] != b) continue;
    if (i > 0) {
      changes.emplace_back(pair_key(s[i - 1], a), -1);
      changes.emplace_back(pair_key(s[i - 1], replacement), 1);
    }
    s[i] = replacement;
    s.erase(s.begin() + static_cast<ptrdiff_t>(i) + 1);
    if (i + 1 < s.size()) {
      changes.emplace_back(pair_key(b, s[i + 1]), -1);
      changes.emplace_back(pair_key(replacement, s[i + 1]), 1);
    }
  }
}

Tokenizer Trainer::finish(BpeTrainerStats* stats, std::chrono::steady_clock::time_point started) {
  const std::vector<std::string>& words = counter_->words();
  const std::vector<int64_t>& counts = counter_->counts();

  // 1. Special tokens, 2. the byte symbols (seen, or all 256) sorted by code point.
  for (const std::string& s : options_.special_tokens) token_id(s);
  bool seen[256] = {};
  for (const std::string& word : words)
    for (char c : word) seen[static_cast<uint8_t>(c)] = true;
  std::vector<std::pair<char32_t, uint8_t>> alphabet;
  for (int b = 0; b < 256; ++b)
    if (seen[b] || options_.full_byte_alphabet)
      alphabet.emplace_back(tokenizer_text::byte_to_code_point(static_cast<uint8_t>(b)),
                            static_cast<uint8_t>(b));
  std::sort(alphabet.begin(), alphabet.end());
  int32_t byte_id[256];
  for (const auto& [code_point, byte] : alphabet)
    byte_id[byte] = token_id(std::string(tokenizer_text::byte_to_utf8(byte)));
  const auto initial_size = static_cast<int64_t>(id_to_token_.size());
  if (options_.vocab_size < initial_size)
    fail("BPE trainer: vocab_size {} is smaller than the {} special tokens and byte symbols it must hold",
         options_.vocab_size, initial_size);

  // 3. Words as symbols; 4. pair counts and where each pair occurs.
  symbols_.resize(words.size());
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    std::vector<int32_t>& s = symbols_[w];
    s.reserve(words[w].size());
    for (char c : words[w]) s.push_back(byte_id[static_cast<uint8_t>(c)]);
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t p = pair_key(s[i], s[i + 1]);
      pair_counts[p] += counts[w];
      add_word(where[p], static_cast<uint32_t>(w));
    }
  }
  std::priority_queue<QueuedPair, std::vector<QueuedPair>, QueueOrder> queue;
  uint64_t sequence = 0;
  auto enqueue_updated = [&] {
    std::vector<uint64_t> pairs;
    pairs.reserve(where.size());
    for (const auto& entry : where) pairs.push_back(entry.first);
    std::sort(pairs.begin(), pairs.end());
    for (uint64_t p : pairs) {
      const int64_t count = pair_counts[p];
      if (count > 0) queue.push({count, p, sequence++, std::move(where[p])});
    }
    where.clear();
  };
  enqueue_updated();

  // 5. Merge the most frequent pair until the vocabulary is full. A queued count can be stale (the pair
  // lost occurrences to other merges): then it is requeued with its current count.
  std::vector<std::pair<uint64_t, int32_t>> merges;  // (pair, new id) in order
  std::vector<std::pair<uint64_t, int32_t>> changes;
  while (static_cast<int64_t>(id_to_token_.size()) < options_.vocab_size && !queue.empty()) {
    QueuedPair top = std::move(const_cast<QueuedPair&>(queue.top()));
    queue.pop();
    const int64_t current = pair_counts[top.pair];
    if (top.count != current) {
      top.count = current;
      top.sequence = sequence++;
      queue.push(std::move(top));
      continue;
    }
    if (top.count < 1 || top.count < options_.min_frequency) break;
    const int32_t new_id = token_id(id_to_token_[pair_left(top.pair)] + id_to_token_[pair_right(top.pair)]);
    merges.emplace_back(top.pair, new_id);
    for (uint32_t w : top.words) {
      changes.clear();
      merge_word(w, top.pair, new_id, changes);
      for (const auto& [p, change] : changes) {
        pair_counts[p] += change * counts[w];
        if (change > 0) add_word(where[p], w);
      }
    }
    enqueue_updated();
  }

  // A pair merged twice (possible when two pairs make the same token) keeps its last rank, as in the
  // reference's merge table.
  std::unordered_map<uint64_t, size_t> last_rank;
  for (size_t i = 0; i < merges.size(); ++i) last_rank[merges[i].first] = i;
  std::vector<std::pair<int32_t, int32_t>> merge_list;
  for (size_t i = 0; i < merges.size(); ++i)
    if (last_rank[merges[i].first] == i)
      merge_list.emplace_back(pair_left(merges[i].first), pair_right(merges[i].first));

  Tokenizer result = Tokenizer::from_json_text(tokenizer_json(options_, id_to_token_, merge_list).dump(2),
                                               "trained tokenizer");
  if (stats) {
    stats->sequences = counter_->sequences();
    stats->words = counter_->total();
    stats->distinct_words = static_cast<int64_t>(words.size());
    stats->merges = static_cast<int64_t>(merge_list.size());
    stats->vocab_size = static_cast<int64_t>(id_to_token_.size());
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  return result;
}

}  // namespace

Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options,
                    BpeTrainerStats* stats) {
  const auto started = std::chrono::steady_clock::now();
  Trainer trainer(options);
  for (size_t i = 0; i < texts.size(); ++i) trainer.add_text(texts[i], fmt::format("training text {}", i));
  return trainer.finish(stats, started);
}

Tokenizer train_bpe(std::string_view text, const BpeTrainerOptions& options, BpeTrainerStats* stats) {
  const auto started = std::chrono::steady_clock::now();
  Trainer trainer(options);
  trainer.add_text(text, "training text");
  return trainer.finish(stats, started);
}

Tokenizer train_bpe_from_files(const std::vector<std::filesystem::path>& files,
                               const BpeTrainerOptions& options, BpeTrainerStats* stats) {
  const auto started = std::chrono::steady_clock::now();
  if (files.empty()) fail("BPE trainer: no input files");
  Trainer trainer(options);
  std::string line;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) fail("BPE trainer: cannot open input file '{}'", file.string());
    int64_t number = 0;
    // Each line keeps its '\n' (and any '\r' before it), as the reference reads files.
    while (std::getline(in, line)) {
      ++number;
      if (!in.eof()) line.push_back('\n');
      trainer.add_text(line, fmt::format("'{}' line {}", file.string(), number));
    }
    if (in.bad()) fail("BPE trainer: cannot read input file '{}'", file.string());
  }
  return trainer.finish(stats, started);
}

}  // namespace forge::data
