// XLA FFI handlers for the batched Householder R factor (qr_r.cuh) and the fused least-squares
// solve built on it (qr_solve.cuh): float32, float64, complex64 and complex128.
//
// qr_r: operand x (*batch, m, c), row-major, with 1 <= c <= 64, m >= c and m * c * sizeof(T) <=
// 40960 bytes. Result r: (*batch, c, c), the upper-triangular factor of x = Q R (LAPACK dgeqrf
// signs: the diagonal may be negative), zeros below the diagonal.
// qr_solve: operands a (*batch, m, n) and b (*batch, m, k), attribute rcond (f64); results r
// (*batch, c, c) with c = n + k when m >= n, else m; solution (*batch, n, k); certified (*batch,)
// int32 (see qr_solve.cuh).
// qr_solve_warp: the same for tiny tall real problems, one warp per matrix (qr_solve_warp.cuh).
// Other shapes are rejected with InvalidArgument.
#include <cuda_runtime.h>

#include <cstdint>

#include "csrc/xla_ffi.h"
#include "qr_solve.cuh"
#include "qr_solve_warp.cuh"

namespace ffi = xla::ffi;
using jaxforge::BatchSize;
using jaxforge::KernelData;
using jaxforge::ShapeString;
namespace qr = jaxforge::qr_r;
namespace warp = jaxforge::qr_solve_warp;

namespace {

// The operand's (batch, m, c) where the kernel supports it; else the error to return.
template <typename T>
ffi::Error OperandShape(const char* name, ffi::Span<const int64_t> dims, int64_t& batch,
                        int64_t& m, int64_t& c) {
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": operand must have rank >= 2, got shape " +
                                       ShapeString(dims));
  }
  m = dims[dims.size() - 2];
  c = dims[dims.size() - 1];
  if (!qr::supported<T>(m, c)) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": operand shape " + ShapeString(dims) +
        " is outside the kernel's limits 1 <= c <= " + std::to_string(qr::kMaxCols) +
        ", m >= c, m * c * " + std::to_string(sizeof(T)) + " <= " +
        std::to_string(qr::kMaxMatrixBytes) + " bytes (shape (..., m, c))");
  }
  batch = BatchSize(dims);
  return ffi::Error::Success();
}

// Guards against a caller whose result shape disagrees with the kernel's writes.
ffi::Error CheckResult(const char* name, const char* result, ffi::Span<const int64_t> dims,
                       size_t element_count, int64_t want, ffi::Span<const int64_t> operand) {
  if (element_count == static_cast<size_t>(want)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": result " + result + " of shape " +
                                     ShapeString(dims) + " does not match operand shape " +
                                     ShapeString(operand));
}

ffi::Error LaunchError(const char* name, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(name) + ": CUDA launch failed: " +
                              cudaGetErrorString(err));
}

template <ffi::DataType DT>
ffi::Error QrRImpl(cudaStream_t stream, ffi::Buffer<DT> x, ffi::ResultBuffer<DT> r) {
  using T = typename jaxforge::KernelType<ffi::NativeType<DT>>::type;
  int64_t batch, m, c;
  if (auto e = OperandShape<T>("qr_r", x.dimensions(), batch, m, c); e.failure()) return e;
  if (auto e = CheckResult("qr_r", "r", r->dimensions(), r->element_count(), batch * c * c,
                           x.dimensions());
      e.failure()) {
    return e;
  }
  return LaunchError("qr_r", qr::launch(stream, KernelData(x.typed_data()),
                                        KernelData(r->typed_data()), batch, static_cast<int>(m),
                                        static_cast<int>(c)));
}

