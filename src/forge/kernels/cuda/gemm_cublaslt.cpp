// GEMMs through cuBLASLt, with exactly the semantics of ops::GemmParams / ops::Fp8GemmParams (kernels/ops.h).
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major [r,c] matrix with leading dimension ld
// is the column-major [c,r] matrix with the same ld. So forge's C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T: cuBLASLt's "A" is forge's B and its "B" is forge's A, m and n swap, and each
// operand keeps its own transpose flag (a row-major [k,n] B is column-major [n,k], which is op(B)^T already).
//
//   forge                   cuBLASLt
//   B stored [k,n]          A: [n,k] column-major, ld = ldb, op N
//   B stored [n,k] trans_b  A: [k,n] column-major, ld = ldb, op T
//   A stored [m,k]          B: [k,m] column-major, ld = lda, op N
//   A stored [k,m] trans_a  B: [m,k] column-major, ld = lda, op T
//   C [m,n], ldc            C = D: [n,m] column-major, ld = ldc (D written in place over C)
//
// fp32 operands run with CUBLAS_COMPUTE_32F (exact fp32 SGEMM: TF32 would need COMPUTE_32F_FAST_TF32); bf16
// operands with fp32 accumulation and fp32 or bf16 C/D (GemmParams::c_dtype). C and D always share one type
// and layout (D is written over C); with a bf16 D, cuBLASLt computes alpha * acc + beta * C in the fp32 scale
// type and rounds once on the store (the heuristic may pick split-K only with fp32 reductions, so that no
// partial sum is rounded to bf16 on the way). cuBLASLt has no fp32 x fp32 -> bf16 matmul under COMPUTE_32F,
// and ops.h refuses that pairing on every backend.
//
// FP8 (per-tensor scaling): Hopper's FP8 tensor cores take both operands K-major, which cuBLASLt calls "TN"
// (its A transposed, its B not). Under the mapping above that is forge's NT orientation, trans_a = false and
// trans_b = true: A stored [m,k], B stored [n,k] -- the forward GEMM y = x W^T. The other orientations fail
// with a message naming the orientation; the FP8 Linear must hand them K-major copies:
//   backward_input   dx = dy W       needs W^T stored [in,out] (a transposed FP8 copy of the weight);
//   backward_weight  dW = dy^T x     needs dy^T stored [out,tokens] and x^T stored [in,tokens] (a fused
//                                    cast+transpose, which fp8/ already has for the CPU).
// Types: E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3 (E5M2 x E5M2 has no tensor-core instruction), D = C = fp32 or
// D = C = bf16 (cuBLASLt's FP8 table: an fp32 C only with an fp32 D; a bf16 C with a bf16 D, or an FP8 D that
// ops does not offer), compute and scale type fp32. FP8 matmuls need 16-byte alignment of every matrix: a and
// b 16-byte aligned with lda and ldb multiples of 16 (checked), and a bf16 C 16-byte aligned with ldc a
// multiple of 8 (16-byte rows; checked). An fp32 C is left to the heuristic, which says when it has no
// algorithm for the C it is given.
// The dequantisation scales travel as cuBLASLt's A/B scale pointers, which must be device floats, and
// 16-byte aligned: cuBLASLt 13.1 on an H200 answered CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul (after
// its heuristic had offered algorithms, since it does not look at the pointers) for scale pointers 4 or 8
// bytes past a 512-byte boundary, and ran them 0, 16, 32, ... 256 bytes past it (measured 2026-12-04); this
// code gives it kScaleAlignment-byte aligned pointers only. A scale_inv already in device memory
// (Fp8GemmParams::a_scale_inv_ptr / b_scale_inv_ptr: current scaling computes its scales on the device) is
// pointed at directly when so aligned, and otherwise copied (4 bytes, device to device, in stream order) to a
// scratch slot of its own; a host value goes to another slot, written in stream order (cuMemsetD32Async,
// which takes the value itself, so no host memory has to outlive the call) and only when it changes. The
// pointers are set on the cached descriptor per call (a host-side attribute write, skipped when unchanged;
// the descriptor is read when cublasLtMatmul enqueues, under the engine's mutex). Because cuBLASLt's A is
// forge's B, A_SCALE_POINTER points to b's scale_inv and B_SCALE_POINTER to a's. FAST_ACCUM is
// Fp8GemmParams::fast_accumulation (part of the plan): off, cuBLASLt promotes the tensor cores' partial sums
// to fp32 periodically. Within such an interval Hopper accumulates FP8 products in less than fp32 precision,
// so on arbitrary data results match the emulated CPU GEMM to a few 2^-13 of the summed magnitudes, and
// exactly (up to fp32 rounding of the scales) only while the partial sums are small integers (an E4M3 x E5M2
// case with integer codes was 2^-15.5 of its magnitudes off on an H200); on, nothing is promoted
// (TransformerEngine's forward). No amax epilogue: with FP8 inputs cuBLASLt computes AMAX_D only for FP8
// outputs, and ops' FP8 GEMM writes fp32 or bf16 (an amax of C, where a recipe wants one, is a separate
// pass).
//
// Per shape (dtypes (C's included), orientation, sizes, leading dimensions, pointer alignments) the matmul
// descriptor, layouts and the heuristic's first algorithm are made once and cached; one 32 MiB workspace
// (Hopper's recommended size) serves every call. Everything runs on cuda::stream(); a mutex makes the calls
// thread-safe.
#include <cublasLt.h>
#include <cuda.h>  // CUresult, CUdeviceptr: cuMemsetD32Async's signature (fetched through the runtime)
#include <dlfcn.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "forge/core/error.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/device_allocator.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/support.h"

