#include "forge/parallel/grad_buckets.h"

#include <algorithm>
#include <chrono>
#include <string_view>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/kernels/ops.h"

namespace forge::parallel {

int64_t default_bucket_bytes(bool device_memory, int dp) {
  if (!device_memory) return 4ll << 20;
  return 4 * std::max<int64_t>(40'000'000, 1'000'000 * static_cast<int64_t>(std::max(1, dp)));
}

int64_t bucket_bytes_of(double bucket_mb, bool device_memory, int dp) {
  if (bucket_mb <= 0) return default_bucket_bytes(device_memory, dp);
  return std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * 1048576.0));
}
namespace {

// Shards start on 64-byte boundaries (16 floats): bucket sizes are multiples of 16 * dp from offset 0.
constexpr int64_t kShardAlign = 16;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

}  // namespace

double GradReductionStats::overlap_ratio() const {
  if (communication_seconds <= 0) return 0;
  return std::clamp(1.0 - exposed_seconds / communication_seconds, 0.0, 1.0);
}

GradBuckets::GradBuckets(ParameterStore* store, comm::Communicator* dp, BucketOptions options)
    : store_(store), dp_(dp), options_(options) {
  FORGE_CHECK(store != nullptr && dp != nullptr,
              "gradient buckets need a parameter store and a dp communicator");
  if (!store->has_grads())
    fail("gradient buckets over a parameter store built without gradients (inference)");
  if (options.bucket_bytes <= 0)
    fail("gradient bucket size must be positive, got {} bytes", options.bucket_bytes);
  if (options.reduce_dtype != DType::f32 && options.reduce_dtype != DType::bf16)
    fail("gradient reductions run in fp32 or bf16, not {}", dtype_name(options.reduce_dtype));
  // Gradients on a device reduce over a communicator of device memory (NCCL, or the one-rank one): MPI here
  // would be handed device pointers.
  if (store->device() != Device::cpu && std::string_view(dp->backend()) == "mpi")
    fail("gradient buckets over {} memory need an nccl (or one-rank) communicator, got {}",
         device_name(store->device()), dp->backend());
  const auto [group_begin, group_end] = store->group_range(options.group);
  const int64_t n = group_end - group_begin;
  const int shards = options.shard ? dp->size() : 1;
  const int64_t bucket_elements = round_up(
      std::max<int64_t>(1, options.bucket_bytes / static_cast<int64_t>(sizeof(float))), kShardAlign * shards);
  // Boundaries at multiples of bucket_elements from offset 0 keep every shard aligned; the top bucket (the
  // first to launch) takes the remainder, merged into its neighbour when below half a bucket.
  const int64_t count = n == 0 ? 0 : std::max<int64_t>(1, (n + bucket_elements / 2) / bucket_elements);
  int64_t padded_size = 0;
  for (int64_t i = 0; i < count; ++i) {
    GradBucket b;
    b.begin = group_begin + i * bucket_elements;
    b.end = group_begin + (i == count - 1 ? n : (i + 1) * bucket_elements);
    b.shards = shards;
    b.shard_size = (b.size() + shards - 1) / shards;
    if (b.padded_size() != b.size()) padded_size = std::max(padded_size, b.padded_size());
    buckets_.push_back(b);
  }
  // Sharded fp32 reductions run in place (each rank's shard lands in its own block of the bucket); the one
  // bucket that does not split evenly is staged with a zero tail. bf16 reductions stage each bucket while
  // it is in flight.
  if (options.shard && !in_bf16() && padded_size > 0 && dp->size() > 1)
    padded_ = Tensor::zeros({padded_size}, DType::f32, store->device());
  in_flight_.resize(buckets_.size());
  // Which buckets each of the group's parameters overlaps, and how many parameters each bucket waits for.
  buckets_of_param_.resize(static_cast<size_t>(store->count()));
  params_in_bucket_.assign(buckets_.size(), 0);
  for (int id = 0; id < store->count(); ++id) {
    const ParamInfo& p = store->info(id);
    if (p.group != options.group) continue;
    const int64_t lo = p.offset, hi = p.offset + shape_numel(p.shape);
    for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
      if (buckets_[b].begin < hi && lo < buckets_[b].end)
        buckets_of_param_[id].push_back(b), ++params_in_bucket_[b];
  }
  if (options.overlap) listener_ = store->add_grad_listener([this](int id) { param_ready(id); });
}

