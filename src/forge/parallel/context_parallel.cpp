#include "forge/parallel/context_parallel.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "forge/core/error.h"

namespace forge::parallel {

ContextSplit ContextSplit::make(int cp, int rank, int64_t seq) {
  if (cp < 1) fail("parallel.cp = {}: expected at least 1", cp);
  if (rank < 0 || rank >= cp) fail("context parallelism: rank {} outside the group of {}", rank, cp);
  if (seq < 1 || seq % (2 * cp) != 0)
    fail(
        "parallel.cp = {}: data.seq_len = {} must be a multiple of 2 x cp = {} (each rank holds two chunks "
        "of the sequence, an early and a late one)",
        cp, seq, 2 * cp);
  return ContextSplit{cp, rank, seq};
}

ContextAttention context_attention_from_name(const std::string& name) {
  if (name == "ring" || name == "p2p") return ContextAttention::ring;
  if (name == "all_to_all" || name == "a2a") return ContextAttention::all_to_all;
  fail("context attention '{}': expected ring (p2p) or all_to_all (a2a)", name);
}

const char* context_attention_name(ContextAttention mode) {
  return mode == ContextAttention::ring ? "ring" : "all_to_all";
}

const char* context_attention_setting(ContextAttention mode) {
  return mode == ContextAttention::ring ? "p2p" : "a2a";
}

ContextSplitProblem context_split_problem(int cp, ContextAttention mode, int64_t seq, int64_t heads,
                                          int64_t kv_heads) {
  if (cp <= 1) return {};
  if (seq % (2 * cp) != 0)
    return {"data.seq_len",
            fmt::format(
                "data.seq_len = {} must be a multiple of 2 x parallel.cp = {} (each rank holds two chunks "
                "of every sequence)",
                seq, 2 * cp)};
  if (mode == ContextAttention::all_to_all && (heads % cp != 0 || kv_heads % cp != 0))
    return {
        "parallel.cp_comm",
        fmt::format("parallel.cp_comm = \"a2a\" scatters attention heads over parallel.cp = {}, but each "
                    "tensor-parallel rank holds {} heads and {} key/value heads; use cp_comm = \"p2p\" or a "
                    "cp that divides both",
                    cp, heads, kv_heads)};
  return {};
}

namespace {

// A working buffer of n elements (fp32, or bf16: the dtype the attention's tensors travel in) on the device
// the attention runs on, from forge's allocator (core/memory.h on the host, the device's caching allocator on
// a GPU), so that a run's peak memory counts the attention's travelling keys and values and partial results.
// Moving one into another (std::swap) swaps the memory.
class Buffer {
 public:
  Buffer() = default;
  Buffer(int64_t n, DType dtype, Device device)
      : t_(n > 0 ? Tensor::empty({n}, dtype, device) : Tensor()), n_(n), dtype_(dtype) {}
  Elements data() const {
    if (n_ == 0) return nullptr;
    return dtype_ == DType::bf16 ? Elements(t_.bf16()) : Elements(t_.f32());
  }
  DType dtype() const { return dtype_; }
  int64_t size() const { return n_; }
  int64_t bytes() const { return n_ * static_cast<int64_t>(dtype_size(dtype_)); }
  void zero() {
    if (n_ > 0) t_.fill_zero();
  }

