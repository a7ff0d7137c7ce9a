#include "forge/data/tokenizer/tokenizer_bpe.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <queue>

#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer_text.h"

namespace forge::data {
namespace {

// Words longer than this many symbols merge with the heap; shorter ones rescan an array of pair ranks.
constexpr size_t kHeapMergeThreshold = 96;
// The cache keeps words up to this many bytes, at most this many of them, in at most this much memory.
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheMaxEntries = size_t{1} << 17;
constexpr size_t kCacheMaxBytes = size_t{64} << 20;
constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

// A fast 64-bit hash of a short string (never 0, which marks empty cache slots).
uint64_t hash_word(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 29;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 32;
  return h | 1;
}

}  // namespace

const BpeModel::WordCache::Slot* BpeModel::WordCache::lookup(std::string_view word, uint64_t hash) const {
  if (slots_.empty()) return nullptr;
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.hash == 0) return &slot;
    if (slot.hash == hash && slot.key_size == word.size() &&
        std::memcmp(keys_.data() + slot.key, word.data(), word.size()) == 0)
      return &slot;
  }
}

bool BpeModel::WordCache::find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const {
  const Slot* slot = lookup(word, hash);
  if (!slot || slot->hash == 0) return false;
  out.insert(out.end(), values_.data() + slot->value, values_.data() + slot->value + slot->value_size);
  return true;
}

bool BpeModel::WordCache::full() const {
  return size_ >= kCacheMaxEntries || keys_.size() + values_.size() * sizeof(int32_t) >= kCacheMaxBytes;
}

void BpeModel::WordCache::insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count) {
  if (full() || word.size() > kCacheMaxWordBytes || count > UINT16_MAX) return;
  if ((size_ + 1) * 2 > slots_.size()) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(1024, old.size() * 2), Slot{});
    const size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.hash == 0) continue;
      size_t i = s.hash & mask;
      while (slots_[i].hash != 0) i = (i + 1) & mask;
      slots_[i] = s;
    }
  }
  Slot* slot = const_cast<Slot*>(lookup(word, hash));
  if (slot->hash != 0) return;  // already there
  slot->hash = hash;
  slot->key = static_cast<uint32_t>(keys_.size());
  slot->key_size = static_cast<uint16_t>(word.size());
  slot->value = static_cast<uint32_t>(values_.size());
  slot->value_size = static_cast<uint16_t>(count);
  keys_.append(word);
  values_.insert(values_.end(), ids, ids + count);
  ++size_;
}

BpeModel::BpeModel(BpeModelConfig config, std::string_view context)
    : vocab_(std::move(config.vocab)),
      unk_token_(std::move(config.unk_token)),
      fuse_unk_(config.fuse_unk),
      ignore_merges_(config.ignore_merges),
      byte_fallback_(config.byte_fallback) {
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab_) {
    if (id < 0) fail("{}: vocab: token '{}' has a negative id {}", context, token, id);
    max_id = std::max(max_id, id);
  }
  // Ids index tables, so they must be dense enough (real vocabularies number their tokens 0..n-1).
  if (max_id >= 0 && static_cast<size_t>(max_id) > 4 * vocab_.size() + 65536)
    fail("{}: vocab: id {} is far beyond the vocabulary's {} tokens", context, max_id, vocab_.size());
  id_to_token_.resize(static_cast<size_t>(max_id) + 1);
  has_id_.assign(id_to_token_.size(), 0);
  for (const auto& [token, id] : vocab_) {
    if (has_id_[id]) {
      const std::string& a = std::min(token, id_to_token_[id]);
      const std::string& b = std::max(token, id_to_token_[id]);
      fail("{}: vocab: tokens '{}' and '{}' share id {}", context, a, b, id);
    }
    has_id_[id] = 1;
    id_to_token_[id] = token;
  }
  merges_.reserve(config.merges.size());
  std::string joined;
  for (size_t rank = 0; rank < config.merges.size(); ++rank) {
    const auto& [a, b] = config.merges[rank];
    const auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end())
      fail("{}: merges: merge {} ('{} {}') names unknown token '{}'", context, rank, a, b, a);
    if (ib == vocab_.end())
      fail("{}: merges: merge {} ('{} {}') names unknown token '{}'", context, rank, a, b, b);
    joined = a + b;
    const auto ij = vocab_.find(joined);
    if (ij == vocab_.end())
      fail("{}: merges: merge {} ('{} {}') makes '{}', which is not in the vocab", context, rank, a, b,
           joined);
    // A pair listed twice keeps its last rank, as in the reference.
    merges_[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(rank), ij->second};
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(tokenizer_text::byte_to_utf8(static_cast<uint8_t>(b)));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    const auto fallback = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_fallback_ids_[b] = byte_fallback_ && fallback != vocab_.end() ? fallback->second : -1;
  }
  if (unk_token_) {
    const auto it = vocab_.find(*unk_token_);
    if (it != vocab_.end()) unk_id_ = it->second;
  }
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

