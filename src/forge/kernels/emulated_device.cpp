#include "forge/kernels/emulated_device.h"

#include <execinfo.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "forge/core/caching_allocator.h"
#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/memory.h"
#include "forge/kernels/host_memory.h"
#include "forge/kernels/ops.h"

#ifdef FORGE_HAVE_CUDA
#include "forge/kernels/cuda/cuda_kernels.h"
#endif

namespace forge {
namespace {

struct Allocation {
  size_t bytes = 0;    // asked for
  size_t mapped = 0;   // whole pages
  size_t counted = 0;  // in live_bytes: bytes, or the caching allocator's block (count_rounded)
};

struct State {
  std::recursive_mutex mutex;
  std::map<uintptr_t, Allocation> allocations;  // by base address
  int open = 0;                                 // nested windows (an op inside which a copy runs, ...)
  bool dry = false;                             // EmulatedDevice::Mode::check_only
  bool rounded = false;                         // EmulatedDevice::count_rounded
  int64_t live_bytes = 0, peak_bytes = 0, ops = 0;
  EmulatedDevice::Traffic traffic;
  // A dry run's answers: what the host reads back from a device buffer (by base address) instead of zeros.
  std::map<uintptr_t, std::vector<char>> answers;
  std::map<uintptr_t, size_t> pinned;  // pinned host ranges (DeviceMemory::pin_host), by address
  struct sigaction previous_segv {
  }, previous_bus{};
};

State* g_state = nullptr;
constexpr int kEmulatedDevices = 8;
std::atomic<bool> g_active{false};

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

void protect_all(State& s, int prot) {
  for (const auto& [base, a] : s.allocations)
    if (::mprotect(reinterpret_cast<void*>(base), a.mapped, prot) != 0)
      fail("device emulation: mprotect failed: {}", std::strerror(errno));
}

// Device memory is open to the host while windows are open (ops, copies, memsets, EmulatedDevice::Access).
// A dry run never opens device memory: nothing reads or writes it (its pages are never even committed).
void open_window() {
  std::lock_guard lock(g_state->mutex);
  if (g_state->open++ == 0 && !g_state->dry) protect_all(*g_state, PROT_READ | PROT_WRITE);
}

void close_window() noexcept {
  std::lock_guard lock(g_state->mutex);
  if (--g_state->open == 0 && !g_state->dry) {
    try {
      protect_all(*g_state, PROT_NONE);
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::abort();
    }
  }
}

class Window {
 public:
  Window() { open_window(); }
  ~Window() { close_window(); }
};

// The allocation holding `address`, or null.
const Allocation* find(State& s, uintptr_t address, uintptr_t* base_out = nullptr) {
  auto it = s.allocations.upper_bound(address);
  if (it == s.allocations.begin()) return nullptr;
  --it;
  if (address >= it->first + it->second.mapped) return nullptr;
  if (base_out) *base_out = it->first;
  return &it->second;
}

// Every pointer handed to a device op must be null or device memory.
void check(const void* p, const char* op, const char* field) {
  if (p == nullptr) return;
  std::lock_guard lock(g_state->mutex);
  if (!find(*g_state, reinterpret_cast<uintptr_t>(p)))
    fail("{} on the emulated device: {} = {} is not device memory (a host pointer handed to a device op)", op,
         field, p);
}

template <bool kConst>
void check(const ElementPtr<kConst>& p, const char* op, const char* field) {
  check(p.get(), op, field);
}

#define FORGE_CHECK_FIELD(op, params, field) check((params).field, op, #field)

void check_args(const char* op, const ops::GemmParams& p) {
  FORGE_CHECK_FIELD(op, p, a), FORGE_CHECK_FIELD(op, p, b), FORGE_CHECK_FIELD(op, p, c);
}
void check_args(const char* op, const ops::Fp8GemmParams& p) {
  FORGE_CHECK_FIELD(op, p, a), FORGE_CHECK_FIELD(op, p, b), FORGE_CHECK_FIELD(op, p, c);
  FORGE_CHECK_FIELD(op, p, a_scale_inv_ptr), FORGE_CHECK_FIELD(op, p, b_scale_inv_ptr);
  FORGE_CHECK_FIELD(op, p, a_scales), FORGE_CHECK_FIELD(op, p, b_scales);
}
void check_args(const char* op, const ops::RmsNormParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, weight), FORGE_CHECK_FIELD(op, p, y);
  FORGE_CHECK_FIELD(op, p, rstd), FORGE_CHECK_FIELD(op, p, dy), FORGE_CHECK_FIELD(op, p, dx);
  FORGE_CHECK_FIELD(op, p, dweight);
}
void check_args(const char* op, const ops::RopeParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, cos), FORGE_CHECK_FIELD(op, p, sin);
}
void check_args(const char* op, const ops::SwigluParams& p) {
  FORGE_CHECK_FIELD(op, p, gate_up), FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, dout);
  FORGE_CHECK_FIELD(op, p, dgate_up);
}
void check_args(const char* op, const ops::DropoutParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, y), FORGE_CHECK_FIELD(op, p, positions);
}
void check_args(const char* op, const ops::LayerNormParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, weight), FORGE_CHECK_FIELD(op, p, bias);
  FORGE_CHECK_FIELD(op, p, y), FORGE_CHECK_FIELD(op, p, mean), FORGE_CHECK_FIELD(op, p, rstd);
  FORGE_CHECK_FIELD(op, p, dy), FORGE_CHECK_FIELD(op, p, dx), FORGE_CHECK_FIELD(op, p, dweight);
  FORGE_CHECK_FIELD(op, p, dbias);
}
void check_args(const char* op, const ops::GeluParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, dy);
  FORGE_CHECK_FIELD(op, p, dx);
}
void check_args(const char* op, const ops::BiasParams& p) {
  FORGE_CHECK_FIELD(op, p, y), FORGE_CHECK_FIELD(op, p, bias), FORGE_CHECK_FIELD(op, p, dy);
  FORGE_CHECK_FIELD(op, p, dbias);
}
void check_args(const char* op, const ops::AttentionParams& p) {
  FORGE_CHECK_FIELD(op, p, q), FORGE_CHECK_FIELD(op, p, k), FORGE_CHECK_FIELD(op, p, v);
  FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, lse), FORGE_CHECK_FIELD(op, p, dout);
  FORGE_CHECK_FIELD(op, p, dq), FORGE_CHECK_FIELD(op, p, dk), FORGE_CHECK_FIELD(op, p, dv);
}
void check_args(const char* op, const ops::EmbeddingParams& p) {
  FORGE_CHECK_FIELD(op, p, ids), FORGE_CHECK_FIELD(op, p, weight), FORGE_CHECK_FIELD(op, p, out);
  FORGE_CHECK_FIELD(op, p, dout), FORGE_CHECK_FIELD(op, p, dweight);
}
void check_args(const char* op, const ops::LinearCrossEntropyParams& p) {
  FORGE_CHECK_FIELD(op, p, hidden_gemm), FORGE_CHECK_FIELD(op, p, weight_gemm),
      FORGE_CHECK_FIELD(op, p, targets);
  FORGE_CHECK_FIELD(op, p, lse), FORGE_CHECK_FIELD(op, p, loss), FORGE_CHECK_FIELD(op, p, dhidden);
  FORGE_CHECK_FIELD(op, p, dweight), FORGE_CHECK_FIELD(op, p, workspace),
      FORGE_CHECK_FIELD(op, p, target_logit);
  FORGE_CHECK_FIELD(op, p, max_logit);
}
void check_args(const char* op, const ops::AdamWParams& p) {
  FORGE_CHECK_FIELD(op, p, param), FORGE_CHECK_FIELD(op, p, grad), FORGE_CHECK_FIELD(op, p, exp_avg);
  FORGE_CHECK_FIELD(op, p, exp_avg_sq), FORGE_CHECK_FIELD(op, p, param_bf16);
}
void check_args(const char* op, const ops::Fp8CastParams& p) {
  FORGE_CHECK_FIELD(op, p, x), FORGE_CHECK_FIELD(op, p, amax_accumulate), FORGE_CHECK_FIELD(op, p, amax_in);
  FORGE_CHECK_FIELD(op, p, scale_out), FORGE_CHECK_FIELD(op, p, scale_inv_out), FORGE_CHECK_FIELD(op, p, q);
  FORGE_CHECK_FIELD(op, p, q_t), FORGE_CHECK_FIELD(op, p, scale_inv), FORGE_CHECK_FIELD(op, p, scale_inv_t);
}
void check_args(const char* op, const ops::KvAppendParams& p) {
  FORGE_CHECK_FIELD(op, p, qkv), FORGE_CHECK_FIELD(op, p, keys), FORGE_CHECK_FIELD(op, p, values);
}
void check_args(const char* op, const ops::AttentionMergeParams& p) {
  FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, lse), FORGE_CHECK_FIELD(op, p, out_b);
  FORGE_CHECK_FIELD(op, p, lse_b);
}
void check_args(const char* op, const ops::StridedCopyParams& p) {
  FORGE_CHECK_FIELD(op, p, src), FORGE_CHECK_FIELD(op, p, dst);
}
void check_args(const char* op, const ops::MoeRouterParams& p) {
  FORGE_CHECK_FIELD(op, p, logits), FORGE_CHECK_FIELD(op, p, bias), FORGE_CHECK_FIELD(op, p, expert_ids);
  FORGE_CHECK_FIELD(op, p, weights), FORGE_CHECK_FIELD(op, p, scores), FORGE_CHECK_FIELD(op, p, score_sums);
  FORGE_CHECK_FIELD(op, p, expert_fraction), FORGE_CHECK_FIELD(op, p, balance_loss);
  FORGE_CHECK_FIELD(op, p, aux_fraction), FORGE_CHECK_FIELD(op, p, aux_loss);
  FORGE_CHECK_FIELD(op, p, dweights), FORGE_CHECK_FIELD(op, p, dlogits);
}
void check_args(const char* op, const ops::MoeSortParams& p) {
  FORGE_CHECK_FIELD(op, p, expert_ids), FORGE_CHECK_FIELD(op, p, row_of), FORGE_CHECK_FIELD(op, p, source);
  FORGE_CHECK_FIELD(op, p, offsets), FORGE_CHECK_FIELD(op, p, counts);
}
void check_args(const char* op, const ops::MoePermuteParams& p) {
  FORGE_CHECK_FIELD(op, p, row_of), FORGE_CHECK_FIELD(op, p, source), FORGE_CHECK_FIELD(op, p, x);
  FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, dout), FORGE_CHECK_FIELD(op, p, dx);
}
void check_args(const char* op, const ops::MoeUnpermuteParams& p) {
  FORGE_CHECK_FIELD(op, p, row_of), FORGE_CHECK_FIELD(op, p, source), FORGE_CHECK_FIELD(op, p, weights);
  FORGE_CHECK_FIELD(op, p, y), FORGE_CHECK_FIELD(op, p, out), FORGE_CHECK_FIELD(op, p, dout);
  FORGE_CHECK_FIELD(op, p, dy), FORGE_CHECK_FIELD(op, p, dweights);
}
// The grouped GEMMs' offsets are host memory (the host loops over the groups): device memory there is the
// error, which the emulation's open window would otherwise let the CPU kernel read.
void check_args(const char* op, const ops::GroupedGemmParams& p) {
  FORGE_CHECK_FIELD(op, p, a), FORGE_CHECK_FIELD(op, p, b), FORGE_CHECK_FIELD(op, p, c);
  std::lock_guard lock(g_state->mutex);
  if (p.offsets && find(*g_state, reinterpret_cast<uintptr_t>(p.offsets)))
    fail(
        "{} on the emulated device: offsets = {} is device memory; the grouped GEMMs take their offsets in "
        "host "
        "memory",
        op, static_cast<const void*>(p.offsets));
}
#undef FORGE_CHECK_FIELD