GradBuckets::~GradBuckets() {
  if (listener_ >= 0) store_->remove_grad_listener(listener_);
  if (!in_step_) return;
  try {
    for (auto& f : in_flight_)
      if (f.launched && !f.completed) f.request.wait();
  } catch (...) {  // a destructor must not throw; the job is going down anyway
  }
}

std::pair<int64_t, int64_t> GradBuckets::owned_range(int bucket, int rank) const {
  const GradBucket& b = buckets_.at(bucket);
  if (!options_.shard) return {b.begin, b.end};
  const int64_t lo = std::min(b.end, b.begin + rank * b.shard_size);
  return {lo, std::min(b.end, lo + b.shard_size)};
}

std::vector<std::pair<int64_t, int64_t>> GradBuckets::owned_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int i = 0; i < static_cast<int>(buckets_.size()); ++i) {
    auto [lo, hi] = owned_range(i);
    if (lo == hi) continue;
    if (!ranges.empty() && ranges.back().second == lo)
      ranges.back().second = hi;  // one rank, or unsharded: adjacent buckets form one range
    else
      ranges.emplace_back(lo, hi);
  }
  return ranges;
}

void GradBuckets::begin_step() {
  FORGE_CHECK(!in_step_, "gradient buckets: begin_step() twice without finish()");
  for (auto& f : in_flight_) f = InFlight{};
  params_waiting_ = params_in_bucket_;
  launched_ = 0;
  next_ = static_cast<int>(buckets_.size()) - 1;
  in_step_ = true;
}

void GradBuckets::cancel_step() {
  for (auto& f : in_flight_)
    if (f.launched && !f.completed) f.request.wait();
  for (auto& f : in_flight_) f = InFlight{};
  in_step_ = false;
}

void GradBuckets::ready_from(int64_t flat_offset) {
  FORGE_CHECK(in_step_, "gradient buckets: ready_from({}) outside begin_step()/finish()", flat_offset);
  FORGE_CHECK(0 <= flat_offset && flat_offset <= store_->trained_numel(),
              "gradient buckets: ready_from({}) outside [0, {}]", flat_offset, store_->trained_numel());
  if (!options_.overlap) return;
  while (next_ >= 0 && buckets_[next_].begin >= flat_offset) launch_if_pending(next_--);
  poll();
}

void GradBuckets::param_ready(int id) {
  if (!in_step_ || !options_.overlap) return;
  for (int b : buckets_of_param_.at(id))
    if (--params_waiting_[b] == 0) launch_if_pending(b);
  poll();
}

void GradBuckets::launch_if_pending(int bucket) {
  if (!in_flight_[bucket].launched) launch(bucket);
}

void GradBuckets::finish() {
  FORGE_CHECK(in_step_, "gradient buckets: finish() without begin_step()");
  const double started = now_seconds();
  for (int i = static_cast<int>(buckets_.size()) - 1; i >= 0; --i) launch_if_pending(i);
  next_ = -1;
  for (int i = static_cast<int>(buckets_.size()) - 1; i >= 0; --i) {
    InFlight& f = in_flight_[i];
    if (f.completed) continue;
    f.request.wait();
    f.completed_at = now_seconds();
    complete(i);
  }
  const double finished = now_seconds();
  in_step_ = false;

  // Merge the [launch, completion] intervals in one sweep, in launch order (whatever order readiness gave).
  std::vector<int> order(buckets_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(),
            [this](int a, int b) { return in_flight_[a].launched_at < in_flight_[b].launched_at; });
  double busy = 0, span_begin = 0, span_end = -1;
  for (int i : order) {
    const InFlight& f = in_flight_[i];
    if (f.launched_at > span_end) {
      busy += std::max(0.0, span_end - span_begin);
      span_begin = f.launched_at;
      span_end = f.completed_at;
    } else {
      span_end = std::max(span_end, f.completed_at);
    }
  }
  busy += std::max(0.0, span_end - span_begin);
  const int64_t elements = buckets_.empty() ? 0 : buckets_.back().end - buckets_.front().begin;
  last_step_ = GradReductionStats{1, elements * static_cast<int64_t>(dtype_size(options_.reduce_dtype)),
                                  finished - started, busy};
  total_.steps += 1;
  total_.bytes += last_step_.bytes;
  total_.exposed_seconds += last_step_.exposed_seconds;
  total_.communication_seconds += last_step_.communication_seconds;
}