// kWarp: the one-warp kernel (qr_solve_warp.cuh, real tall problems), else the block kernel.
template <ffi::DataType DT, bool kWarp>
ffi::Error QrSolveImpl(cudaStream_t stream, ffi::Buffer<DT> a, ffi::Buffer<DT> b, double rcond,
                       ffi::ResultBuffer<DT> r, ffi::ResultBuffer<DT> solution,
                       ffi::ResultBuffer<ffi::S32> certified) {
  using T = typename jaxforge::KernelType<ffi::NativeType<DT>>::type;
  const auto dims = a.dimensions();
  const auto b_dims = b.dimensions();
  if (dims.size() < 2 || b_dims.size() != dims.size()) {
    return ffi::Error::InvalidArgument("qr_solve: a must have rank >= 2 and b the same rank, got " +
                                       ShapeString(dims) + " and " + ShapeString(b_dims));
  }
  const int64_t m = dims[dims.size() - 2], n = dims[dims.size() - 1], k = b_dims[dims.size() - 1];
  bool same_batch = b_dims[dims.size() - 2] == m;
  for (size_t i = 0; i + 2 < dims.size(); ++i) same_batch = same_batch && b_dims[i] == dims[i];
  if constexpr (kWarp) {
    if (!warp::supported<T>(m, n, k) || !same_batch) {
      return ffi::Error::InvalidArgument(
          "qr_solve_warp: a " + ShapeString(dims) + " and b " + ShapeString(b_dims) +
          " are outside the kernel's limits: b (..., m, k) with a (..., m, n), the same batch, " +
          "real, n + k <= " + std::to_string(warp::kMaxCols) + " and n + k <= m <= " +
          std::to_string(32 * warp::kMaxSlots<T>));
    }
  } else if (!qr::supported_solve<T>(m, n, k) || !same_batch) {
    return ffi::Error::InvalidArgument(
        "qr_solve: a " + ShapeString(dims) + " and b " + ShapeString(b_dims) +
        " are outside the kernel's limits: b (..., m, k) with a (..., m, n), the same batch; " +
        "[A | b] (tall) or Aᴴ (wide) within the qr_r limits (<= 64 columns, " +
        std::to_string(qr::kMaxMatrixBytes) + " bytes) and the whole solve within " +
        std::to_string(qr::kMaxSolveBytes) + " bytes");
  }
  const int64_t batch = BatchSize(dims);
  const int64_t c = m >= n ? n + k : m;
  for (auto [result, result_dims, count, want] :
       {std::tuple{"r", r->dimensions(), r->element_count(), batch * c * c},
        std::tuple{"solution", solution->dimensions(), solution->element_count(), batch * n * k},
        std::tuple{"certified", certified->dimensions(), certified->element_count(), batch}}) {
    if (auto e = CheckResult("qr_solve", result, result_dims, count, want, dims); e.failure()) {
      return e;
    }
  }
  const auto launch = [&] {
    if constexpr (kWarp) return warp::launch_solve<T>;
    else return qr::launch_solve<T>;
  }();
  const cudaError_t err = launch(
      stream, KernelData(a.typed_data()), KernelData(b.typed_data()), KernelData(r->typed_data()),
      KernelData(solution->typed_data()), certified->typed_data(), batch, static_cast<int>(m),
      static_cast<int>(n), static_cast<int>(k), static_cast<jaxforge::RealOf<T>>(rcond));
  return LaunchError(kWarp ? "qr_solve_warp" : "qr_solve", err);
}

template <ffi::DataType DT>
auto QrRBinding() {
  return ffi::Ffi::Bind()
      .Ctx<jaxforge::Stream>()
      .template Arg<ffi::Buffer<DT>>()   // x
      .template Ret<ffi::Buffer<DT>>();  // r
}

template <ffi::DataType DT>
auto QrSolveBinding() {
  return ffi::Ffi::Bind()
      .Ctx<jaxforge::Stream>()
      .template Arg<ffi::Buffer<DT>>()          // a
      .template Arg<ffi::Buffer<DT>>()          // b
      .template Attr<double>("rcond")
      .template Ret<ffi::Buffer<DT>>()          // r
      .template Ret<ffi::Buffer<DT>>()          // solution
      .template Ret<ffi::Buffer<ffi::S32>>();  // certified
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRF32, QrRImpl<ffi::F32>, QrRBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRF64, QrRImpl<ffi::F64>, QrRBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRC64, QrRImpl<ffi::C64>, QrRBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRC128, QrRImpl<ffi::C128>, QrRBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveF32, (QrSolveImpl<ffi::F32, false>),
                              QrSolveBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveF64, (QrSolveImpl<ffi::F64, false>),
                              QrSolveBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveC64, (QrSolveImpl<ffi::C64, false>),
                              QrSolveBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveC128, (QrSolveImpl<ffi::C128, false>),
                              QrSolveBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveWarpF32, (QrSolveImpl<ffi::F32, true>),
                              QrSolveBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrSolveWarpF64, (QrSolveImpl<ffi::F64, true>),
                              QrSolveBinding<ffi::F64>());