namespace forge::cuda {
namespace {

// cuBLASLt is loaded on the first GEMM (dlopen), not linked: the library is over 500 MB, and loading it cost
// every process that links libforge about 0.35 s at start on the CI machine, GPU or not (the test suite runs
// thousands of processes). The functions keep their header's types (decltype), so a call that compiles
// against cublasLt.h calls the same function.
struct CublasLt {
  decltype(&::cublasLtCreate) create = nullptr;
  decltype(&::cublasLtGetStatusName) status_name = nullptr;
  decltype(&::cublasLtGetStatusString) status_string = nullptr;
  decltype(&::cublasLtMatmul) matmul = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) preference_set = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) layout_create = nullptr;
  std::string error;  // why loading failed; empty when every function was found
};

const std::string& cublaslt_library() {
  static const std::string name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  return name;
}

CublasLt load_cublaslt() {
  CublasLt lt;
  void* library = dlopen(cublaslt_library().c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* why = dlerror();
    lt.error = fmt::format("cannot load {} ({})", cublaslt_library(), why ? why : "no reason given");
    return lt;
  }
  const auto find = [&](auto& function, const char* symbol) {
    function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, symbol));
    if (!function && lt.error.empty()) lt.error = fmt::format("{} has no {}", cublaslt_library(), symbol);
  };
  find(lt.create, "cublasLtCreate");
  find(lt.status_name, "cublasLtGetStatusName");
  find(lt.status_string, "cublasLtGetStatusString");
  find(lt.matmul, "cublasLtMatmul");
  find(lt.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  find(lt.desc_create, "cublasLtMatmulDescCreate");
  find(lt.desc_set, "cublasLtMatmulDescSetAttribute");
  find(lt.preference_create, "cublasLtMatmulPreferenceCreate");
  find(lt.preference_destroy, "cublasLtMatmulPreferenceDestroy");
  find(lt.preference_set, "cublasLtMatmulPreferenceSetAttribute");
  find(lt.layout_create, "cublasLtMatrixLayoutCreate");
  return lt;  // the library stays loaded for the process's life
}

const CublasLt& loaded() {
  static const CublasLt table = load_cublaslt();
  return table;
}

const CublasLt& lt() {
  const CublasLt& table = loaded();
  if (!table.error.empty()) fail("gemm: {}", table.error);
  return table;
}