void GradBuckets::launch(int bucket) {
  const GradBucket& b = buckets_[bucket];
  InFlight& f = in_flight_[bucket];
  f.launched_at = now_seconds();
  f.launched = true;
  ++launched_;
  float* grads = store_->grads().f32();
  // One rank: the sum over dp is the bucket itself, already in place (and a device bucket must not reach the
  // one-rank communicator's host copy).
  if (dp_->size() == 1) return;
  if (in_bf16()) return launch_bf16(bucket);
  if (!options_.shard) {
    f.request = dp_->all_reduce(grads + b.begin, b.size(), comm::Type::f32, comm::ReduceOp::sum);
    return;
  }
  float* send = grads + b.begin;
  if (b.padded_size() != b.size()) {
    // Reduce-scatter needs dp equal blocks: stage the bucket with a zero tail (in stream order on a device:
    // the communicator waits for the device's queued work before it starts).
    padded_.view(0, {b.size()}).copy_from(store_->grads().view(b.begin, {b.size()}));
    padded_.view(b.size(), {b.padded_size() - b.size()}).fill_zero();
    send = padded_.f32();
  }
  // In place: this rank's sum lands in its own block, which is its owned range of the gradients (the rest
  // of the bucket is left undefined: no one reads another rank's shard).
  f.request = dp_->reduce_scatter(send, send + dp_->rank() * b.shard_size, b.shard_size, comm::Type::f32,
                                  comm::ReduceOp::sum);
}

// The bucket rounded to bf16 into its staging copy (zero padding under shard, in the device's stream order),
// all-reduced in place or reduce-scattered into this rank's shard.
void GradBuckets::launch_bf16(int bucket) {
  const GradBucket& b = buckets_[bucket];
  InFlight& f = in_flight_[bucket];
  const Device device = store_->device();
  f.staged = Tensor::empty({b.padded_size()}, DType::bf16, device);
  ops::convert_to_bf16(store_->grads().f32() + b.begin, f.staged.bf16(), b.size(), device);
  if (b.padded_size() != b.size()) f.staged.view(b.size(), {b.padded_size() - b.size()}).fill_zero();
  if (!options_.shard) {
    f.request = dp_->all_reduce(f.staged.bf16(), b.size(), comm::Type::bf16, comm::ReduceOp::sum);
    return;
  }
  f.received = Tensor::empty({b.shard_size}, DType::bf16, device);
  f.request = dp_->reduce_scatter(f.staged.bf16(), f.received.bf16(), b.shard_size, comm::Type::bf16,
                                  comm::ReduceOp::sum);
}

void GradBuckets::poll() {
  for (int i = static_cast<int>(buckets_.size()) - 1; i >= 0; --i) {
    InFlight& f = in_flight_[i];
    if (!f.launched || f.completed || !f.request.test()) continue;
    f.completed_at = now_seconds();
    complete(i);
  }
}

void GradBuckets::complete(int bucket) {
  InFlight& f = in_flight_[bucket];
  f.completed = true;
  if (in_bf16() && dp_->size() > 1) {  // the reduced bf16 values, widened into the owned range
    auto [lo, hi] = owned_range(bucket);
    const Tensor& sum = options_.shard ? f.received : f.staged;
    if (hi > lo) {
      ops::StridedCopyParams c;
      c.shape[2] = hi - lo;
      c.src = ConstElements(sum.bf16()), c.dst = store_->grads().f32() + lo;
      ops::strided_copy(c, store_->device());
    }
    f.staged = f.received = Tensor();
    return;
  }
  if (!options_.shard || dp_->size() == 1) return;
  // Reduced in place; the staged bucket's shard is copied back.
  const GradBucket& b = buckets_[bucket];
  auto [lo, hi] = owned_range(bucket);
  if (hi > lo && b.padded_size() != b.size())
    store_->grads().view(lo, {hi - lo}).copy_from(padded_.view(dp_->rank() * b.shard_size, {hi - lo}));
}

}  // namespace forge::parallel