 private:
  Tensor t_;
  int64_t n_ = 0;
  DType dtype_ = DType::f32;
};
// The fp32 ones: partial results, their merges and sums.
class Floats : public Buffer {
 public:
  Floats() = default;
  Floats(int64_t n, Device device) : Buffer(n, DType::f32, device) {}
  float* data() const { return Buffer::data().f32(); }
};

// dst (+)= src over [n0, n1, n2] elements, each side with its strides (ops::strided_copy).
struct Strides {
  int64_t s0, s1, s2;
};
// fp32 or bf16 on either side (a bf16 destination rounds once).
void copy3(Device device, int64_t n0, int64_t n1, int64_t n2, ConstElements src, Strides from, Elements dst,
           Strides to, bool accumulate = false) {
  ops::StridedCopyParams c;
  c.shape[0] = n0, c.shape[1] = n1, c.shape[2] = n2;
  c.src = src, c.src_stride[0] = from.s0, c.src_stride[1] = from.s1, c.src_stride[2] = from.s2;
  c.dst = dst, c.dst_stride[0] = to.s0, c.dst_stride[1] = to.s1, c.dst_stride[2] = to.s2;
  c.accumulate = accumulate;
  ops::strided_copy(c, device);
}

using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Times one call's compute and waits into optional stats.
struct CallTimer {
  ContextAttentionStats* stats;
  Clock::time_point mark = Clock::now();
  explicit CallTimer(ContextAttentionStats* s) : stats(s) {
    if (stats) ++stats->calls, stats->step_compute.clear();
  }
  // The time since the last mark was compute (as one ring step when step is set) / waiting.
  void computed(bool step = false) {
    if (!stats) return;
    const Clock::time_point now = Clock::now();
    const double t = seconds_between(mark, now);
    stats->compute_seconds += t;
    if (step) stats->step_compute.push_back(t);
    mark = now;
  }
  void waited() {
    if (!stats) return;
    const Clock::time_point now = Clock::now();
    stats->wait_seconds += seconds_between(mark, now);
    mark = now;
  }
  void sent(int64_t bytes) {
    if (stats) stats->bytes_sent += bytes;
  }
};

// Keys and values, and their gradients, pass between the same neighbours: apart by tag.
constexpr int kKvTag = 31, kGradientTag = 32;

struct Dims {
  int64_t batch, local, chunk, heads, kv_heads, head_dim, v_dim;
  Device device;
  DType io;  // the attention's tensors' dtype: what q, k, v, out and their gradients travel in
  int64_t q_width() const { return heads * head_dim; }
  int64_t k_width() const { return kv_heads * head_dim; }
  int64_t v_width() const { return kv_heads * v_dim; }
  int64_t out_width() const { return heads * v_dim; }
};

Dims check(const comm::Communicator& cp, const ContextSplit& split, const ops::AttentionParams& p,
           Device device, const char* what) {
  FORGE_CHECK(cp.size() == split.cp && cp.rank() == split.rank,
              "{}: the split is for rank {} of {}, the group is rank {} of {}", what, split.rank, split.cp,
              cp.rank(), cp.size());
  FORGE_CHECK(p.seq == split.local(), "{}: {} local tokens, but the split gives this rank {}", what, p.seq,
              split.local());
  FORGE_CHECK(p.causal && p.kv_seq == 0 && p.q_offset == 0 && p.k_batch_stride == 0 &&
                  p.v_batch_stride == 0 && p.k_head_stride == 0 && p.v_head_stride == 0,
              "{}: causal attention over the local tokens with dense batches and heads", what);
  const Dims d{p.batch,
               p.seq,
               split.chunk(),
               p.heads,
               p.kv_heads,
               p.head_dim,
               p.v_head_dim > 0 ? p.v_head_dim : p.head_dim,
               device,
               p.dtype()};
  FORGE_CHECK(p.q_stride >= d.q_width() && p.k_stride >= d.k_width() && p.v_stride >= d.v_width() &&
                  p.out_stride >= d.out_width(),
              "{}: token strides too small", what);
  return d;
}

// Rows [half·chunk, (half + 1)·chunk) of every sequence of x ([batch, local] rows of `width` floats, `stride`
// apart) into dense [batch, chunk, width], and back (overwriting).
void pack_half(const Dims& d, ConstElements x, int64_t stride, int64_t width, int half, Elements out) {
  copy3(d.device, d.batch, d.chunk, width, x + half * d.chunk * stride, {d.local * stride, stride, 1}, out,
        {d.chunk * width, width, 1});
}
void unpack_half(const Dims& d, ConstElements in, int64_t width, int half, Elements x, int64_t stride) {
  copy3(d.device, d.batch, d.chunk, width, in, {d.chunk * width, width, 1}, x + half * d.chunk * stride,
        {d.local * stride, stride, 1});
}
// The log-sum-exp [batch, heads, local] halves likewise ([batch, heads, chunk]).
void pack_lse(const Dims& d, const float* lse, int half, float* out) {
  copy3(d.device, 1, d.batch * d.heads, d.chunk, lse + half * d.chunk, {0, d.local, 1}, out, {0, d.chunk, 1});
}
void unpack_lse(const Dims& d, const float* in, int half, float* lse) {
  copy3(d.device, 1, d.batch * d.heads, d.chunk, in, {0, d.chunk, 1}, lse + half * d.chunk, {0, d.local, 1});
}

void add_into(const Dims& d, Elements y, ConstElements x, int64_t n) { ops::add_inplace(y, x, n, d.device); }
// y = x, converted (x itself when it is fp32 already).
void copy_into(const Dims& d, Elements y, ConstElements x, int64_t n) {
  copy3(d.device, 1, 1, n, x, {0, 0, 1}, y, {0, 0, 1});
}

// Merges a block's partial attention (out_b, lse_b) into the running one (out, lse) by their log-sum-exps.
void merge(const Dims& d, float* out, float* lse, const float* out_b, const float* lse_b) {
  ops::AttentionMergeParams m;
  m.batch = d.batch, m.seq = d.chunk, m.heads = d.heads, m.v_dim = d.v_dim;
  m.out = out, m.lse = lse, m.out_b = out_b, m.lse_b = lse_b;
  ops::attention_merge(m, d.device);
}

// The keys and values of one rank as they travel the ring: [K half 0 | K half 1 | V half 0 | V half 1],
// each dense [batch, chunk, width], in `dtype` (the attention's while they travel; fp32 where the blocks read
// them and where their gradients gather).
struct KvBlocks {
  Dims d;
  Buffer data;
  // allocate false: none (the widened blocks of an fp32 ring, which reads its travelling ones).
  KvBlocks(const Dims& dims, DType dtype, bool allocate = true)
      : d(dims), data(allocate ? 2 * d.batch * d.chunk * (d.k_width() + d.v_width()) : 0, dtype, d.device) {}
  Elements k(int half) const { return data.data() + half * d.batch * d.chunk * d.k_width(); }
  Elements v(int half) const {
    return data.data() + 2 * d.batch * d.chunk * d.k_width() + half * d.batch * d.chunk * d.v_width();
  }
  int64_t count() const { return data.size(); }
  // The fp32 blocks the attention reads: these (fp32 already), or `scratch` filled with them.
  const KvBlocks& in_fp32(KvBlocks& scratch) const {
    if (data.dtype() == DType::f32) return *this;
    copy_into(d, scratch.data.data(), data.data(), count());
    return scratch;
  }
};

// One block of the ring: the local query half `qi` against key half `kh` of rank `source`; false when the
// keys are all in the queries' future or, under a sliding window, all behind every query's window.
// *offset: how far the queries' chunk starts after the keys' (the kernel's q_offset without the causal mask).
bool block(const ContextSplit& split, const Dims& d, int64_t window, int qi, int source, int kh, bool* causal,
           int64_t* offset) {
  const int64_t q_chunk = split.chunk_of(qi, split.rank), k_chunk = split.chunk_of(kh, source);
  *causal = k_chunk == q_chunk;
  *offset = (q_chunk - k_chunk) * d.chunk;
  // The first query (position offset) sees keys after offset - window; the last key is chunk - 1.
  if (window > 0 && *offset - window >= d.chunk - 1) return false;
  return k_chunk <= q_chunk;
}

ops::AttentionParams block_params(const Dims& d, const ops::AttentionParams& p, const float* q,
                                  ConstElements k, ConstElements v, bool causal, int64_t offset) {
  ops::AttentionParams a;
  a.batch = d.batch, a.seq = d.chunk, a.heads = d.heads, a.kv_heads = d.kv_heads, a.head_dim = d.head_dim;
  a.v_head_dim = d.v_dim;
  a.q = q, a.k = k, a.v = v;
  a.q_stride = d.q_width(), a.k_stride = d.k_width(), a.v_stride = d.v_width();
  a.out_stride = d.out_width();
  a.scale = p.scale;
  a.causal = causal;
  // A window reaches back into earlier chunks: their keys are masked by position (the diagonal block's
  // queries and keys start together; an earlier block's queries sit `offset` after its keys).
  // (Without a window the offset changes nothing, and is left out: the GPU kernels take square blocks only.)
  a.window = p.window;
  a.softcap = p.softcap;
  if (!causal && p.window > 0) a.q_offset = offset;
  return a;
}

// Lets MPI move the transfers in flight: over shared memory a message progresses only inside MPI calls, so
// the ring tests its requests between blocks rather than leaving all of the copy to the final wait.
void progress(std::pair<comm::Request, comm::Request>& transfer) {
  transfer.first.test(), transfer.second.test();
}

// Starts the exchange of the ring: `send` to the next rank, `recv` from the previous one. Tested at once: a
// NCCL communicator launches posted operations (the two as one group) at its next test, so the transfer
// starts behind the packing rather than behind the first attention block.
std::pair<comm::Request, comm::Request> pass_on(comm::Communicator& cp, const Buffer& send, Buffer& recv,
                                                int tag) {
  const int next = (cp.rank() + 1) % cp.size(), previous = (cp.rank() + cp.size() - 1) % cp.size();
  const comm::Type type = comm::type_of(send.dtype());
  comm::Request r = cp.recv(recv.data().get(), recv.size(), type, previous, tag);
  comm::Request s = cp.send(send.data().get(), send.size(), type, next, tag);
  s.test();
  return {std::move(s), std::move(r)};
}

// The transfer done for what runs next: on a GPU in the kernels' stream order (the host goes on queueing);
// on the host, waited for.
void finish(comm::Communicator& cp, std::pair<comm::Request, comm::Request>& transfer) {
  cp.wait_on_stream(transfer.first), cp.wait_on_stream(transfer.second);
}

// The first block a query half sees (at step 0: its own diagonal chunk, or for the late half the early chunk
// of its own rank) writes that half's result directly; later ones merge into it. The keys and values travel
// in the attention's dtype (bf16 in a bf16 run: half the bytes) and are widened for the blocks, which
// compute, merge and keep their partial results in fp32; the result is rounded once when unpacked.
void ring_forward(comm::Communicator& cp, const ContextSplit& split, const Dims& d,
                  const ops::AttentionParams& p, CallTimer& timer) {
  const Device dev = d.device;
  const int64_t q_half = d.batch * d.chunk * d.q_width(), out_half = d.batch * d.chunk * d.out_width(),
                lse_half = d.batch * d.heads * d.chunk;
  Floats q[2] = {Floats(q_half, dev), Floats(q_half, dev)},
         out[2] = {Floats(out_half, dev), Floats(out_half, dev)},
         lse[2] = {Floats(lse_half, dev), Floats(lse_half, dev)};
  KvBlocks current(d, d.io), next(d, d.io), widened(d, DType::f32, d.io != DType::f32);
  for (int h = 0; h < 2; ++h) {
    pack_half(d, p.q, p.q_stride, d.q_width(), h, q[h].data());
    pack_half(d, p.k, p.k_stride, d.k_width(), h, current.k(h));
    pack_half(d, p.v, p.v_stride, d.v_width(), h, current.v(h));
  }
  Floats out_b(out_half, dev), lse_b(lse_half, dev);
  bool started[2] = {false, false};
  for (int step = 0; step < split.cp; ++step) {
    const int source = (split.rank - step + split.cp) % split.cp;
    std::pair<comm::Request, comm::Request> transfer;
    if (step + 1 < split.cp) {
      transfer = pass_on(cp, current.data, next.data, kKvTag);
      timer.sent(current.data.bytes());
    }
    const KvBlocks& kv = current.in_fp32(widened);
    for (int qi = 0; qi < 2; ++qi)
      for (int kh = 0; kh < 2; ++kh) {
        bool causal = false;
        int64_t offset = 0;
        if (!block(split, d, p.window, qi, source, kh, &causal, &offset)) continue;
        ops::AttentionParams a = block_params(d, p, q[qi].data(), kv.k(kh), kv.v(kh), causal, offset);
        const bool first = !started[qi];
        a.out = first ? out[qi].data() : out_b.data(), a.lse = first ? lse[qi].data() : lse_b.data();
        ops::attention_forward(a, dev);
        progress(transfer);
        if (!first) merge(d, out[qi].data(), lse[qi].data(), out_b.data(), lse_b.data());
        started[qi] = true;
      }
    timer.computed(true);
    finish(cp, transfer);
    timer.waited();
    std::swap(current.data, next.data);
  }
  FORGE_CHECK(started[0] && started[1], "ring attention: a query half saw no keys");
  for (int h = 0; h < 2; ++h) {
    unpack_half(d, out[h].data(), d.out_width(), h, p.out, p.out_stride);
    if (p.lse) unpack_lse(d, lse[h].data(), h, p.lse);
  }
  timer.computed();
}

// The keys and values travel as in forward; their gradients gather in fp32 on each rank and travel in the
// attention's dtype (each hop's sum rounded once).
void ring_backward(comm::Communicator& cp, const ContextSplit& split, const Dims& d,
                   const ops::AttentionParams& p, CallTimer& timer) {
  const Device dev = d.device;
  const int64_t q_half = d.batch * d.chunk * d.q_width(), out_half = d.batch * d.chunk * d.out_width(),
                lse_half = d.batch * d.heads * d.chunk;
  auto pair = [&](int64_t n) { return std::array<Floats, 2>{Floats(n, dev), Floats(n, dev)}; };
  std::array<Floats, 2> q = pair(q_half), out = pair(out_half), dout = pair(out_half), lse = pair(lse_half),
                        dq = pair(q_half);
  const bool narrow = d.io != DType::f32;
  KvBlocks current(d, d.io), next(d, d.io), widened(d, DType::f32, narrow), mine(d, DType::f32),
      travelling(d, d.io), arrived(d, d.io);
  for (int h = 0; h < 2; ++h) {
    pack_half(d, p.q, p.q_stride, d.q_width(), h, q[h].data());
    pack_half(d, p.out, p.out_stride, d.out_width(), h, out[h].data());
    pack_half(d, p.dout, p.dout_stride, d.out_width(), h, dout[h].data());
    pack_lse(d, p.lse, h, lse[h].data());
    pack_half(d, p.k, p.k_stride, d.k_width(), h, current.k(h));
    pack_half(d, p.v, p.v_stride, d.v_width(), h, current.v(h));
    dq[h].zero();
  }
  Floats dq_b(q_half, dev), dk_b(d.batch * d.chunk * d.k_width(), dev),
      dv_b(d.batch * d.chunk * d.v_width(), dev);
  // The gradients of a rank's keys and values gather as they travel with them: what this rank adds to the
  // visiting ones (`mine`), summed into what the previous ranks added (`arrived`), passed on (`travelling`).
  std::pair<comm::Request, comm::Request> gradients;
  for (int step = 0; step < split.cp; ++step) {
    const int source = (split.rank - step + split.cp) % split.cp;
    std::pair<comm::Request, comm::Request> transfer;
    if (step + 1 < split.cp) {
      transfer = pass_on(cp, current.data, next.data, kKvTag);
      timer.sent(current.data.bytes());
    }
    const KvBlocks& kv = current.in_fp32(widened);
    mine.data.zero();
    for (int qi = 0; qi < 2; ++qi)
      for (int kh = 0; kh < 2; ++kh) {
        bool causal = false;
        int64_t offset = 0;
        if (!block(split, d, p.window, qi, source, kh, &causal, &offset)) continue;
        ops::AttentionParams a = block_params(d, p, q[qi].data(), kv.k(kh), kv.v(kh), causal, offset);
        a.out = out[qi].data(), a.lse = lse[qi].data();
        a.dout = dout[qi].data(), a.dout_stride = d.out_width();
        a.dq = dq_b.data(), a.dk = dk_b.data(), a.dv = dv_b.data();
        a.dq_stride = d.q_width(), a.dk_stride = d.k_width(), a.dv_stride = d.v_width();
        ops::attention_backward(a, dev);
        progress(transfer), progress(gradients);
        add_into(d, dq[qi].data(), dq_b.data(), dq_b.size());
        add_into(d, mine.k(kh), dk_b.data(), dk_b.size());
        add_into(d, mine.v(kh), dv_b.data(), dv_b.size());
      }
    timer.computed(true);
    finish(cp, gradients);  // the previous hop: travelling is free, arrived full
    timer.waited();
    if (step > 0) add_into(d, mine.data.data(), arrived.data.data(), mine.count());
    if (narrow)
      copy_into(d, travelling.data.data(), mine.data.data(), mine.count());
    else
      std::swap(travelling.data, mine.data);  // mine is zeroed again next step
    gradients = pass_on(cp, travelling.data, arrived.data, kGradientTag);
    timer.sent(travelling.data.bytes());
    timer.computed();
    finish(cp, transfer);
    timer.waited();
    std::swap(current.data, next.data);
  }
  // After cp hops every rank holds the whole gradient of its own keys and values.
  finish(cp, gradients);
  timer.waited();
  for (int h = 0; h < 2; ++h) {
    unpack_half(d, dq[h].data(), d.q_width(), h, p.dq, p.dq_stride);
    unpack_half(d, arrived.k(h), d.k_width(), h, p.dk, p.dk_stride);
    unpack_half(d, arrived.v(h), d.v_width(), h, p.dv, p.dv_stride);
  }
  timer.computed();
}

// All-to-all (Ulysses): the local tokens of every head group out to the group's rank, the whole sequence of
// this rank's head group back, in the attention's dtype (bf16 in a bf16 run: half the bytes, and the
// attention over the whole sequence is the one-rank bf16 kernel's); the log-sum-exp in fp32.
struct Ulysses {
  const ContextSplit& split;
  Dims d;
  CallTimer& timer;
  int64_t seq() const { return split.seq; }

