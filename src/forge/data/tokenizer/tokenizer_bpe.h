// The BPE model of a tokenizer.json: vocabulary, ranked merges and the merge algorithm, with a word cache.
//
// A word (one pre-token) is split into characters, each looked up in the vocabulary; then, as in the
// reference, the adjacent pair with the lowest merge rank is merged (the leftmost on ties) until no
// adjacent pair has a merge. A character missing from the vocabulary becomes, with byte_fallback, the
// tokens <0xNN> of its UTF-8 bytes (when the vocabulary has them all); otherwise the unknown token if
// there is one (consecutive ones fused into one with fuse_unk), and it is dropped if there is none. With
// ignore_merges a word that is itself in the vocabulary is emitted as that one token.
//
// Byte-level words arrive as raw bytes (the byte-level mapping is applied here, one symbol per byte), so
// the cache is keyed by the text as it appears in the input.
#pragma once

#include <cstdint>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace forge::data {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using TokenIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeModelConfig {
  TokenIdMap vocab;                                         // token -> id
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool ignore_merges = false;
  bool byte_fallback = false;
};

class BpeModel {
 public:
  // Throws forge::Error "<context>: ..." for merges naming tokens that are not in the vocabulary (or
  // whose concatenation is not) and for duplicate ids.
  BpeModel(BpeModelConfig config, std::string_view context);

  // Appends the ids of one word. byte_level: `word` is raw text whose bytes map to the byte-level
  // alphabet; otherwise `word` is already in the vocabulary's alphabet.
  void tokenize(std::string_view word, bool byte_level, std::vector<int32_t>& out) const;

  const TokenIdMap& vocab() const { return vocab_; }
  // Token of id, or nullptr when the model has no such id.
  const std::string* id_to_token(int32_t id) const;
  int64_t max_id() const { return static_cast<int64_t>(id_to_token_.size()) - 1; }

  // The merge algorithms, exposed for tests: both give the same result for every input.
  void merge_by_scan(std::vector<int32_t>& symbols) const;
  void merge_by_heap(std::vector<int32_t>& symbols) const;

 private:
  struct MergeTarget {
    int32_t rank, result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const MergeTarget* find_merge(int32_t a, int32_t b) const;
  void tokenize_uncached(std::string_view word, bool byte_level, std::vector<int32_t>& out) const;

  TokenIdMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> has_id_;
  std::unordered_map<uint64_t, MergeTarget> merges_;
  int32_t byte_ids_[256];
  int32_t byte_fallback_ids_[256];  // the id of "<0xNN>", or -1 (all -1 without byte_fallback)
  std::optional<std::string> unk_token_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false, ignore_merges_ = false, byte_fallback_ = false;

  // Word cache: word -> ids, one per input kind (byte-level or not); an open-addressing table that keeps
  // each key's hash. Entries are never evicted; the cache stops growing at a fixed size.
  class WordCache {
   public:
    bool find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const;
    void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count);
    bool full() const;

   private:
    struct Slot {
      uint64_t hash = 0;  // 0: empty
      uint32_t key = 0, value = 0;
      uint16_t key_size = 0, value_size = 0;
    };
    const Slot* lookup(std::string_view word, uint64_t hash) const;
    std::vector<Slot> slots_;
    std::string keys_;
    std::vector<int32_t> values_;
    size_t size_ = 0;
  };
  struct Cache {
    mutable std::shared_mutex mutex;
    WordCache table;
  };
  mutable Cache caches_[2];
};

}  // namespace forge::data