// The loose arguments of the element-wise ops: every pointer is device memory, sizes and scalars pass.
template <typename T>
void check_arg(const char* op, int index, T* p) {
  static const char* const kNames[] = {"argument 1", "argument 2", "argument 3", "argument 4"};
  check(p, op, kNames[index]);
}
template <bool kConst>
void check_arg(const char* op, int index, ElementPtr<kConst> p) {
  check_arg(op, index, p.get());
}
template <typename T>
void check_arg(const char*, int, const T&) {}

template <typename... A>
void check_args(const char* op, A... args) {
  int index = 0;
  (check_arg(op, index++, args), ...);
}

// The parameters an op on the emulated device takes: what the CUDA backend takes (in builds that have it: a
// GPU would refuse the rest), and what the CPU kernel that runs it takes.
#ifdef FORGE_HAVE_CUDA
#define FORGE_EMULATED_CUDA_SUPPORTS(name, args) cuda::supports_##name FORGE_OP_APPEND(args, reason)&&
#else
#define FORGE_EMULATED_CUDA_SUPPORTS(name, args)
#endif
#define FORGE_EMULATED_SUPPORTS(name, result, params, args)                                           \
  bool supports_##name FORGE_OP_APPEND(params, std::string* reason) {                                 \
    return FORGE_EMULATED_CUDA_SUPPORTS(name, args) ops::cpu_table().supports_##name FORGE_OP_APPEND( \
        args, reason);                                                                                \
  }
