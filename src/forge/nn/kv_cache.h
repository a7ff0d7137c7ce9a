// KvCache: the keys (after RoPE) and values of past tokens that incremental decoding attends to, for every
// layer of a model. One fp32 allocation, made once for the longest sequence the caller will run:
//   [layers, 2 (keys, values), batch, kv_heads, capacity, head_dim]
// Each kv head's positions lie together (Hugging Face's cache layout too): a decoding step streams every
// head's keys and values from contiguous memory, which measured 2x faster at long contexts than positions
// with all heads side by side (rows a head_dim apart, pages apart). length() positions of every sequence
// are filled. A forward step writes
// positions length() .. length() + n - 1 in each layer and then commits them with advance(n); a step that
// fails part-way leaves length() unchanged, and the partial rows are overwritten by the next step.
#pragma once

#include <cstdint>

#include "forge/core/tensor.h"

namespace forge::nn {

// One layer's part of the cache, as Attention::forward_cached sees it.
struct KvLayer {
  float* keys = nullptr;    // [batch, kv_heads, capacity, head_dim]
  float* values = nullptr;  // same layout
  int64_t batch = 0, capacity = 0, kv_heads = 0, head_dim = 0;
  int64_t length = 0;  // filled positions per sequence
  // Element offset of (sequence b, kv head g, position t) in keys or values.
  int64_t at(int64_t b, int64_t g, int64_t t) const {
    return b * batch_stride() + g * head_stride() + t * head_dim;
  }
  int64_t head_stride() const { return capacity * head_dim; }
  int64_t batch_stride() const { return kv_heads * capacity * head_dim; }
};

class KvCache {
 public:
  KvCache() = default;
  // Throws forge::Error for a non-positive size or an allocation that fails. The cache lives on `device`
  // (the model's).
  KvCache(int64_t layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
          Device device = Device::cpu);

  bool allocated() const { return storage_.defined(); }
  int64_t layers() const { return layers_; }
  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t length() const { return length_; }
  int64_t remaining() const { return capacity_ - length_; }
  size_t bytes() const { return storage_.defined() ? storage_.bytes() : 0; }

  KvLayer layer(int64_t index);
  // Commits `tokens` positions written by the last forward step.
  void advance(int64_t tokens);
  // Forgets every position (the memory is kept for the next sequence).
  void reset() { length_ = 0; }
  // Keeps the first `length` positions (rolls back later ones, e.g. rejected draft tokens).
  void truncate(int64_t length);

 private:
  Tensor storage_;
  int64_t layers_ = 0, batch_ = 0, capacity_ = 0, kv_heads_ = 0, head_dim_ = 0, length_ = 0;
};

}  // namespace forge::nn
