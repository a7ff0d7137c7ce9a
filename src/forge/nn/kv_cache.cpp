#include "forge/nn/kv_cache.h"

namespace forge::nn {

KvCache::KvCache(int64_t layers, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
                 Device device)
    : layers_(layers), batch_(batch), capacity_(capacity), kv_heads_(kv_heads), head_dim_(head_dim) {
  if (layers <= 0 || batch <= 0 || capacity <= 0 || kv_heads <= 0 || head_dim <= 0)
    fail("KV cache: every size must be positive (layers {}, batch {}, capacity {}, kv_heads {}, head_dim {})",
         layers, batch, capacity, kv_heads, head_dim);
  const Shape shape{layers, 2, batch, capacity, kv_heads, head_dim};
  try {
    storage_ = Tensor::empty(shape, DType::f32, device);
  } catch (const Error&) {
    fail("KV cache: cannot allocate {:.1f} MiB for {} layers x batch {} x {} positions",
         static_cast<double>(shape_numel(shape)) * 4.0 / (1 << 20), layers, batch, capacity);
  }
}

KvLayer KvCache::layer(int64_t index) {
  FORGE_CHECK(allocated() && index >= 0 && index < layers_, "KV cache: no layer {} (of {})", index, layers_);
  KvLayer l;
  const int64_t per_tensor = batch_ * capacity_ * kv_heads_ * head_dim_;
  l.keys = storage_.f32() + 2 * index * per_tensor;
  l.values = l.keys + per_tensor;
  l.batch = batch_, l.capacity = capacity_, l.kv_heads = kv_heads_, l.head_dim = head_dim_,
  l.length = length_;
  return l;
}

void KvCache::advance(int64_t tokens) {
  FORGE_CHECK(tokens >= 0 && tokens <= remaining(),
              "KV cache: cannot advance by {} with {} of {} positions free", tokens, remaining(), capacity_);
  length_ += tokens;
}

void KvCache::truncate(int64_t length) {
  if (length < 0 || length > length_) fail("KV cache: cannot truncate {} positions to {}", length_, length);
  length_ = length;
}

}  // namespace forge::nn