FORGE_OPS(FORGE_EMULATED_SUPPORTS)
#undef FORGE_EMULATED_SUPPORTS
#undef FORGE_EMULATED_CUDA_SUPPORTS

// Whether a call makes the host wait for its result (Traffic::host_results): every op that returns a value to
// the host, except a cast whose amax goes into device memory or which takes its scale there.
template <ops::OpId Id>
using Op = std::integral_constant<ops::OpId, Id>;
template <ops::OpId Id, typename... A>
bool awaits_result(Op<Id>, const A&...) {
  return true;
}
bool awaits_result(Op<ops::OpId::fp8_cast_transpose>, const ops::Fp8CastParams& p) {
  return !p.amax_accumulate && !p.amax_in;
}

// What a dry op answers where the host reads its result back: zeros (nothing is kept), except what routes
// tokens to experts, which answers as a perfectly balanced router would, so that a dry step (the simulator's
// traces, sim/trace.h) runs the expert GEMMs, the dispatch and the host's bookkeeping of a balanced step
// rather than none at all: the router's assignments go round the experts (token t's j-th choice is expert
// (t * top_k + j) mod experts) with uniform scores (1 / experts each, summing to 1 per token); the expert
// sort's offsets spread the assignments evenly the same way (the first experts taking the remainder), each
// segment capped at the capacity and padded as the sort pads it. The sort's counts still read back as zeros.
template <ops::OpId Id, typename... A>
void answer(Op<Id>, const A&...) {}
// The answer for the n values of type T at `device`: value_at(i) each.
template <typename T, typename F>
void answer_array(void* device, int64_t n, F value_at) {
  if (!device) return;
  std::lock_guard lock(g_state->mutex);
  std::vector<char>& bytes = g_state->answers[reinterpret_cast<uintptr_t>(device)];
  bytes.assign(static_cast<size_t>(n) * sizeof(T), 0);
  for (int64_t i = 0; i < n; ++i) reinterpret_cast<T*>(bytes.data())[i] = value_at(i);
}
void answer(Op<ops::OpId::moe_router_forward>, const ops::MoeRouterParams& p) {
  const int64_t experts = std::max<int64_t>(1, p.experts);
  answer_array<int32_t>(p.expert_ids, p.tokens * p.top_k,
                        [&](int64_t a) { return static_cast<int32_t>(a % experts); });
  answer_array<float>(p.scores, p.tokens * p.experts,
                      [&](int64_t) { return 1.0f / static_cast<float>(experts); });
  answer_array<float>(p.score_sums, p.tokens, [](int64_t) { return 1.0f; });
}
void answer(Op<ops::OpId::moe_sort_by_expert>, const ops::MoeSortParams& q) {
  if (!q.offsets) return;
  std::lock_guard lock(g_state->mutex);
  std::vector<char>& bytes = g_state->answers[reinterpret_cast<uintptr_t>(q.offsets)];
  bytes.assign(static_cast<size_t>(q.experts + 1) * sizeof(int64_t), 0);
  auto* offsets = reinterpret_cast<int64_t*>(bytes.data());
  const int64_t total = q.tokens * q.top_k;
  for (int64_t e = 0; e < q.experts; ++e) {
    int64_t kept = total / q.experts + (e < total % q.experts ? 1 : 0);
    if (q.capacity > 0) kept = std::min(kept, q.capacity);
    offsets[e + 1] = offsets[e] + ops::moe_segment_rows(q, kept);
  }
}