void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt error in {} ({}:{}): {}: {}", what, file, line, lt().status_name(status),
         lt().status_string(status));
}
#define FORGE_CUBLASLT_CHECK(call) check_cublas((call), #call, __FILE__, __LINE__)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// FP8 scale pointers: the alignment cuBLASLt needs (allocation starts are at least this aligned), and the
// scratch slots, kScaleSlotBytes apart: 0 and 1 host values (cuBLASLt's A, B), 2 and 3 copies of unaligned
// device scales (cuBLASLt's A, B).
constexpr size_t kScaleAlignment = 16;
constexpr size_t kScaleSlotBytes = 256;
constexpr int kScaleSlots = 4;
constexpr uint32_t kMaxAlignment = 256;  // cuBLASLt's default assumption; nothing asks for more

bool is_fp8(DType dtype) { return dtype == DType::e4m3 || dtype == DType::e5m2; }

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::e4m3:
      return CUDA_R_8F_E4M3;
    case DType::e5m2:
      return CUDA_R_8F_E5M2;
    default:
      fail("gemm: no cuBLASLt type for {}", dtype_name(dtype));
  }
}

// The largest power of two (up to 256) dividing the address: views into fused buffers (q|k|v, gate|up) are
// not 256-byte aligned, and an algorithm chosen for aligned pointers may not run on them.
uint32_t alignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  if (address == 0) return kMaxAlignment;
  const uintptr_t lowest = address & (~address + 1);
  return lowest >= kMaxAlignment ? kMaxAlignment : static_cast<uint32_t>(lowest);
}

// forge's row-major name of an orientation: NT = trans_b (the forward y = x W^T).
std::string orientation(bool trans_a, bool trans_b) {
  return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N");
}

struct PlanKey {
  DType a_dtype, b_dtype, c_dtype;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t align_a, align_b, align_c;
  bool fast_accumulation = false;  // FP8 only
  auto tie() const {
    return std::tie(a_dtype, b_dtype, c_dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, align_a, align_b,
                    align_c, fast_accumulation);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
  std::string describe() const {
    return fmt::format(
        "{}x{} -> {} {} m={} n={} k={} lda={} ldb={} ldc={} (pointer alignment a={} b={} c={} bytes){}",
        dtype_name(a_dtype), dtype_name(b_dtype), dtype_name(c_dtype), orientation(trans_a, trans_b), m, n, k,
        lda, ldb, ldc, align_a, align_b, align_c, fast_accumulation ? ", fast accumulation" : "");
  }
};

// One shape's descriptors, in cuBLASLt's roles (lt_a describes forge's B, lt_b forge's A).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  const void* scale_pointers[2] = {nullptr, nullptr};  // FP8: the A/B scale pointers desc holds now
};

using MemsetD32Async = CUresult (*)(CUdeviceptr, unsigned int, size_t, CUstream);

// The process-wide cuBLASLt state. Created on the first GEMM, never destroyed (its device memory and handle
// would otherwise be released during static destruction, possibly after the runtime).
class Engine {
 public:
  static Engine& get() {
    static Engine* engine = new Engine();
    return *engine;
  }

  std::mutex mutex;

  Plan& plan(const PlanKey& key) {
    auto it = plans_.find(key);
    if (it == plans_.end()) it = plans_.emplace(key, make_plan(key)).first;
    return it->second;
  }

  // Points the FP8 scale scratch at (lt_a_scale, lt_b_scale) in stream order, unless it holds them already
  // (every write goes through here on the one stream, so the last values written are what later work reads).
  void set_fp8_scales(float lt_a_scale, float lt_b_scale) {
    if (scales_valid_ && std::memcmp(&lt_a_scale, &last_scales_[0], sizeof(float)) == 0 &&
        std::memcmp(&lt_b_scale, &last_scales_[1], sizeof(float)) == 0)
      return;
    const float values[2] = {lt_a_scale, lt_b_scale};
    for (int i = 0; i < 2; ++i) {
      unsigned int bits;
      std::memcpy(&bits, &values[i], sizeof bits);
      const CUresult r = memset_d32_(reinterpret_cast<CUdeviceptr>(slot(i)), bits, 1, stream());
      if (r != CUDA_SUCCESS)
        fail("fp8_gemm: cuMemsetD32Async of a scale failed with CUresult {}", static_cast<int>(r));
    }
    last_scales_[0] = lt_a_scale, last_scales_[1] = lt_b_scale;
    scales_valid_ = true;
  }