  // q, k and v of this rank's heads over the whole sequence.
  struct Inputs {
    Buffer q, k, v;
  };
  Inputs gather_inputs(comm::Communicator& cp, const ops::AttentionParams& p) const {
    const int64_t hq = d.heads / split.cp, hk = d.kv_heads / split.cp;
    return {gather(cp, p.q, p.q_stride, hq * d.head_dim), gather(cp, p.k, p.k_stride, hk * d.head_dim),
            gather(cp, p.v, p.v_stride, hk * d.v_dim)};
  }

  // One all-to-all of `block` elements per rank, timed (all of it waited for: nothing computes meanwhile).
  void exchange(comm::Communicator& cp, const Buffer& send, Buffer& recv, int64_t block) const {
    timer.computed();
    comm::Request r = cp.all_to_all(send.data().get(), recv.data().get(), block, comm::type_of(send.dtype()));
    cp.wait_on_stream(r);
    timer.waited();
    timer.sent(block * (split.cp - 1) * static_cast<int64_t>(dtype_size(send.dtype())));
  }

  // x [batch, local, cp groups x cols] (rows `stride` apart) -> on rank j: the whole sequence
  // [batch, seq, cols] of column group j, gathered from every rank's local tokens, in x's dtype.
  Buffer gather(comm::Communicator& cp, ConstElements x, int64_t stride, int64_t cols) const {
    const int n = split.cp;
    const int64_t block = d.batch * d.local * cols;
    const DType dtype = x.dtype();
    Buffer send(n * block, dtype, d.device), recv(n * block, dtype, d.device);
    for (int j = 0; j < n; ++j)
      copy3(d.device, 1, d.batch * d.local, cols, x + j * cols, {0, stride, 1}, send.data() + j * block,
            {0, cols, 1});
    exchange(cp, send, recv, block);
    Buffer whole(d.batch * seq() * cols, dtype, d.device);
    for (int src = 0; src < n; ++src)
      for (int h = 0; h < 2; ++h)  // rank src's half h: chunk chunk_of(h, src) of every sequence
        copy3(d.device, d.batch, d.chunk, cols, recv.data() + src * block + h * d.chunk * cols,
              {d.local * cols, cols, 1}, whole.data() + split.chunk_of(h, src) * d.chunk * cols,
              {seq() * cols, cols, 1});
    return whole;
  }
  // The inverse: whole [batch, seq, cols] of this rank's group -> every rank's local tokens, into column
  // group `my group` of x [batch, local, cp x cols].
  void scatter(comm::Communicator& cp, const Buffer& whole, int64_t cols, Elements x, int64_t stride) const {
    const int n = split.cp;
    const int64_t block = d.batch * d.local * cols;
    Buffer send(n * block, whole.dtype(), d.device), recv(n * block, whole.dtype(), d.device);
    for (int dst = 0; dst < n; ++dst)
      for (int h = 0; h < 2; ++h)
        copy3(d.device, d.batch, d.chunk, cols, whole.data() + split.chunk_of(h, dst) * d.chunk * cols,
              {seq() * cols, cols, 1}, send.data() + dst * block + h * d.chunk * cols,
              {d.local * cols, cols, 1});
    exchange(cp, send, recv, block);
    for (int j = 0; j < n; ++j)
      copy3(d.device, 1, d.batch * d.local, cols, recv.data() + j * block, {0, cols, 1}, x + j * cols,
            {0, stride, 1});
  }
  // The log-sum-exp [batch, heads, local] <-> [batch, heads / cp, seq] of this rank's heads: as rows of one
  // value per (token, head), transposed through the same exchanges.
  Floats lse_rows(const float* lse) const {  // -> [batch, local, heads]
    Floats rows(d.batch * d.local * d.heads, d.device);
    copy3(d.device, d.batch, d.heads, d.local, lse, {d.heads * d.local, d.local, 1}, rows.data(),
          {d.local * d.heads, 1, d.heads});
    return rows;
  }
  void rows_to_lse(const Buffer& rows, float* lse) const {
    copy3(d.device, d.batch, d.heads, d.local, rows.data(), {d.local * d.heads, 1, d.heads}, lse,
          {d.heads * d.local, d.local, 1});
  }
  // whole-sequence [batch, seq, group heads] <-> the kernel's [batch, group heads, seq].
  Buffer transpose(const Buffer& x, int64_t heads, bool to_heads_major) const {
    Buffer y(x.size(), x.dtype(), d.device);
    const Strides token_major{seq() * heads, 1, heads}, head_major{heads * seq(), seq(), 1};
    copy3(d.device, d.batch, heads, seq(), x.data(), to_heads_major ? token_major : head_major, y.data(),
          to_heads_major ? head_major : token_major);
    return y;
  }