// A dry answer no longer holds once its memory is written or freed.
void forget_answers(const void* p, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(p);
  std::lock_guard lock(g_state->mutex);
  auto it = g_state->answers.lower_bound(first);
  while (it != g_state->answers.end() && it->first < first + std::max<size_t>(bytes, 1))
    it = g_state->answers.erase(it);
}

// One op of the emulated table: its pointers and parameters checked, then the CPU kernel with device memory
// open (a dry run: its answer, nothing computed).
template <ops::OpId Id, auto Member, auto Supports, typename... A>
auto guarded(const A&... args) {
  using Result = decltype((ops::cpu_table().*Member)(args...));
  if constexpr (!std::is_void_v<Result>)
    g_state->traffic.host_results += awaits_result(Op<Id>{}, args...) ? 1 : 0;
  const char* op = ops::op_name(Id);
  check_args(op, args...);
  if (std::string why; !Supports(args..., &why)) fail("{}", why);
  ++g_state->ops;
  if (g_state->dry) {  // checked, not run: sums and amaxes read as 0
    answer(Op<Id>{}, args...);
    return Result();
  }
  Window window;
  return (ops::cpu_table().*Member)(args...);
}

const ops::OpTable& emulated_table() {
#define FORGE_EMULATED_ENTRY(name, result, params, args)                        \
  .name = [] params -> result {                                                 \
    return guarded<ops::OpId::name, &ops::OpTable::name, supports_##name> args; \
  },                                                                            \
  .supports_##name = supports_##name,
  static const ops::OpTable table = {.name = "emulated cuda", FORGE_OPS(FORGE_EMULATED_ENTRY)};
#undef FORGE_EMULATED_ENTRY
  return table;
}

