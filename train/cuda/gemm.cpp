// The three products of a linear layer on cuBLASLt, in the row-major conventions of the CPU twin.
//
// cuBLASLt is column-major: D [m, n] = alpha op(A) [m, k] op(B) [k, n] + beta C, each matrix
// described by its stored layout (rows, columns, leading dimension) before op. A row-major
// [R, C] matrix is, byte for byte, the column-major [C, R] matrix (its transpose) with leading
// dimension C. So each row-major product P = L R is computed as its transpose P^T = R^T L^T, with
// P^T, R^T and L^T read straight from the row-major buffers:
//
//   forward: Y = X W^T  ->  Y^T [out, rows] = W [out, in] X^T [in, rows]
//     A = W   memory is W^T [in, out];    op(A) = W needs transa = T;  stored [in, out],   lda in
//     B = X   memory is X^T [in, rows];   op(B) = X^T,    transb = N;  stored [in, rows],  ldb in
//     D = Y   memory is Y^T [out, rows];  m = out, n = rows, k = in;  bf16, ldd out
//
//   backward_input: dX = dY W  ->  dX^T [in, rows] = W^T [in, out] dY^T [out, rows]
//     A = W   memory is W^T [in, out];    op(A) = W^T,    transa = N;  stored [in, out],   lda in
//     B = dY  memory is dY^T [out, rows]; op(B) = dY^T,   transb = N;  stored [out, rows], ldb out
//     D = dX  memory is dX^T [in, rows];  m = in, n = rows, k = out;  bf16, ldd in
//
//   backward_weight: dW = dY^T X  ->  dW^T [in, out] = X^T [in, rows] dY [rows, out]
//     A = X   memory is X^T [in, rows];   op(A) = X^T,    transa = N;  stored [in, rows],  lda in
//     B = dY  memory is dY^T [out, rows]; op(B) = dY,     transb = T;  stored [out, rows], ldb out
//     D = dW  memory is dW^T [in, out];   m = in, n = out, k = rows;  fp32, ldd in
//
// (A is stored [m, k] for N and [k, m] for T; B is stored [k, n] for N and [n, k] for T.)
//
// (Check, forward: Y^T[o, r] = sum_i W[o, i] X[r, i] = Y[r, o]; backward_input: dX^T[i, r] =
// sum_o W[o, i] dY[r, o] = dX[r, i]; backward_weight: dW^T[i, o] = sum_r X[r, i] dY[r, o] =
// dW[o, i].)
//
// The leading dimensions are in_features and out_features only, so those two must be multiples
// of 8: every column then starts on a 16-byte boundary, which the tensor-core kernels need. rows
// is never a leading dimension and may be any positive count. C has D's layout: D itself, or the
// forward's residual R (beta = 0 for Write::overwrite, when C is not read; beta = 1 for
// Write::add).
//
// The heuristic's choice depends on the pointers' alignment (by default it assumes 256 bytes), so
// the cache key holds the alignment the call's pointers actually have, from 16 to 256 bytes.
#include "train/cuda/gemm.hpp"
#include "train/cuda/ops.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string_view>

#include "ringattn/error.hpp"
#include "src/cuda/cuda_check.hpp"
#include "src/cuda/device_buffer.hpp"