  // Scratch float i (0: cuBLASLt's A = forge's B, 1: cuBLASLt's B = forge's A), which set_fp8_scales writes.
  const float* scale_scratch(int i) const { return slot(i); }

  // A device scale for cuBLASLt's operand i (0: A, 1: B) at an address cuBLASLt takes: `scale` itself when
  // kScaleAlignment-aligned, else a copy in slot 2 + i, made in stream order (the GEMM enqueued next reads
  // it; a later copy into the same slot runs after that GEMM).
  const float* aligned_scale(const float* scale, int i) {
    if (reinterpret_cast<uintptr_t>(scale) % kScaleAlignment == 0) return scale;
    float* copy = slot(2 + i);
    FORGE_CUDA_CHECK(cudaMemcpyAsync(copy, scale, sizeof(float), cudaMemcpyDeviceToDevice, stream()));
    return copy;
  }

  // Points the plan's A/B scale pointers at these device floats (set_fp8_scales' scratch or the caller's).
  void set_scale_pointers(Plan& plan, const float* lt_a_scale, const float* lt_b_scale) {
    const void* pointers[2] = {lt_a_scale, lt_b_scale};
    const cublasLtMatmulDescAttributes_t attributes[2] = {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                          CUBLASLT_MATMUL_DESC_B_SCALE_POINTER};
    for (int i = 0; i < 2; ++i) {
      if (plan.scale_pointers[i] == pointers[i]) continue;
      FORGE_CUBLASLT_CHECK(lt().desc_set(plan.desc, attributes[i], &pointers[i], sizeof pointers[i]));
      plan.scale_pointers[i] = pointers[i];
    }
  }

  void run(const Plan& plan, const void* lt_a, const void* lt_b, void* c, float alpha, float beta) {
    FORGE_CUBLASLT_CHECK(lt().matmul(handle_, plan.desc, &alpha, lt_a, plan.lt_a, lt_b, plan.lt_b, &beta, c,
                                     plan.lt_c, c, plan.lt_c, &plan.algo, workspace_, kWorkspaceBytes,
                                     stream()));
  }

 private:
  Engine() {
    FORGE_CUBLASLT_CHECK(lt().create(&handle_));
    workspace_ = device_alloc(kWorkspaceBytes);
    scales_ = static_cast<float*>(device_alloc(kScaleSlots * kScaleSlotBytes));
    FORGE_CHECK(reinterpret_cast<uintptr_t>(scales_) % kScaleAlignment == 0,
                "fp8_gemm: the scale scratch is not {}-byte aligned", kScaleAlignment);
    // The driver's cuMemsetD32Async through the runtime, so that libforge needs no link to libcuda.
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FORGE_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuMemsetD32Async", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !fn)
      fail("fp8_gemm: the CUDA driver does not provide cuMemsetD32Async (query result {})",
           static_cast<int>(found));
    memset_d32_ = reinterpret_cast<MemsetD32Async>(fn);
  }