// The emulated memory interface.
void* emulated_alloc(size_t bytes) {
  const size_t mapped = (std::max<size_t>(bytes, 1) + page_size() - 1) / page_size() * page_size();
  void* p = ::mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("device emulation: cannot map {} bytes: {}", bytes, std::strerror(errno));
  std::lock_guard lock(g_state->mutex);
  // Inside an open window the new allocation opens too (an op's output allocated by a copy in progress).
  if (g_state->open > 0) ::mprotect(p, mapped, PROT_READ | PROT_WRITE);
  const size_t counted = g_state->rounded ? CachingAllocator::round_size(bytes) : bytes;
  g_state->allocations[reinterpret_cast<uintptr_t>(p)] = Allocation{bytes, mapped, counted};
  g_state->live_bytes += static_cast<int64_t>(counted);
  g_state->peak_bytes = std::max(g_state->peak_bytes, g_state->live_bytes);
  return p;
}

void emulated_free(void* p) {
  if (!p) return;
  std::lock_guard lock(g_state->mutex);
  auto it = g_state->allocations.find(reinterpret_cast<uintptr_t>(p));
  FORGE_CHECK(it != g_state->allocations.end(), "device emulation: free of {}, which is no allocation's base",
              p);
  ::munmap(p, it->second.mapped);
  forget_answers(p, it->second.mapped);
  g_state->live_bytes -= static_cast<int64_t>(it->second.counted);
  g_state->allocations.erase(it);
}