namespace ringattn::train::cuda {
namespace {

// RINGATTN_GEMM_WORKSPACE_MIB's workspace (gemm_workspace_bytes), read once.
std::size_t workspace_bytes() {
  static const std::size_t bytes =
      gemm_workspace_bytes(std::getenv("RINGATTN_GEMM_WORKSPACE_MIB"));
  return bytes;
}
constexpr std::uintptr_t kMinAlignment = 16;
constexpr std::uintptr_t kMaxAlignment = 256;

enum class Product { forward, backward_input, backward_weight };

void check(cublasStatus_t code, const char* call, const char* where) {
  ringattn::detail::check_cublas(code, call, where);
}

void log_failure(cublasStatus_t code, const char* call) noexcept {
  if (code == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "ringattn: train::cuda::Gemm: %s failed: %s\n", call,
               cublasGetStatusString(code));
}

// One cached problem: everything but the pointers.
struct Key {
  Product product;
  std::int64_t rows, in_features, out_features;
  Write write;
  std::uintptr_t alignment;
  auto operator<=>(const Key&) const = default;
};

// A matrix as cuBLASLt stores it: column-major rows x cols with leading dimension ld.
struct Stored {
  cudaDataType_t type;
  std::int64_t rows, cols, ld;
};

// The column-major problem of one row-major product (the derivation at the top of the file).
struct Problem {
  cublasOperation_t trans_a, trans_b;
  Stored a, b, d;
};

Problem problem_of(Product product, const cpu::MatmulShape& s) {
  const std::int64_t rows = s.rows, in = s.in_features, out = s.out_features;
  switch (product) {
    case Product::forward:
      return {CUBLAS_OP_T,
              CUBLAS_OP_N,
              {CUDA_R_16BF, in, out, in},      // W
              {CUDA_R_16BF, in, rows, in},     // X
              {CUDA_R_16BF, out, rows, out}};  // Y
    case Product::backward_input:
      return {CUBLAS_OP_N,
              CUBLAS_OP_N,
              {CUDA_R_16BF, in, out, in},     // W
              {CUDA_R_16BF, out, rows, out},  // dY
              {CUDA_R_16BF, in, rows, in}};   // dX
    case Product::backward_weight:
      return {CUBLAS_OP_N,
              CUBLAS_OP_T,
              {CUDA_R_16BF, in, rows, in},    // X
              {CUDA_R_16BF, out, rows, out},  // dY
              {CUDA_R_32F, in, out, in}};     // dW
  }
  return {};
}

// The descriptors and the algorithm of one Key, destroyed with it.
class Plan {
 public:
  Plan(cublasLtHandle_t handle, const Key& key, const Problem& p, const char* where) {
    try {
      create(handle, key, p, where);
    } catch (...) {
      release();
      throw;
    }
  }

  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() { release(); }

  // D = alpha op(A) op(B) + beta C, C in D's layout.
  void run(cublasLtHandle_t handle, const void* a, const void* b, const void* c, void* d,
           float beta, void* workspace, cudaStream_t stream, const char* where) const {
    const float alpha = 1.0f;
    check(cublasLtMatmul(handle, desc_, &alpha, a, a_, b, b_, &beta, c, d_, d, d_, &algo_,
                         workspace, workspace_bytes(), stream),
          "cublasLtMatmul", where);
  }