  Plan make_plan(const PlanKey& key) {
    const bool fp8 = is_fp8(key.a_dtype);
    Plan p;
    FORGE_CUBLASLT_CHECK(lt().desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is forge's B
    const int32_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    FORGE_CUBLASLT_CHECK(lt().desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    FORGE_CUBLASLT_CHECK(lt().desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    if (fp8) {
      // The scale pointers start at the scratch (the heuristic sees an FP8 descriptor with scales); each call
      // points them where its scales are (set_scale_pointers).
      set_scale_pointers(p, slot(0), slot(1));
      const int8_t fast_accumulation = key.fast_accumulation ? 1 : 0;
      FORGE_CUBLASLT_CHECK(lt().desc_set(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accumulation,
                                         sizeof fast_accumulation));
    }
    const auto rows = [](int64_t x) { return static_cast<uint64_t>(x); };
    FORGE_CUBLASLT_CHECK(lt().layout_create(&p.lt_a, cuda_type(key.b_dtype),
                                            rows(key.trans_b ? key.k : key.n),
                                            rows(key.trans_b ? key.n : key.k), key.ldb));
    FORGE_CUBLASLT_CHECK(lt().layout_create(&p.lt_b, cuda_type(key.a_dtype),
                                            rows(key.trans_a ? key.m : key.k),
                                            rows(key.trans_a ? key.k : key.m), key.lda));
    FORGE_CUBLASLT_CHECK(
        lt().layout_create(&p.lt_c, cuda_type(key.c_dtype), rows(key.n), rows(key.m), key.ldc));

    cublasLtMatmulPreference_t preference = nullptr;
    FORGE_CUBLASLT_CHECK(lt().preference_create(&preference));
    const uint64_t workspace = kWorkspaceBytes;
    FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                             sizeof workspace));
    const uint32_t align_lt_a = key.align_b, align_lt_b = key.align_a, align_c = key.align_c;
    FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                             &align_lt_a, sizeof align_lt_a));
    FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             &align_lt_b, sizeof align_lt_b));
    FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                             sizeof align_c));
    FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                             sizeof align_c));
    if (key.c_dtype != DType::f32) {
      // A split-K algorithm that reduced its parts in the output type (in place in D, or through workspace in
      // that type) would round to bf16 once per part; only fp32 (compute-type) reductions keep one rounding.
      const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      FORGE_CUBLASLT_CHECK(lt().preference_set(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                               &reductions, sizeof reductions));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        lt().heuristic(handle_, p.desc, p.lt_a, p.lt_b, p.lt_c, p.lt_c, preference, 1, &result, &found);
    lt().preference_destroy(preference);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0)
      fail("{}: cuBLASLt has no algorithm for {} ({}){}", fp8 ? "fp8_gemm" : "gemm", key.describe(),
           status != CUBLAS_STATUS_SUCCESS ? lt().status_name(status) : "no heuristic result",
           fp8 ? "; FP8 needs k, lda, ldb multiples of 16 and 16-byte aligned operands and C rows" : "");
    p.algo = result.algo;
    return p;
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  float* slot(int i) const {
    return reinterpret_cast<float*>(reinterpret_cast<char*>(scales_) +
                                    static_cast<size_t>(i) * kScaleSlotBytes);
  }

  float* scales_ = nullptr;  // device: kScaleSlots slots of kScaleSlotBytes bytes (see slot())
  float last_scales_[2] = {0, 0};
  bool scales_valid_ = false;
  MemsetD32Async memset_d32_ = nullptr;
  std::map<PlanKey, Plan> plans_;
};

// A host pointer handed to cuBLASLt would fault on the device and poison the context for the whole process,
// so each operand is checked first (one driver query, no synchronisation).
void check_device_pointer(const char* op, const char* name, const void* ptr) {
  cudaPointerAttributes attributes{};
  FORGE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    fail("{}: {} ({}) is not device memory; the CUDA backend takes device pointers", op, name, ptr);
}

bool shape_ok(const char* op, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, bool trans_a,
              const void* b, int64_t ldb, bool trans_b, const void* c, int64_t ldc, std::string* reason) {
  using ops::refuse;
  if (m <= 0 || n <= 0 || k <= 0) return refuse(reason, "{}: empty problem m={} n={} k={}", op, m, n, k);
  if (!a || !b || !c) return refuse(reason, "{}: null operand pointer (a, b or c)", op);
  const int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < a_cols)
    return refuse(reason, "{}: lda {} is smaller than A's {} stored columns", op, lda, a_cols);
  if (ldb < b_cols)
    return refuse(reason, "{}: ldb {} is smaller than B's {} stored columns", op, ldb, b_cols);
  if (ldc < n) return refuse(reason, "{}: ldc {} is smaller than n {}", op, ldc, n);
  return true;
}