const BpeModel::MergeTarget* BpeModel::find_merge(int32_t a, int32_t b) const {
  const auto it = merges_.find(pair_key(a, b));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeModel::merge_by_scan(std::vector<int32_t>& symbols) const {
  const size_t n = symbols.size();
  if (n < 2) return;
  // ranks[i], results[i]: the merge of symbols[i] and symbols[i + 1], if any.
  std::vector<int32_t> ranks(n - 1), results(n - 1);
  auto update = [&](size_t i) {
    const MergeTarget* m = find_merge(symbols[i], symbols[i + 1]);
    ranks[i] = m ? m->rank : kNoRank;
    results[i] = m ? m->result : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) update(i);
  size_t size = n;
  while (size > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < size; ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNoRank) break;
    symbols[best] = results[best];
    symbols.erase(symbols.begin() + static_cast<ptrdiff_t>(best) + 1);
    ranks.erase(ranks.begin() + static_cast<ptrdiff_t>(best));
    results.erase(results.begin() + static_cast<ptrdiff_t>(best));
    --size;
    if (best > 0) update(best - 1);
    if (best + 1 < size) update(best);
  }
}

void BpeModel::merge_by_heap(std::vector<int32_t>& symbols) const {
  const size_t n = symbols.size();
  if (n < 2) return;
  // A doubly linked list over the symbols; merged-away symbols are marked dead.
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i) + 1 : -1;
  }
  struct Candidate {
    int32_t rank, pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const MergeTarget* m = find_merge(symbols[pos], symbols[next[pos]])) queue.push({m->rank, pos});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    // Skip entries made stale by an earlier merge at or next to this position.
    if (!alive[top.pos] || next[top.pos] < 0) continue;
    const int32_t right = next[top.pos];
    const MergeTarget* m = find_merge(symbols[top.pos], symbols[right]);
    if (!m || m->rank != top.rank) continue;
    symbols[top.pos] = m->result;
    alive[right] = 0;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    push(prev[top.pos]);
    push(top.pos);
  }
  size_t out = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void BpeModel::tokenize_uncached(std::string_view word, bool byte_level, std::vector<int32_t>& out) const {
  std::string mapped;
  std::string_view model_word = word;
  if (byte_level) {
    mapped = tokenizer_text::to_byte_level(word);
    model_word = mapped;
  }
  if (ignore_merges_) {
    if (const auto it = vocab_.find(model_word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool pending_unk = false;  // an unknown symbol not yet emitted (fused with the following ones)
  auto add_unknown = [&](std::string_view character) {
    if (!unk_token_) return;  // no unknown token: the character is dropped
    if (!unk_id_)
      fail("the unknown token '{}' is not in the vocabulary (needed for '{}')", *unk_token_, character);
    if (pending_unk && !fuse_unk_) symbols.push_back(*unk_id_);
    pending_unk = true;
  };
  auto add_known = [&](int32_t id) {
    if (pending_unk) symbols.push_back(*unk_id_);
    pending_unk = false;
    symbols.push_back(id);
  };
  // The byte tokens of a character missing from the vocabulary, if there are all of them. As in the
  // reference they go in without emitting a pending unknown token first.
  auto add_bytes = [&](std::string_view character) {
    if (!byte_fallback_) return false;
    for (char c : character)
      if (byte_fallback_ids_[static_cast<uint8_t>(c)] < 0) return false;
    for (char c : character) symbols.push_back(byte_fallback_ids_[static_cast<uint8_t>(c)]);
    return true;
  };
  if (byte_level) {
    for (char c : word) {
      const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
      if (id >= 0) {
        add_known(id);
      } else {
        const std::string_view character = tokenizer_text::byte_to_utf8(static_cast<uint8_t>(c));
        if (!add_bytes(character)) add_unknown(character);
      }
    }
  } else {
    size_t i = 0;
    while (i < model_word.size()) {
      const size_t start = i;
      tokenizer_text::next_code_point(model_word, i);
      const std::string_view character = model_word.substr(start, i - start);
      if (const auto it = vocab_.find(character); it != vocab_.end()) {
        add_known(it->second);
      } else if (!add_bytes(character)) {
        add_unknown(character);
      }
    }
  }
  if (pending_unk) symbols.push_back(*unk_id_);
  if (symbols.size() > kHeapMergeThreshold) {
    merge_by_heap(symbols);
  } else {
    merge_by_scan(symbols);
  }
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeModel::tokenize(std::string_view word, bool byte_level, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  Cache& cache = caches_[byte_level ? 1 : 0];
  const uint64_t hash = hash_word(word);
  {
    std::shared_lock lock(cache.mutex);
    if (cache.table.find(word, hash, out)) return;
  }
  const size_t before = out.size();
  tokenize_uncached(word, byte_level, out);
  if (word.size() > kCacheMaxWordBytes) return;
  std::unique_lock lock(cache.mutex);
  cache.table.insert(word, hash, out.data() + before, out.size() - before);
}

}  // namespace forge::data