 private:
  void create(cublasLtHandle_t handle, const Key& key, const Problem& p, const char* where) {
    check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
          "cublasLtMatmulDescCreate", where);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &p.trans_a,
                                         sizeof(p.trans_a)),
          "cublasLtMatmulDescSetAttribute(TRANSA)", where);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &p.trans_b,
                                         sizeof(p.trans_b)),
          "cublasLtMatmulDescSetAttribute(TRANSB)", where);
    a_ = make_layout(p.a, where);
    b_ = make_layout(p.b, where);
    d_ = make_layout(p.d, where);

    Preference preference(where);
    const std::uint64_t workspace = workspace_bytes();
    check(cublasLtMatmulPreferenceSetAttribute(preference.get(),
                                               CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                               sizeof(workspace)),
          "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", where);
    const auto alignment = static_cast<std::uint32_t>(key.alignment);
    for (const cublasLtMatmulPreferenceAttributes_t attribute :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      check(cublasLtMatmulPreferenceSetAttribute(preference.get(), attribute, &alignment,
                                                 sizeof(alignment)),
            "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)", where);
    }

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle, desc_, a_, b_, d_, d_, preference.get(), 1,
                                         &result, &found),
          "cublasLtMatmulAlgoGetHeuristic", where);
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      ringattn::detail::fail_as(
          ErrorKind::library, where, "cuBLASLt has no algorithm for rows = ", key.rows,
          ", in_features = ", key.in_features, ", out_features = ", key.out_features, " at ",
          key.alignment, "-byte alignment");
    }
    algo_ = result.algo;
  }

  void release() noexcept {
    if (d_ != nullptr) log_failure(cublasLtMatrixLayoutDestroy(d_), "cublasLtMatrixLayoutDestroy");
    if (b_ != nullptr) log_failure(cublasLtMatrixLayoutDestroy(b_), "cublasLtMatrixLayoutDestroy");
    if (a_ != nullptr) log_failure(cublasLtMatrixLayoutDestroy(a_), "cublasLtMatrixLayoutDestroy");
    if (desc_ != nullptr) {
      log_failure(cublasLtMatmulDescDestroy(desc_), "cublasLtMatmulDescDestroy");
    }
    d_ = b_ = a_ = nullptr;
    desc_ = nullptr;
  }

  class Preference {
   public:
    explicit Preference(const char* where) {
      check(cublasLtMatmulPreferenceCreate(&preference_), "cublasLtMatmulPreferenceCreate", where);
    }
    Preference(const Preference&) = delete;
    Preference& operator=(const Preference&) = delete;
    ~Preference() {
      log_failure(cublasLtMatmulPreferenceDestroy(preference_), "cublasLtMatmulPreferenceDestroy");
    }
    cublasLtMatmulPreference_t get() const { return preference_; }

   private:
    cublasLtMatmulPreference_t preference_ = nullptr;
  };

  static cublasLtMatrixLayout_t make_layout(const Stored& s, const char* where) {
    cublasLtMatrixLayout_t layout = nullptr;
    check(cublasLtMatrixLayoutCreate(&layout, s.type, static_cast<std::uint64_t>(s.rows),
                                     static_cast<std::uint64_t>(s.cols), s.ld),
          "cublasLtMatrixLayoutCreate", where);
    return layout;
  }

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

class Handle {
 public:
  Handle() { check(cublasLtCreate(&handle_), "cublasLtCreate", "train::cuda::Gemm::Gemm"); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { log_failure(cublasLtDestroy(handle_), "cublasLtDestroy"); }
  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

void check_pointer(const char* where, std::string_view name, const void* pointer) {
  if (pointer == nullptr) ringattn::detail::fail(where, name, " is null; expected device memory");
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  if (address % kMinAlignment != 0) {
    ringattn::detail::fail(where, name, " (address ", pointer, ") is not ", kMinAlignment,
                           "-byte aligned; cuBLASLt's bf16 kernels need 16-byte aligned buffers");
  }
}

void check_shape(const char* where, const cpu::MatmulShape& s) {
  train::detail::check_positive(where, "shape.rows", s.rows);
  train::detail::check_positive(where, "shape.in_features", s.in_features);
  train::detail::check_positive(where, "shape.out_features", s.out_features);
  // The leading dimensions: 8 bf16 (or fp32) elements keep every column 16-byte aligned.
  if (s.in_features % 8 != 0) {
    ringattn::detail::fail(where, "shape.in_features is ", s.in_features,
                           "; expected a multiple of 8 (a leading dimension of the GEMM)");
  }
  if (s.out_features % 8 != 0) {
    ringattn::detail::fail(where, "shape.out_features is ", s.out_features,
                           "; expected a multiple of 8 (a leading dimension of the GEMM)");
  }
}

// A product's pointer arguments, named as in its signature.
struct Operand {
  std::string_view name;
  const void* pointer;
};

// The checks of every product, before anything is enqueued: the output and the two operands in
// the order of the signature, then the shape.
void check_arguments(const char* where, const Operand (&operands)[3],
                     const cpu::MatmulShape& shape) {
  for (const Operand& operand : operands) check_pointer(where, operand.name, operand.pointer);
  check_shape(where, shape);
}

// The largest power of two from 16 to 256 that divides every address.
std::uintptr_t common_alignment(const void* a, const void* b, const void* d, const void* c) {
  const std::uintptr_t bits =
      reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b) |
      reinterpret_cast<std::uintptr_t>(d) | reinterpret_cast<std::uintptr_t>(c) | kMaxAlignment;
  return std::max(kMinAlignment, bits & (~bits + 1));
}

}  // namespace