// The output rules of ops.h (f32, or bf16 from bf16 or FP8 operands), then C's element alignment.
bool output_ok(const char* op, DType c_dtype, DType operand_dtype, const void* c, std::string* reason) {
  if (!ops::supports_gemm_output(op, c_dtype, operand_dtype, reason)) return false;
  if (alignment(c) < dtype_size(c_dtype))
    return ops::refuse(reason, "{}: c ({}) is not aligned to its {}-byte {} elements", op, c,
                       dtype_size(c_dtype), dtype_name(c_dtype));
  return true;
}

}  // namespace

bool supports_gemm(const ops::GemmParams& p, std::string* reason) {
  if (p.ab_dtype != DType::f32 && p.ab_dtype != DType::bf16)
    return ops::refuse(reason, "gemm: operands must be fp32 or bf16 on CUDA, got {}", dtype_name(p.ab_dtype));
  return shape_ok("gemm", p.m, p.n, p.k, p.a, p.lda, p.trans_a, p.b, p.ldb, p.trans_b, p.c, p.ldc, reason) &&
         output_ok("gemm", p.c_dtype, p.ab_dtype, p.c, reason);
}

void gemm(const ops::GemmParams& p) {
  if (std::string why; !supports_gemm(p, &why)) fail("{}", why);
  if (!available()) fail("gemm: {}", describe_device());  // "no usable GPU (...)"
  check_device_pointer("gemm", "a", p.a);
  check_device_pointer("gemm", "b", p.b);
  check_device_pointer("gemm", "c", p.c);
  const PlanKey key{
      p.ab_dtype, p.ab_dtype, p.c_dtype, p.trans_a,      p.trans_b,      p.m,           p.n, p.k,
      p.lda,      p.ldb,      p.ldc,     alignment(p.a), alignment(p.b), alignment(p.c)};
  Engine& engine = Engine::get();
  std::lock_guard<std::mutex> lock(engine.mutex);
  engine.run(engine.plan(key), p.b, p.a, p.c, p.alpha, p.beta);
}

bool supports_fp8_gemm(const ops::Fp8GemmParams& p, std::string* reason) {
  using ops::refuse;
  if (p.accumulator_bits != 0)
    return refuse(
        reason,
        "fp8_gemm: limited-precision accumulation (accumulator_bits = {}) is not implemented on CUDA yet (it "
        "is "
        "the CPU's model of the tensor cores)",
        p.accumulator_bits);
  // Block scaling: forge's own kernel's limits.
  if (p.scaling == ops::Fp8Scaling::block) return supports_fp8_block_gemm(p, reason);
  if (!is_fp8(p.a_dtype) || !is_fp8(p.b_dtype))
    return refuse(reason, "fp8_gemm: a_dtype and b_dtype must be e4m3 or e5m2, got {} and {}",
                  dtype_name(p.a_dtype), dtype_name(p.b_dtype));
  if (p.a_dtype == DType::e5m2 && p.b_dtype == DType::e5m2)
    return refuse(reason,
                  "fp8_gemm: e5m2 x e5m2 has no FP8 tensor-core instruction (one operand must be e4m3)");
  if (!shape_ok("fp8_gemm", p.m, p.n, p.k, p.a, p.lda, p.trans_a, p.b, p.ldb, p.trans_b, p.c, p.ldc,
                reason) ||
      !output_ok("fp8_gemm", p.c_dtype, p.a_dtype, p.c, reason))
    return false;
  if (p.trans_a || !p.trans_b)
    return refuse(
        reason,
        "fp8_gemm: the {} orientation (A stored {}, B stored {}) is not supported on CUDA: FP8 tensor cores "
        "need "
        "both operands K-major, i.e. NT (trans_a = false, trans_b = true: A [m,k], B [n,k]); pass transposed "
        "copies (backward_input: W^T stored [in,out]; backward_weight: dy^T [out,tokens] and x^T "
        "[in,tokens])",
        orientation(p.trans_a, p.trans_b), p.trans_a ? "[k,m]" : "[m,k]", p.trans_b ? "[n,k]" : "[k,n]");
  if (p.lda % 16 != 0 || p.ldb % 16 != 0 || alignment(p.a) < 16 || alignment(p.b) < 16)
    return refuse(
        reason,
        "fp8_gemm: FP8 tensor cores need 16-byte aligned operands: lda {} and ldb {} must be multiples of 16 "
        "and "
        "a, b 16-byte aligned (alignments {} and {} bytes)",
        p.lda, p.ldb, alignment(p.a), alignment(p.b));
  if (p.c_dtype == DType::bf16 && (p.ldc % 8 != 0 || alignment(p.c) < 16))
    return refuse(
        reason,
        "fp8_gemm: a bf16 C needs 16-byte rows for FP8 tensor cores: ldc {} must be a multiple of 8 and c "
        "16-byte aligned (alignment {} bytes)",
        p.ldc, alignment(p.c));
  // Host values only: one behind a pointer is on the device, and reading it would wait for the device.
  if ((!p.a_scale_inv_ptr && !std::isfinite(p.a_scale_inv)) ||
      (!p.b_scale_inv_ptr && !std::isfinite(p.b_scale_inv)))
    return refuse(reason, "fp8_gemm: per-tensor scale_inv must be finite, got a_scale_inv={} b_scale_inv={}",
                  p.a_scale_inv, p.b_scale_inv);
  return true;
}