void emulated_zero(void* p, size_t bytes) {
  check(p, "device memset", "destination");
  if (g_state->dry) return forget_answers(p, bytes);
  Window window;
  std::memset(p, 0, bytes);
}

void emulated_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (dst_device != Device::cpu) check(dst, "device copy", "destination");
  if (src_device != Device::cpu) check(src, "device copy", "source");
  EmulatedDevice::Traffic& t = g_state->traffic;
  (dst_device == Device::cpu ? t.to_host : src_device == Device::cpu ? t.to_device : t.device_to_device) += 1;
  if (g_state->dry) {
    if (dst_device != Device::cpu) return forget_answers(dst, bytes);
    // What the host reads back: an op's answer, or zeros.
    std::lock_guard lock(g_state->mutex);
    const auto answer = g_state->answers.find(reinterpret_cast<uintptr_t>(src));
    if (src_device != Device::cpu && answer != g_state->answers.end() && answer->second.size() >= bytes)
      std::memcpy(dst, answer->second.data(), bytes);
    else
      std::memset(dst, 0, bytes);
    return;
  }
  Window window;
  std::memmove(dst, src, bytes);
}

const DeviceMemory& emulated_memory() {
  static const DeviceMemory memory{
      "cuda",
      emulated_alloc,
      emulated_free,
      emulated_zero,
      emulated_copy,
      [] { g_state->traffic.synchronizations += 1; },
      [] { return kEmulatedDevices; },
      [](int ordinal) {
        if (ordinal < 0 || ordinal >= kEmulatedDevices)
          fail("device emulation: devices 0..{}, asked for {}", kEmulatedDevices - 1, ordinal);
      },
      [] { return static_cast<void*>(nullptr); },
      [] {
        std::lock_guard lock(g_state->mutex);
        return g_state->peak_bytes;
      },
      [] {
        std::lock_guard lock(g_state->mutex);
        g_state->peak_bytes = g_state->live_bytes;
      },
      // Pinning: what the CUDA runtime refuses (device memory, a range pinned twice, unpinning what is not
      // pinned) fails here too.
      [](void* p, size_t bytes) {
        std::lock_guard lock(g_state->mutex);
        const auto at = reinterpret_cast<uintptr_t>(p);
        if (!p || bytes == 0 || find(*g_state, at) != nullptr)
          fail("device emulation: pin_host of {} ({} bytes): not a host range", p, bytes);
        if (!g_state->pinned.emplace(at, bytes).second)
          fail("device emulation: pin_host of {}: already pinned", p);
      },
      [](void* p) {
        std::lock_guard lock(g_state->mutex);
        if (g_state->pinned.erase(reinterpret_cast<uintptr_t>(p)) == 0)
          fail("device emulation: unpin_host of {}: not pinned", p);
      },
  };
  return memory;
}