// 32 MiB by default: the workspace NVIDIA recommends for cuBLAS on Hopper (split-K and stream-K
// kernels reduce through it).
std::size_t gemm_workspace_bytes(const char* mib) {
  if (mib == nullptr || *mib == '\0') return std::size_t{32} << 20;
  char* end = nullptr;
  const long value = std::strtol(mib, &end, 10);
  if (*end != '\0' || value < 0 || value > 1024) {
    ringattn::detail::fail("RINGATTN_GEMM_WORKSPACE_MIB", "value '", mib,
                           "' is not a whole number of MiB in [0, 1024]");
  }
  return static_cast<std::size_t>(value) << 20;
}

struct Gemm::Impl {
  explicit Impl(cudaStream_t s) : stream(s), workspace(workspace_bytes()) {}

  // D (+)= the product: A and B as in problem_of, D the output; Write::add is cuBLASLt's
  // beta = 1 with C = the residual where one is given, else C = D.
  void run(const char* where, Product product, void* d, const void* a, const void* b,
           const cpu::MatmulShape& shape, Write write, const void* residual = nullptr) {
    const void* c = residual != nullptr ? residual : d;
    const Key key{product,          shape.rows, shape.in_features, shape.out_features, write,
                  common_alignment(a, b, d, c)};
    auto it = plans.find(key);
    if (it == plans.end()) {
      auto plan = std::make_unique<Plan>(handle.get(), key, problem_of(product, shape), where);
      it = plans.emplace(key, std::move(plan)).first;
    }
    it->second->run(handle.get(), a, b, c, d, write == Write::add ? 1.0f : 0.0f,
                    workspace.data(), stream, where);
  }

  cudaStream_t stream;
  Handle handle;
  DeviceBuffer workspace;
  std::map<Key, std::unique_ptr<Plan>> plans;
};

Gemm::Gemm(cudaStream_t stream) : impl_(std::make_unique<Impl>(stream)) {}

Gemm::~Gemm() = default;

cudaStream_t Gemm::stream() const {
  return impl_->stream;
}

void Gemm::forward(__nv_bfloat16* y, const __nv_bfloat16* x, const __nv_bfloat16* w,
                   const cpu::MatmulShape& shape, Write write,
                   const __nv_bfloat16* residual) {
  constexpr const char* kWhere = "train::cuda::Gemm::forward";
  check_arguments(kWhere, {{"y", y}, {"x", x}, {"w", w}}, shape);
  if (residual != nullptr && write != Write::add) {
    ringattn::detail::fail(kWhere, "residual is given with Write::overwrite; expected Write::add ",
                           "(y = residual + x W^T)");
  }
  if (residual != nullptr) check_pointer(kWhere, "residual", residual);
  impl_->run(kWhere, Product::forward, y, w, x, shape, write, residual);
}

void Gemm::backward_input(__nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* w,
                          const cpu::MatmulShape& shape, Write write) {
  constexpr const char* kWhere = "train::cuda::Gemm::backward_input";
  check_arguments(kWhere, {{"dx", dx}, {"dy", dy}, {"w", w}}, shape);
  impl_->run(kWhere, Product::backward_input, dx, w, dy, shape, write);
}

void Gemm::backward_weight(float* dw, const __nv_bfloat16* dy, const __nv_bfloat16* x,
                           const cpu::MatmulShape& shape, Write write) {
  constexpr const char* kWhere = "train::cuda::Gemm::backward_weight";
  check_arguments(kWhere, {{"dw", dw}, {"dy", dy}, {"x", x}}, shape);
  impl_->run(kWhere, Product::backward_weight, dw, x, dy, shape, write);
}

}  // namespace ringattn::train::cuda