void fp8_gemm(const ops::Fp8GemmParams& p) {
  // Parameters first (these need no GPU), then the device.
  if (std::string why; !supports_fp8_gemm(p, &why)) fail("{}", why);
  // Block scaling runs forge's own kernel (cuBLASLt's block-scaled modes take other scale layouts).
  if (p.scaling == ops::Fp8Scaling::block) return fp8_block_gemm(p);
  static const int capability = compute_capability();  // a device-properties query: once
  if (capability < 89)
    fail("fp8_gemm needs FP8 tensor cores (compute capability 8.9 or newer): {}", describe_device());
  check_device_pointer("fp8_gemm", "a", p.a);
  check_device_pointer("fp8_gemm", "b", p.b);
  check_device_pointer("fp8_gemm", "c", p.c);
  if (p.a_scale_inv_ptr) check_device_pointer("fp8_gemm", "a_scale_inv_ptr", p.a_scale_inv_ptr);
  if (p.b_scale_inv_ptr) check_device_pointer("fp8_gemm", "b_scale_inv_ptr", p.b_scale_inv_ptr);
  const PlanKey key{p.a_dtype,
                    p.b_dtype,
                    p.c_dtype,
                    p.trans_a,
                    p.trans_b,
                    p.m,
                    p.n,
                    p.k,
                    p.lda,
                    p.ldb,
                    p.ldc,
                    alignment(p.a),
                    alignment(p.b),
                    alignment(p.c),
                    p.fast_accumulation};
  Engine& engine = Engine::get();
  std::lock_guard<std::mutex> lock(engine.mutex);
  Plan& plan = engine.plan(key);
  // cuBLASLt's A is forge's B. Host values go through the scratch (written only when they change).
  if (!p.a_scale_inv_ptr || !p.b_scale_inv_ptr) engine.set_fp8_scales(p.b_scale_inv, p.a_scale_inv);
  engine.set_scale_pointers(
      plan, p.b_scale_inv_ptr ? engine.aligned_scale(p.b_scale_inv_ptr, 0) : engine.scale_scratch(0),
      p.a_scale_inv_ptr ? engine.aligned_scale(p.a_scale_inv_ptr, 1) : engine.scale_scratch(1));
  engine.run(plan, p.b, p.a, p.c, p.alpha, p.beta);
}

bool cublaslt_loadable(std::string* reason) {
  const CublasLt& table = loaded();
  if (!table.error.empty() && reason) *reason = table.error;
  return table.error.empty();
}

}  // namespace forge::cuda