  ops::AttentionParams whole_params(const ops::AttentionParams& p, ConstElements q, ConstElements k,
                                    ConstElements v) const {
    const int n = split.cp;
    ops::AttentionParams a;
    a.batch = d.batch, a.seq = seq(), a.heads = d.heads / n, a.kv_heads = d.kv_heads / n;
    a.head_dim = d.head_dim, a.v_head_dim = d.v_dim;
    a.q = q, a.k = k, a.v = v;
    a.q_stride = a.heads * d.head_dim, a.k_stride = a.kv_heads * d.head_dim,
    a.v_stride = a.kv_heads * d.v_dim;
    a.out_stride = a.heads * d.v_dim;
    a.scale = p.scale;
    a.causal = true;
    a.window = p.window;  // whole sequences in order: the window applies as it is
    a.softcap = p.softcap;
    return a;
  }
};

void check_heads(const ContextSplit& split, const Dims& d) {
  if (d.heads % split.cp != 0 || d.kv_heads % split.cp != 0)
    fail(
        "context attention all_to_all: {} heads and {} kv heads must each divide by parallel.cp = {} (each "
        "rank takes heads / cp of them); use the ring",
        d.heads, d.kv_heads, split.cp);
}

void all_to_all_forward(comm::Communicator& cp, const ContextSplit& split, const Dims& d,
                        const ops::AttentionParams& p, CallTimer& timer) {
  const Ulysses u{split, d, timer};
  const int64_t hq = d.heads / split.cp;
  const Ulysses::Inputs in = u.gather_inputs(cp, p);
  const Buffer &q = in.q, &k = in.k, &v = in.v;
  Buffer out(d.batch * split.seq * hq * d.v_dim, d.io, d.device);
  Floats lse(d.batch * hq * split.seq, d.device);
  ops::AttentionParams a = u.whole_params(p, q.data(), k.data(), v.data());
  a.out = out.data(), a.lse = lse.data();
  ops::attention_forward(a, d.device);
  u.scatter(cp, out, hq * d.v_dim, p.out, p.out_stride);
  if (p.lse) {
    Floats rows(d.batch * d.local * d.heads, d.device);
    u.scatter(cp, u.transpose(lse, hq, false), hq, rows.data(), d.heads);
    u.rows_to_lse(rows, p.lse);
  }
}

void all_to_all_backward(comm::Communicator& cp, const ContextSplit& split, const Dims& d,
                         const ops::AttentionParams& p, CallTimer& timer) {
  const Ulysses u{split, d, timer};
  const int64_t hq = d.heads / split.cp, hk = d.kv_heads / split.cp;
  const Ulysses::Inputs in = u.gather_inputs(cp, p);
  const Buffer &q = in.q, &k = in.k, &v = in.v;
  const Buffer dout = u.gather(cp, p.dout, p.dout_stride, hq * d.v_dim);
  Buffer out = u.gather(cp, p.out, p.out_stride, hq * d.v_dim);
  const Floats rows = u.lse_rows(p.lse);
  Buffer lse = u.transpose(u.gather(cp, rows.data(), d.heads, hq), hq, true);
  Buffer dq(q.size(), d.io, d.device), dk(k.size(), d.io, d.device), dv(v.size(), d.io, d.device);
  ops::AttentionParams a = u.whole_params(p, q.data(), k.data(), v.data());
  a.out = out.data(), a.lse = lse.data().f32();
  a.dout = dout.data(), a.dout_stride = hq * d.v_dim;
  a.dq = dq.data(), a.dk = dk.data(), a.dv = dv.data();
  a.dq_stride = a.q_stride, a.dk_stride = a.k_stride, a.dv_stride = a.v_stride;
  ops::attention_backward(a, d.device);
  u.scatter(cp, dq, hq * d.head_dim, p.dq, p.dq_stride);
  u.scatter(cp, dk, hk * d.head_dim, p.dk, p.dk_stride);
  u.scatter(cp, dv, hk * d.v_dim, p.dv, p.dv_stride);
}

}  // namespace

void context_attention_forward(comm::Communicator& cp, const ContextSplit& split, ContextAttention mode,
                               const ops::AttentionParams& p, ContextAttentionStats* stats, Device device) {
  const Dims d = check(cp, split, p, device, "context attention forward");
  CallTimer timer(stats);
  if (split.cp == 1) {  // chunk 0 then chunk 1: the sequence in order
    ops::attention_forward(p, device);
  } else if (mode == ContextAttention::ring) {
    ring_forward(cp, split, d, p, timer);
  } else {
    check_heads(split, d);
    all_to_all_forward(cp, split, d, p, timer);
  }
  timer.computed();
}

void context_attention_backward(comm::Communicator& cp, const ContextSplit& split, ContextAttention mode,
                                const ops::AttentionParams& p, ContextAttentionStats* stats, Device device) {
  const Dims d = check(cp, split, p, device, "context attention backward");
  FORGE_CHECK(p.dout && p.dq && p.dk && p.dv && p.lse,
              "context attention backward: dout, dq, dk, dv and lse");
  CallTimer timer(stats);
  if (split.cp == 1) {
    ops::attention_backward(p, device);
  } else if (mode == ContextAttention::ring) {
    ring_backward(cp, split, d, p, timer);
  } else {
    check_heads(split, d);
    all_to_all_backward(cp, split, d, p, timer);
  }
  timer.computed();
}

}  // namespace forge::parallel