// A host access to device memory faults here: name it, show where it came from, then die as the fault would.
void on_fault(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  uintptr_t base = 0;
  const Allocation* a = g_state ? find(*g_state, address, &base) : nullptr;
  if (a) {
    char line[256];
    const int n = std::snprintf(line, sizeof line,
                                "device emulation: host code touched device memory at %p (byte %zu of an "
                                "allocation of %zu bytes at %p) outside a device op or copy; backtrace:\n",
                                info->si_addr, static_cast<size_t>(address - base), a->bytes,
                                reinterpret_cast<void*>(base));
    if (n > 0) (void)!::write(STDERR_FILENO, line, static_cast<size_t>(n));
    void* frames[48];
    ::backtrace_symbols_fd(frames, ::backtrace(frames, 48), STDERR_FILENO);
  }
  // Hand the fault to whoever handled it before (the default: end the process with the signal).
  const struct sigaction& previous = signal == SIGSEGV ? g_state->previous_segv : g_state->previous_bus;
  if (previous.sa_flags & SA_SIGINFO) {
    if (previous.sa_sigaction) return previous.sa_sigaction(signal, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler) {
    return previous.sa_handler(signal);
  }
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

}  // namespace

EmulatedDevice::EmulatedDevice(Mode mode) {
  if (g_active.exchange(true)) fail("device emulation: one is already active");
  g_state = new State();
  g_state->dry = mode == Mode::check_only;
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGSEGV, &action, &g_state->previous_segv);
  ::sigaction(SIGBUS, &action, &g_state->previous_bus);
  override_device_memory(Device::cuda, &emulated_memory());
  ops::override_table(Device::cuda, &emulated_table());
}

EmulatedDevice::~EmulatedDevice() {
  ops::override_table(Device::cuda, nullptr);
  override_device_memory(Device::cuda, nullptr);
  ::sigaction(SIGSEGV, &g_state->previous_segv, nullptr);
  ::sigaction(SIGBUS, &g_state->previous_bus, nullptr);
  if (!g_state->allocations.empty()) {
    // Tensors that outlive the emulation will hand their pointers to the real backend, which never made them:
    // a misuse of this test tool. Say so; keep the mappings.
    std::fprintf(stderr, "device emulation: %zu device allocations outlive it (leaked)\n",
                 g_state->allocations.size());
  } else {
    delete g_state;
  }
  g_state = nullptr;
  g_active.store(false);
}

int64_t EmulatedDevice::live_allocations() {
  if (!g_state) return 0;
  std::lock_guard lock(g_state->mutex);
  return static_cast<int64_t>(g_state->allocations.size());
}

int64_t EmulatedDevice::ops_run() { return g_state ? g_state->ops : 0; }

bool EmulatedDevice::check_only() { return g_state && g_state->dry; }

int64_t model_host_memory_bytes() {
  // A dry run initialises nothing on the host: a model of any size may be built.
  return EmulatedDevice::check_only() ? std::numeric_limits<int64_t>::max() : host_memory_bytes();
}

bool EmulatedDevice::count_rounded(bool on) {
  FORGE_CHECK(g_state, "device emulation: count_rounded() without an active emulation");
  std::lock_guard lock(g_state->mutex);
  FORGE_CHECK(g_state->allocations.empty() || g_state->rounded == on,
              "device emulation: count_rounded({}) with {} allocations alive counted the other way", on,
              g_state->allocations.size());
  return std::exchange(g_state->rounded, on);
}

int64_t EmulatedDevice::peak_bytes() {
  if (!g_state) return 0;
  std::lock_guard lock(g_state->mutex);
  return g_state->peak_bytes;
}

EmulatedDevice::Traffic EmulatedDevice::traffic() { return g_state ? g_state->traffic : Traffic{}; }

int64_t EmulatedDevice::pinned_bytes() {
  if (!g_state) return 0;
  std::lock_guard lock(g_state->mutex);
  int64_t total = 0;
  for (const auto& [at, bytes] : g_state->pinned) total += static_cast<int64_t>(bytes);
  return total;
}

bool EmulatedDevice::is_device_memory(const void* p) {
  if (!g_state || !p) return false;
  std::lock_guard lock(g_state->mutex);
  return find(*g_state, reinterpret_cast<uintptr_t>(p)) != nullptr;
}

EmulatedDevice::Access::Access() {
  FORGE_CHECK(g_state != nullptr, "EmulatedDevice::Access without an active emulation");
  open_window();
}

EmulatedDevice::Access::~Access() { close_window(); }

}  // namespace forge
