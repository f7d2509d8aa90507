// XLA FFI handlers for the batched Householder R factor (qr_r.cuh), float32 and float64.
//
// Operand x: (*batch, m, c), row-major, with 1 <= c <= 64, m >= c and m * c * sizeof(T) <= 40960
// bytes. Result r: (*batch, c, c), the upper-triangular factor of x = Q R (LAPACK dgeqrf signs: the
// diagonal may be negative), zeros below the diagonal. Other shapes are rejected with
// InvalidArgument.
#include <cuda_runtime.h>

#include <cstdint>

#include "csrc/xla_ffi.h"
#include "qr_r.cuh"

namespace ffi = xla::ffi;
using jaxforge::ShapeString;
namespace qr = jaxforge::qr_r;

namespace {

template <ffi::DataType DT>
ffi::Error QrRImpl(cudaStream_t stream, ffi::Buffer<DT> x, ffi::ResultBuffer<DT> r) {
  using T = ffi::NativeType<DT>;
  const auto dims = x.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("qr_r: operand must have rank >= 2, got shape " +
                                       ShapeString(dims));
  }
  const int64_t m = dims[dims.size() - 2];
  const int64_t c = dims[dims.size() - 1];
  if (!qr::supported<T>(m, c)) {
    return ffi::Error::InvalidArgument(
        "qr_r: operand shape " + ShapeString(dims) + " is outside the kernel's limits 1 <= c <= " +
        std::to_string(qr::kMaxCols) + ", m >= c, m * c * " + std::to_string(sizeof(T)) +
        " <= " + std::to_string(qr::kMaxMatrixBytes) + " bytes (shape (..., m, c))");
  }
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) batch *= dims[i];
  // Guards against a caller whose result shape disagrees with the kernel's writes.
  if (r->element_count() != static_cast<size_t>(batch * c * c)) {
    return ffi::Error::InvalidArgument("qr_r: result shape " + ShapeString(r->dimensions()) +
                                       " does not match operand shape " + ShapeString(dims));
  }
  const cudaError_t err = qr::launch(stream, x.typed_data(), r->typed_data(), batch,
                                     static_cast<int>(m), static_cast<int>(c));
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("qr_r: CUDA launch failed: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT>
auto QrRBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<DT>>()   // x
      .template Ret<ffi::Buffer<DT>>();  // r
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRF32, QrRImpl<ffi::F32>, QrRBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeQrRF64, QrRImpl<ffi::F64>, QrRBinding<ffi::F64>());
